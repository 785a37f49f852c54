"""What verl, OpenRLHF and the reward server share: the reward built once per
process from a config file (models load once), the per-story context taken
from the frameworks' ground truth / labels / extra info, and scoring that also
returns the per-sample components a composite reward logs through TRL's
``log_extra``.

Unscorable stories: storyrl marks them NaN (TRL gets None), but neither verl
nor OpenRLHF accepts a missing reward, and JSON has no NaN. Every non-finite
value handed to a framework is replaced by a *fallback* (default 0.0,
``STORYRL_REWARD_FALLBACK`` or the functions' ``fallback`` argument), counted
in :data:`STATS` and flagged per sample (``unscorable`` = 1.0).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from storyrl.rewards import Reward, load_reward_config
from storyrl.rewards.base import CONTEXT_KEYS, story_context  # CONTEXT_KEYS re-exported: the keys a label may carry
from storyrl.rewards.concurrent import is_async_reward, run_sync

__all__ = [
    "CONFIG_ENV",
    "CONTEXT_KEYS",
    "FALLBACK_ENV",
    "STATS",
    "Scored",
    "batch_normalized",
    "context_columns",
    "label_context",
    "resolve_fallback",
    "reward_from_config",
    "score_stories",
    "strip_end_markers",
]

log = logging.getLogger(__name__)

#: Environment variable naming the reward config YAML (when no argument does).
CONFIG_ENV = "STORYRL_REWARD_CONFIG"
#: Environment variable with the value given to unscorable stories.
FALLBACK_ENV = "STORYRL_REWARD_FALLBACK"
_LIST_KEYS = frozenset({"images", "story_images", "image_ids", "noun_phrases"})

#: Process-wide counts: ``stories`` scored through the integrations and
#: ``fallback`` (those given the fallback because they were unscorable).
STATS: Counter = Counter()

_REWARDS: dict[str, Reward] = {}
_LOAD_LOCK = threading.Lock()
# One scoring call at a time per process: rewards keep counters and may hold
# one GPU model; verl's parallel reward managers call from threads.
_SCORE_LOCK = threading.RLock()


def reward_from_config(config: str | os.PathLike | None = None) -> Reward:
    """The reward described by the YAML file ``config`` (default: the file
    named by ``STORYRL_REWARD_CONFIG``), built and set up (models loaded) once
    per process and file. ValueError when neither names a file or the file
    is not a reward config; the reward's loading error (RewardError)
    otherwise."""
    if config is None or config == "":
        config = os.environ.get(CONFIG_ENV)
    if not config:
        raise ValueError(
            f"no storyrl reward config: pass one (e.g. storyrl_config=REWARD.yaml) or set {CONFIG_ENV}"
        )
    key = str(Path(config).expanduser().resolve())
    with _LOAD_LOCK:
        reward = _REWARDS.get(key)
        if reward is None:
            reward = load_reward_config(key).setup()
            _REWARDS[key] = reward
    return reward


def resolve_fallback(value: float | str | None = None) -> float:
    """The reward given to unscorable stories: ``value``, else
    ``STORYRL_REWARD_FALLBACK``, else 0.0. Must be a finite number."""
    source = "fallback"
    if value is None:
        value, source = os.environ.get(FALLBACK_ENV, "0.0"), FALLBACK_ENV
    if isinstance(value, bool):
        raise TypeError(f"{source} must be a number, got {value!r}")
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{source} must be a number, got {value!r}") from None
    if not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ValueError(f"{source} must be a finite number, got {value!r}")
    return float(number)


def label_context(label: Any, where: str = "label") -> dict[str, Any]:
    """The per-story context in a framework's label / ground truth: a string
    is the human story (``reference``); a mapping may hold any of
    :data:`CONTEXT_KEYS` (other keys, e.g. verl's ``index``, are ignored);
    None is no context. Values are checked (TypeError naming ``where``);
    numpy arrays (lists read back from parquet) become lists;
    ``story_images`` becomes the story's ``images``."""
    if label is None:
        return {}
    if isinstance(label, str):
        return {"reference": label}
    if not isinstance(label, Mapping):
        raise TypeError(f"{where}: expected the human story (a string), a mapping or null, got {type(label).__name__}")
    context = {}
    for key in CONTEXT_KEYS:
        value = label.get(key)
        if value is None:
            continue
        if key in _LIST_KEYS:
            if isinstance(value, np.ndarray):
                value = value.tolist()
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{where}: {key!r} must be a list of strings, got {_describe(value)}")
            value = list(value)
        elif not isinstance(value, str):
            raise TypeError(f"{where}: {key!r} must be a string, got {_describe(value)}")
        context[key] = value
    return story_context(context)  # per story, as the TRL call does per column


def context_columns(contexts: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Per-story context dicts -> the reward's context columns: each key that
    any story has, one entry per story (None where a story lacks it)."""
    keys = [k for k in CONTEXT_KEYS if any(k in c for c in contexts)]
    return {k: [c.get(k) for c in contexts] for k in keys}


@dataclass
class Scored:
    """Scores of a batch: ``scores`` (NaN = unscorable) and the per-sample
    ``components`` the reward logged (``log_extra`` columns of numbers, NaN
    for a missing value), in story order."""

    scores: np.ndarray
    components: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def unscorable(self) -> np.ndarray:
        return ~np.isfinite(self.scores)

    def part(self, start: int, stop: int) -> Scored:
        return Scored(self.scores[start:stop], {k: v[start:stop] for k, v in self.components.items()})

    def rewards(self, fallback: float) -> list[float]:
        """The scores with the fallback in place of non-finite ones."""
        return _finite(self.scores, fallback)

    def component_values(self, fallback: float) -> dict[str, list[float]]:
        return {k: _finite(v, fallback) for k, v in self.components.items()}


def score_stories(reward: Reward, stories: Sequence[Any], context: Mapping[str, Sequence] | None = None,
                  prompts: Sequence[Any] | None = None) -> Scored:
    """Score ``stories`` with their context columns, through the reward's TRL
    interface so that the per-sample components a composite reward logs with
    ``log_extra`` come back too. The totals equal ``reward.score(stories,
    **context)`` (``prompts``, when given, tell the groups of a reward
    normalised per prompt apart). Counts stories and unscorable ones in
    :data:`STATS`."""
    stories = list(stories)
    extra: dict[str, list] = {}

    def log_extra(column: str, values: Any) -> None:
        extra[column] = list(values)

    def log_metric(name: str, value: float) -> None:
        pass  # batch-level means; the frameworks average per-sample values themselves

    call = functools.partial(reward, prompts=None if prompts is None else list(prompts), completions=stories,
                             log_extra=log_extra, log_metric=log_metric, **dict(context or {}))
    if is_async_reward(reward):
        # ``remote``: safe to call concurrently, and holding the lock through a
        # network call would stall every other scoring thread for nothing.
        out = run_sync(call())
    else:
        with _SCORE_LOCK:
            out = call()
    scores = np.array([math.nan if v is None else float(v) for v in out], dtype=float)
    components = {}
    for column, values in extra.items():
        numbers = _numbers(values, len(stories))
        if numbers is not None and column != reward.name:
            components[column] = numbers
    bad = int((~np.isfinite(scores)).sum())
    STATS["stories"] += len(stories)
    STATS["fallback"] += bad
    if bad and STATS["fallback"] == bad:  # the first time in this process
        log.warning("%s: %d of %d stories unscorable; they get the fallback reward (see %s)",
                    reward.name, bad, len(stories), FALLBACK_ENV)
    return Scored(scores, components)


def batch_normalized(reward: Reward) -> bool:
    """Whether ``reward`` (or a reward inside it) normalises over the batch
    or over prompt groups (a ``weighted`` component with ``normalize: batch``
    or ``group``): its values then depend on which stories are scored
    together."""
    components = getattr(getattr(reward, "args", None), "components", None) or ()
    if any(getattr(c, "normalize", "none") in ("batch", "group") for c in components):
        return True
    return any(batch_normalized(r) for r in getattr(reward, "component_rewards", {}).values())


def strip_end_markers(text: str, markers: Sequence[str]) -> str:
    """``text`` without the end markers and whitespace that trail it (at each
    step the first of ``markers`` that ends it is removed), and without
    leading whitespace. Linear time: the end moves back, nothing is copied
    until the end (a query ending in 500,000 ``</s>`` is one pass)."""
    end = len(text.rstrip())
    markers = [m for m in markers if m]
    while True:
        marker = next((m for m in markers if text.endswith(m, 0, end)), None)
        if marker is None:
            return text[:end].strip()
        end -= len(marker)
        while end and text[end - 1].isspace():
            end -= 1


def _numbers(values: list, n: int) -> np.ndarray | None:
    """A log_extra column as floats (None -> NaN), or None when it is not
    one number per story (e.g. text columns)."""
    if len(values) != n:
        return None
    out = np.empty(n)
    for i, v in enumerate(values):
        if v is None:
            out[i] = math.nan
        elif isinstance(v, (bool, int, float, np.integer, np.floating)):
            out[i] = float(v)
        else:
            return None
    return out


def _finite(values: np.ndarray, fallback: float) -> list[float]:
    return [float(v) if math.isfinite(v) else fallback for v in values]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"
