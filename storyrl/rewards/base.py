"""The reward API shared by every metric.

A reward scores a *batch* of stories and returns a float array with NaN for
stories it cannot score. The same object is a TRL reward function: calling it
with ``prompts=..., completions=...`` returns ``list[float | None]``.

Each reward declares its options once, as a :class:`RewardConfig` dataclass
(its ``config_class``); ``Reward(**options)`` and ``Reward(config)`` both
validate them, ``reward.args`` holds the config (as ``trainer.args`` does in
TRL), options read as attributes (``reward.theta``), and ``config()`` and the
repr come from it.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from storyrl.config import Config, Configurable, option
from storyrl.models.runtime import PRECISIONS, ModelFailure

log = logging.getLogger(__name__)

#: Keyword arguments TRL passes to reward functions that are not story context.
TRL_KWARGS = frozenset({"trainer_state", "log_metric", "log_extra", "completion_ids", "environments"})
#: Per-story context a framework may carry (verl's ``extra_info``, OpenRLHF
#: labels, the remote reward's labels); ``story_images`` takes the place of
#: ``images``, as in TRL. Here, not in storyrl.integrations, so that the remote
#: reward need not import the layer above it.
CONTEXT_KEYS = ("reference", "story_id", "images", "story_images", "image_ids", "noun_phrases")
# A reward whose scoring raised for this many stories in a row (across calls)
# is broken, not fed bad stories: with one story per call the batch rule below
# never sees a whole failing batch.
MAX_ERRORS_IN_A_ROW = 16
_SURROGATE = re.compile("[\ud800-\udfff]")


class RewardError(RuntimeError):
    """The reward itself failed (model not loadable, scoring broken for every
    story), as opposed to an unscorable story, which gets NaN."""


class FatalRewardError(RewardError):
    """A reward failure that no retry, story by story or call by call, can
    mend (a reward server down for good, a rejected token): trainers pass it
    on and the run stops with its message."""


def clean_text(text: str) -> str:
    """Replace lone surrogates (e.g. from a JSON ``"\\ud800"`` escape or a
    broken decoder) by U+FFFD so that every tokenizer accepts the text."""
    if text.isascii():
        return text
    return _SURROGATE.sub("\ufffd", text)


def as_list(value: Any, what: str, owner: str) -> list:
    """``value`` as a list (TypeError naming ``owner`` and ``what``
    otherwise): a bare string would be scored one character at a time."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{owner}: {what} must be a list, got {type(value).__name__}")
    return list(value)


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


@dataclass
class RewardConfig(Config):
    """Base of the rewards' config dataclasses (no options of its own)."""


@dataclass
class ModelConfig(RewardConfig):
    """Options of the rewards that run a model."""

    device: str | None = option(None, "cuda, cpu, ... (default: CUDA when available).")
    precision: str = option("auto", "The dtype the model's weights are held and run in: auto (fp16 on CUDA, fp32 on "
                            "CPU), fp32, fp16 or bf16; one the model cannot run in is refused when it loads.",
                            choices=PRECISIONS)
    batch_size: int = option(64, "Inputs per forward pass.", min=1)


class Reward(Configurable):
    """Base class of storyrl rewards.

    Subclasses set ``name``, ``higher_is_better``, ``value_range`` and
    ``config_class`` and implement :meth:`_score_batch` (valid strings in,
    floats out, NaN for an unscorable story). The base class guarantees the
    contract: non-string stories are NaN, a story whose scoring raises is NaN
    (and logged), and counts of scored and unscorable stories are kept in
    :attr:`stats`.
    """

    kind = "reward"
    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    #: Documented (closed) range of finite scores.
    value_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    #: The dataclass declaring the reward's options.
    config_class: ClassVar[type[RewardConfig]] = RewardConfig
    #: Whether scoring uses the TRL call's prompts (composites: weighted's
    #: group normalisation); they reach :meth:`_score_texts`.
    uses_prompts: ClassVar[bool] = False

    def __init__(self, config: RewardConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        # TRL names reward columns after the callable's __name__.
        self.__name__ = self.name
        self.stats = {"scored": 0, "unscorable": 0, "reasons": Counter()}
        self._ok = 0  # stories whose scoring did not raise
        self._errors_in_a_row = 0

    # -- to implement -----------------------------------------------------
    def _score_batch(self, stories: list[str], **context: Any) -> np.ndarray:
        raise NotImplementedError

    def _setup(self) -> None:
        """Load models etc. before scoring. Errors here are the reward's, not
        a story's: they propagate instead of making stories NaN."""

    def setup(self) -> Reward:
        """Load the reward's models now (otherwise done on first use), so that
        a failure is reported before any work is done. Raises RewardError."""
        try:
            self._setup()
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"reward {self.name!r}: cannot load: {one_line(exc)}") from exc
        return self

    def prepare(self, context: Mapping[str, Any], progress: bool = False) -> dict[str, int]:
        """Do now, once, the work of scoring that depends only on the stories'
        context, not on their text: the image side of a dataset (region or
        image embeddings into the reward's caches, its disk cache when it has
        one), so that a training step only does text work. ``context`` holds
        per-row columns as :meth:`score` takes them (``images`` or
        ``story_images``, ``image_ids``, ``reference``, ``story_id``), one
        entry per dataset row. Resumable where the cache is on disk: what is
        cached already is skipped. Returns counts of what was done (empty
        here: nothing to prepare)."""
        return {}

    def reset_failure_streak(self) -> None:
        """Start afresh the count of stories whose scoring raised in a row
        (``MAX_ERRORS_IN_A_ROW``), this reward's and its components': for a
        caller whose calls mix independent clients (``storyrl serve``)."""
        self._errors_in_a_row = 0
        for component in getattr(self, "component_rewards", {}).values():
            component.reset_failure_streak()

    def _model_failed(self, exc: BaseException) -> RewardError:
        """The RewardError for a :class:`ModelFailure` (non-finite model
        outputs): raised once, since no story causes it."""
        return RewardError(f"reward {self.name!r}: {one_line(exc)}")

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
        not use. Returns a float64 array, NaN where a story is unscorable.

        Raises TypeError when ``stories`` is not a list, ValueError when a
        per-story context column has the wrong length, the loading error when
        the reward's models cannot load (a PrecisionError, a ValueError, when
        a model cannot run at its ``precision``), and RewardError when its
        scoring raises for every story (a broken reward, not bad input) or
        its model gives non-finite outputs (at once: no story causes that)."""
        return self._evaluate(stories, context, None)

    def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        """TRL reward-function contract: ``None`` marks an unscorable sample.
        Dataset columns arrive in ``kwargs`` and are passed on as context (see
        :func:`story_context`); the call is logged through TRL's
        ``log_metric`` / ``log_extra`` (:meth:`log`)."""
        if completions is None:
            raise TypeError(f"{self.name}: called without completions")
        texts = [completion_text(c) for c in as_list(completions, "completions", self.name)]
        context = story_context({k: v for k, v in kwargs.items() if k not in TRL_KWARGS})
        if self.uses_prompts and prompts is not None:
            prompts = as_list(prompts, "prompts", self.name)
            if len(prompts) != len(texts):
                raise ValueError(f"{self.name}: {len(prompts)} prompts for {len(texts)} completions")
            scores = self._evaluate(texts, context, prompts)
        else:  # through score, so that a subclass wrapping it sees every call
            scores = self.score(texts, **context)
        self.log(kwargs.get("log_metric"), kwargs.get("log_extra"), scores)
        return [None if math.isnan(s) else float(s) for s in scores]

    def log(self, log_metric=None, log_extra=None, scores: np.ndarray | None = None) -> None:
        """Log a call: the fraction of unscorable stories through
        ``log_metric(name, value)`` (composites add their components). TRL's
        callables or a trainer's own."""
        if callable(log_metric) and scores is not None and len(scores):
            log_metric(f"{self.name}/unscorable_frac", float(np.isnan(scores).mean()))

    def _evaluate(self, stories: Sequence[Any], context: dict[str, Any], prompts: list[Any] | None) -> np.ndarray:
        """The contract every call goes through: non-text stories are NaN,
        context columns are checked and sliced to the text stories, the
        stats count what was scored."""
        stories = as_list(stories, "stories", self.name)
        n = len(stories)
        for key, value in context.items():
            take_column(key, value, [], n)  # a column of the wrong length is the caller's error
        out = np.full(n, np.nan)
        valid = [i for i, s in enumerate(stories) if isinstance(s, str)]
        for _ in range(n - len(valid)):
            self._unscorable("not text")
        texts = [clean_text(stories[i]) for i in valid]
        sub = {k: take_column(k, v, valid, n) for k, v in context.items()}
        sub_prompts = [prompts[i] for i in valid] if prompts is not None else None
        out[valid] = self._score_texts(texts, sub, sub_prompts, valid, n)
        n_bad = int(np.isnan(out).sum())
        self.stats["scored"] += n - n_bad
        self.stats["unscorable"] += n_bad
        return out

    # -- hook for composites -----------------------------------------------------
    def _score_texts(
        self, texts: list[str], context: dict[str, Any], prompts: list[Any] | None, index: list[int], n: int
    ) -> np.ndarray:
        """The scores of the text stories (``index``: their places in the
        batch of ``n``; context and prompts already sliced to them). Here:
        one :meth:`_score_batch` call, then one story at a time when it
        raises, to isolate the story that breaks the batch."""
        if not texts:
            return np.empty(0)
        self._setup()
        scores = np.full(len(texts), np.nan)
        try:
            scores[:] = self._score_batch(texts, **context)  # (a result of the wrong length raises here)
        except ModelFailure as exc:  # the model's failure, not a story's: once, not NaN per story
            raise self._model_failed(exc) from exc
        except Exception:
            return self._score_one_by_one(texts, index, context)
        self._ok += len(texts)
        self._errors_in_a_row = 0
        return scores

    def _score_one_by_one(self, texts, index, context) -> np.ndarray:
        scores, errors = [], []
        for k, text in enumerate(texts):
            one = {key: take_column(key, v, [k], len(texts)) for key, v in context.items()}
            try:
                scores.append(float(self._score_batch([text], **one)[0]))
                self._ok += 1
                self._errors_in_a_row = 0
            except ModelFailure as exc:
                raise self._model_failed(exc) from exc
            except Exception as exc:
                self._unscorable(type(exc).__name__, f"story {index[k]}: {exc}")
                errors.append(exc)
                scores.append(math.nan)
                self._errors_in_a_row += 1
        # Not bad input but a broken reward: a whole batch failed, every story
        # so far failed, or too many in a row did.
        if errors and (
            len(errors) == len(texts) > 1
            or (self._ok == 0 and self._errors_in_a_row > 1)
            or self._errors_in_a_row >= MAX_ERRORS_IN_A_ROW
        ):
            raise RewardError(
                f"reward {self.name!r}: scoring failed for {self._errors_in_a_row} stories in a row: "
                f"{type(errors[-1]).__name__}: {one_line(errors[-1])}"
            ) from errors[-1]
        return np.asarray(scores)


def prepare_rewards(rewards: Iterable[Any], context: Mapping[str, Any], progress: bool = False) -> dict[str, dict]:
    """:meth:`Reward.prepare` of every reward that has it (other reward
    functions are skipped), with the rows of ``context``; returns each
    reward's counts by name. A reward whose models cannot load raises
    RewardError."""
    context = {k: v for k, v in context.items() if v is not None}
    n = {len(v) for v in context.values() if isinstance(v, (list, tuple))}
    if len(n) > 1:
        raise ValueError(f"prepare: context columns of different lengths {sorted(n)}")
    out = {}
    for reward in rewards:
        prepare = getattr(reward, "prepare", None)
        if callable(prepare):
            out[getattr(reward, "name", None) or type(reward).__name__] = prepare(context, progress=progress)
    return out


def column_length(context: Mapping[str, Any]) -> int:
    """Rows of a context of per-row columns (0 when it has none)."""
    return max((len(v) for v in context.values() if isinstance(v, (list, tuple))), default=0)


def story_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """``context`` (a call's columns, or one story's entries) with
    ``story_images`` in place of ``images``: TRL feeds a VLM policy the
    dataset's ``images`` column (e.g. one sequence image), so the
    per-position images rewards need travel as ``story_images``."""
    context = dict(context)
    story_images = context.pop("story_images", None)
    if story_images is not None:
        context["images"] = story_images
    return context


def take_column(key: str, value: Any, index: list[int], n: int) -> Any:
    """Select the per-story entries of a context column. Lists, tuples and
    arrays are per-story columns and must have one entry per story (a length
    mismatch would give a story another story's images); other values pass
    through unchanged."""
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim):
        if len(value) != n:
            raise ValueError(f"context column {key!r} has {len(value)} entries for {n} stories")
        if isinstance(value, np.ndarray):
            return value[index]
        return [value[i] for i in index]
    return value


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__
