"""What the composite rewards (``dhm``, ``weighted``) share: building their
component rewards, scoring a batch with every component, NaN handling and
logging.

A component is given as a registered reward name (``repetition``), a
reward-config YAML file (``configs/rewards/coherence.yaml``, as
:func:`storyrl.rewards.load_reward_config` reads) or an inline mapping
``{reward: coherence, model: ..., ...}``, built by
:func:`storyrl.rewards.build_reward`; ``options`` given beside it replace
the file's or mapping's options. Components are created when the
composite is (their options are validated then) and load their models
lazily, so a composite pickles before and after loading (TRL, Ray).

Each component scores the whole batch in one ``score`` call, with the
composite's context. A story one component cannot score (NaN, or its
scoring raised: the component isolates such stories itself) gets NaN from
the composite, ``None`` through the TRL call, and a reason in ``stats``. A
component failing for a whole batch raises :class:`RewardError`, which the
composite passes on: composites have no story-by-story retry of their own
(it would re-score every component one story at a time).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from storyrl.rewards.base import Reward, RewardConfig

__all__ = ["CompositeReward", "finite_mean", "unique_names"]


def unique_names(names: Sequence[str], fixed: Sequence[bool] | None = None) -> list[str]:
    """Log names: ``names`` as given where ``fixed``, others made distinct by
    a suffix (``repetition``, ``repetition_2``, ...)."""
    fixed = list(fixed) if fixed is not None else [False] * len(names)
    taken = {n for n, f in zip(names, fixed) if f}
    out = []
    for name, is_fixed in zip(names, fixed):
        if not is_fixed:
            base, k = name, 1
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            taken.add(name)
        out.append(name)
    return out


def _spread(values: np.ndarray, index: list[int], n: int) -> np.ndarray:
    out = np.full(n, np.nan)
    out[index] = values
    return out


def finite_mean(values: np.ndarray) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else None


def _column(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values]


def prompt_key(prompt: Any) -> str:
    """A hashable key of a TRL prompt (a string or chat messages); objects
    in it other than JSON values (images) count by type only, so repeated
    copies of one dataset row share a key."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, default=lambda o: f"<{type(o).__name__}>")


class CompositeReward(Reward):
    """Base of rewards computed from other rewards (``component_rewards``,
    name -> reward). Subclasses implement :meth:`_combine`.

    After each call, ``last_components`` holds every component's per-story
    values (and the composite's derived ones) by log name, for trainers that
    log them themselves, and the TRL call logs them through ``log_metric``
    (``<reward>/<component>/mean``, ``.../unscorable_frac``) and
    ``log_extra`` (one column of per-story values each)."""

    uses_prompts = True

    def __init__(self, config: RewardConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        self.component_rewards: dict[str, Reward] = {}
        self.last_components: dict[str, np.ndarray] = {}

    # -- to implement ------------------------------------------------------------
    def _combine(
        self, texts: list[str], context: dict[str, Any], prompts: list[Any] | None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The composite reward of ``texts`` (NaN where unscorable, each reason
        recorded with :meth:`_unscorable`) and the per-story values to keep and
        log, by name."""
        raise NotImplementedError

    def _metrics(self, values: dict[str, np.ndarray]) -> dict[str, float]:
        """Scalar metrics of a call (``<name>/...`` added by the caller); by
        default each component's mean and unscorable fraction."""
        metrics: dict[str, float] = {}
        for name in self.component_rewards:
            column = values[name]
            mean = finite_mean(column)
            if mean is not None:  # TRL averages what is logged: a NaN would poison the window
                metrics[f"{name}/mean"] = mean
            metrics[f"{name}/unscorable_frac"] = float((~np.isfinite(column)).mean())
        return metrics

    # -- the Reward hooks ---------------------------------------------------------------
    def _setup(self) -> None:
        for reward in self.component_rewards.values():
            reward.setup()

    def prepare(self, context, progress: bool = False) -> dict[str, Any]:
        """Every component's :meth:`~storyrl.rewards.base.Reward.prepare`, by name."""
        return {name: reward.prepare(context, progress=progress) for name, reward in self.component_rewards.items()}

    def log(self, log_metric=None, log_extra=None, scores: np.ndarray | None = None) -> None:
        """Log the last call's components: ``log_metric(name, value)`` for the
        scalars, ``log_extra(column, values)`` for the per-story columns
        (None where unscorable). TRL's callables or a trainer's own."""
        values = self.last_components
        n = len(scores) if scores is not None else len(next(iter(values.values()), ()))
        if not n:
            return
        super().log(log_metric, log_extra, scores)
        if callable(log_metric):
            for key, value in self._metrics(values).items():
                log_metric(f"{self.name}/{key}", value)
        if callable(log_extra):
            for key, column in values.items():
                log_extra(f"{self.name}/{key}", _column(column))

    def _score_texts(self, texts, context, prompts, index, n) -> np.ndarray:
        # Every component scores the whole batch once and isolates its own
        # unscorable stories: no story-by-story retry here (see the module
        # docs). With no text at all the components still get the empty
        # batch, so that the columns exist.
        if not n:
            self.last_components = {}
            return np.empty(0)
        total, parts = self._combine(texts, context, prompts)
        self.last_components = {k: _spread(v, index, n) for k, v in parts.items()}
        return total

    def _score_components(self, texts: list[str], context: dict[str, Any]) -> dict[str, np.ndarray]:
        """Every component's scores of ``texts``, one batched call each, with
        non-finite values as NaN. RewardError (a component failing for the
        whole batch) and context errors propagate."""
        out = {}
        for name, reward in self.component_rewards.items():
            values = np.asarray(reward.score(texts, **context), dtype=np.float64)
            out[name] = np.where(np.isfinite(values), values, np.nan)
        return out
