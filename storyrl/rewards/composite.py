"""What the composite rewards (``dhm``, ``weighted``) share: building their
component rewards, scoring a batch with every component, NaN handling and
logging.

A component is given as a registered reward name (``repetition``), a
reward-config YAML file (``configs/rewards/coherence.yaml``, as
:func:`storyrl.rewards.load_reward_config` reads) or an inline mapping
``{reward: coherence, model: ..., ...}``; ``options`` given beside it
replace the file's or mapping's options. Components are created when the
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
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from storyrl.rewards.base import (
    _TRL_KWARGS,
    Reward,
    RewardConfig,
    _as_list,
    _take,
    clean_text,
    completion_text,
)

__all__ = ["CompositeReward", "build_reward", "resolve_reward", "unique_names"]

SPEC_HELP = "a registered reward name, a reward config YAML file, or an inline mapping {reward: <name>, <options>}"


def _is_path(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec


def resolve_reward(
    spec: Any, options: Mapping[str, Any] | None = None, *, expect: str | None = None
) -> tuple[type[Reward], RewardConfig]:
    """The reward class and validated config of a component ``spec`` (see the
    module docs), ``options`` replacing its own. ``expect``: the registered
    name the reward must have (an inline mapping may then leave out
    ``reward``). TypeError / ValueError naming the file or reward at fault."""
    from storyrl.config import load_yaml
    from storyrl.rewards import REWARDS

    source = None
    if isinstance(spec, Mapping):
        data = dict(spec)
        name = data.pop("reward", expect)
        if not isinstance(name, str):
            raise ValueError(f"an inline reward is a mapping with a 'reward: <name>' key, got {dict(spec)!r}")
    elif isinstance(spec, str) and spec in REWARDS:
        name, data = spec, {}
    elif isinstance(spec, str) and _is_path(spec):
        source = spec
        if not Path(spec).is_file():
            raise ValueError(f"no such reward config file {spec}")
        data = load_yaml(spec)
        if not isinstance(data, dict) or not isinstance(data.get("reward"), str):
            raise ValueError(f"{spec}: a reward config is a mapping with a 'reward: <name>' key")
        data = dict(data)
        name = data.pop("reward")
    elif isinstance(spec, str):
        raise ValueError(f"unknown reward {spec!r}; give {SPEC_HELP} (rewards: {', '.join(REWARDS.names())})")
    else:
        raise TypeError(f"a reward is {SPEC_HELP}, got {type(spec).__name__} {spec!r}")
    where = f"{source}: " if source else ""
    try:
        cls = REWARDS.get(name)
    except KeyError as exc:
        raise ValueError(f"{where}{exc.args[0]}") from None
    if expect is not None and REWARDS.resolve(name) != REWARDS.resolve(expect):
        raise ValueError(f"{where}the reward is {name!r}, not {expect!r}")
    try:
        config = cls.config_class.from_mapping({**data, **(options or {})})
    except (TypeError, ValueError) as exc:
        # Name the reward as users call it, not its config class.
        message = str(exc).removeprefix(f"{cls.config_class._label()}: ")
        raise type(exc)(f"{where}reward {cls.name or name!r}: {message}") from None
    return cls, config


def build_reward(spec: Any, options: Mapping[str, Any] | None = None, *, expect: str | None = None) -> Reward:
    """The component reward of ``spec`` (see :func:`resolve_reward`); models
    are not loaded yet."""
    cls, config = resolve_reward(spec, options, expect=expect)
    return cls(config)


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


def _finite_mean(values: np.ndarray) -> float | None:
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
            mean = _finite_mean(column)
            if mean is not None:  # TRL averages what is logged: a NaN would poison the window
                metrics[f"{name}/mean"] = mean
            metrics[f"{name}/unscorable_frac"] = float((~np.isfinite(column)).mean())
        return metrics

    # -- the Reward API ---------------------------------------------------------------
    def _setup(self) -> None:
        for reward in self.component_rewards.values():
            reward.setup()

    def score(self, stories: Sequence[Any], **context: Any) -> np.ndarray:
        """Score a batch (see :meth:`Reward.score`); every component scores the
        whole batch once."""
        return self._evaluate(stories, context, None)

    def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        """TRL reward-function contract (see :meth:`Reward.__call__`), plus
        every component logged through TRL's ``log_metric`` / ``log_extra``."""
        if completions is None:
            raise TypeError(f"{self.name}: called without completions")
        texts = [completion_text(c) for c in _as_list(completions, "completions", self.name)]
        context = {k: v for k, v in kwargs.items() if k not in _TRL_KWARGS}
        if "story_images" in context:
            context["images"] = context.pop("story_images")  # as Reward.__call__: TRL's images feed the policy
        if prompts is not None:
            prompts = _as_list(prompts, "prompts", self.name)
            if len(prompts) != len(texts):
                raise ValueError(f"{self.name}: {len(prompts)} prompts for {len(texts)} completions")
        scores = self._evaluate(texts, context, prompts)
        self.log(kwargs.get("log_metric"), kwargs.get("log_extra"), scores)
        return [None if math.isnan(s) else float(s) for s in scores]

    def log(self, log_metric=None, log_extra=None, scores: np.ndarray | None = None) -> None:
        """Log the last call's components: ``log_metric(name, value)`` for the
        scalars, ``log_extra(column, values)`` for the per-story columns
        (None where unscorable). TRL's callables or a trainer's own."""
        values = self.last_components
        n = len(scores) if scores is not None else len(next(iter(values.values()), ()))
        if not n:
            return
        if callable(log_metric):
            if scores is not None:
                log_metric(f"{self.name}/unscorable_frac", float(np.isnan(scores).mean()))
            for key, value in self._metrics(values).items():
                log_metric(f"{self.name}/{key}", value)
        if callable(log_extra):
            for key, column in values.items():
                log_extra(f"{self.name}/{key}", _column(column))

    def _evaluate(self, stories: Sequence[Any], context: dict[str, Any], prompts: list[Any] | None) -> np.ndarray:
        stories = _as_list(stories, "stories", self.name)
        n = len(stories)
        for key, value in context.items():
            _take(key, value, [], n)  # a column of the wrong length is the caller's error
        out = np.full(n, np.nan)
        valid = [i for i, s in enumerate(stories) if isinstance(s, str)]
        for _ in range(n - len(valid)):
            self._unscorable("not text")
        values: dict[str, np.ndarray] = {}
        if n:  # (with no text at all the components get an empty batch: the columns still exist)
            texts = [clean_text(stories[i]) for i in valid]
            sub = {k: _take(k, v, valid, n) for k, v in context.items()}
            sub_prompts = [prompts[i] for i in valid] if prompts is not None else None
            total, parts = self._combine(texts, sub, sub_prompts)
            out[valid] = total
            values = {k: _spread(v, valid, n) for k, v in parts.items()}
        self.last_components = values
        n_bad = int(np.isnan(out).sum())
        self.stats["scored"] += n - n_bad
        self.stats["unscorable"] += n_bad
        return out

    def _score_components(self, texts: list[str], context: dict[str, Any]) -> dict[str, np.ndarray]:
        """Every component's scores of ``texts``, one batched call each, with
        non-finite values as NaN. RewardError (a component failing for the
        whole batch) and context errors propagate."""
        out = {}
        for name, reward in self.component_rewards.items():
            values = np.asarray(reward.score(texts, **context), dtype=np.float64)
            out[name] = np.where(np.isfinite(values), values, np.nan)
        return out
