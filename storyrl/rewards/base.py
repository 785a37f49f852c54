"""The reward API shared by every metric.

A reward scores a *batch* of stories and returns a float array with NaN for
stories it cannot score. The same object is a TRL reward function: calling it
with ``prompts=..., completions=...`` returns ``list[float | None]``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

log = logging.getLogger(__name__)

# Keyword arguments TRL passes to reward functions that are not story context.
_TRL_KWARGS = frozenset({"trainer_state", "log_metric", "log_extra", "completion_ids", "environments"})


def completion_text(completion: Any) -> str | None:
    """The story text of a TRL completion: a string, or chat messages
    (``[{"role": "assistant", "content": ...}]``, content a string or a list of
    ``{"type": "text", "text": ...}`` parts). None when there is no text."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if not isinstance(completion, Sequence):
        return None
    messages = [m for m in completion if isinstance(m, Mapping)]
    replies = [m for m in messages if m.get("role") == "assistant"] or messages
    parts = []
    for message in replies:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, Sequence):
            parts.extend(
                p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            )
    return "\n".join(parts) if parts else None


class Reward:
    """Base class of storyrl rewards.

    Subclasses set ``name``, ``higher_is_better`` and ``value_range`` and
    implement :meth:`_score_batch` (valid strings in, floats out, NaN for an
    unscorable story). The base class guarantees the contract: non-string
    stories are NaN, a story whose scoring raises is NaN (and logged), and
    counts of scored and unscorable stories are kept in :attr:`stats`.
    """

    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    #: Documented (closed) range of finite scores.
    value_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)

    def __init__(self) -> None:
        # TRL names reward columns after the callable's __name__.
        self.__name__ = self.name
        self.stats = {"scored": 0, "unscorable": 0, "reasons": Counter()}

    # -- to implement -----------------------------------------------------
    def _score_batch(self, stories: list[str], **context: Any) -> np.ndarray:
        raise NotImplementedError

    def _setup(self) -> None:
        """Load models etc. before scoring. Errors here are the reward's, not
        a story's: they propagate instead of making stories NaN."""

    def _unscorable(self, reason: str, detail: str = "") -> float:
        """Record why a story gets NaN (counted in ``stats["reasons"]``, the
        first occurrences of each reason logged) and return NaN."""
        reasons = self.stats["reasons"]
        reasons[reason] += 1
        if reasons[reason] <= 3:
            log.warning("%s: unscorable story (%s)%s", self.name, reason, f": {detail}" if detail else "")
        return math.nan

    # -- public API ---------------------------------------------------------
    def score(self, stories: Sequence[Any], **context: Any) -> np.ndarray:
        """Score a batch of stories. ``context`` holds per-story sequences
        (e.g. ``images``) aligned with ``stories``; rewards ignore what they do
        not use. Returns a float64 array, NaN where a story is unscorable."""
        stories = list(stories)
        out = np.full(len(stories), np.nan)
        valid = [i for i, s in enumerate(stories) if isinstance(s, str)]
        for _ in range(len(stories) - len(valid)):
            self._unscorable("not text")
        if valid:
            sub = {k: _take(v, valid, len(stories)) for k, v in context.items()}
            texts = [stories[i] for i in valid]
            self._setup()
            try:
                out[valid] = self._score_batch(texts, **sub)
            except Exception as exc:  # isolate the story that breaks the batch
                if len(valid) == 1:
                    self._unscorable(type(exc).__name__, f"story {valid[0]}: {exc}")
                else:
                    out[valid] = self._score_one_by_one(texts, valid, sub)
        n_bad = int(np.isnan(out).sum())
        self.stats["scored"] += len(stories) - n_bad
        self.stats["unscorable"] += n_bad
        return out

    def _score_one_by_one(self, texts, index, context) -> np.ndarray:
        scores, errors = [], []
        for k, text in enumerate(texts):
            one = {key: _take(v, [k], len(texts)) for key, v in context.items()}
            try:
                scores.append(float(self._score_batch([text], **one)[0]))
            except Exception as exc:
                self._unscorable(type(exc).__name__, f"story {index[k]}: {exc}")
                errors.append(exc)
                scores.append(math.nan)
        if len(errors) == len(texts):  # not bad input: the reward itself is broken
            raise errors[0]
        return np.asarray(scores)

    def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        """TRL reward-function contract: ``None`` marks an unscorable sample.
        Dataset columns arrive in ``kwargs`` and are passed on as context."""
        if completions is None:
            raise TypeError(f"{self.name}: called without completions")
        texts = [completion_text(c) for c in completions]
        context = {k: v for k, v in kwargs.items() if k not in _TRL_KWARGS}
        scores = self.score(texts, **context)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and len(scores):
            log_metric(f"{self.name}/unscorable_frac", float(np.isnan(scores).mean()))
        return [None if math.isnan(s) else float(s) for s in scores]

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({params})"

    def config(self) -> dict[str, Any]:
        """Constructor arguments that recreate this reward (for configs/logs)."""
        return {}


def _take(value: Any, index: list[int], n: int) -> Any:
    """Select the per-story entries of a context value (other values pass through)."""
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [value[i] for i in index]
    if isinstance(value, np.ndarray) and value.ndim and len(value) == n:
        return value[index]
    return value
