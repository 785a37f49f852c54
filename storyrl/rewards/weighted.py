"""A weighted sum of rewards, each optionally normalised::

    reward = Σ_c weight_c × normalise_c(reward_c(story))

Normalisations (per component):

- ``none``: the reward's own scale.
- ``batch``: z-score over the batch, (x − mean) / std (population std).
- ``group``: z-score within each prompt's group, the samples of one prompt
  (TRL repeats each prompt ``num_generations`` times). Samples share a group
  when they share their prompt (the TRL call's ``prompts``) and their
  ``story_id`` context, whichever are given: a VLM's prompt text is often
  the same for every image sequence, so give a ``story_id`` column. Across
  processes TRL splits a group: each process normalises its own part.
- ``range``: a fixed ``[lo, hi]`` mapped to [0, 1], (x − lo) / (hi − lo)
  (not clipped).

NaN values (unscorable stories) are left out of the statistics; a group or
batch whose values are all equal gets 0. A story is NaN (None through TRL)
when a component with a non-zero weight is NaN for it; a component with
weight 0 is scored and logged only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import Config, ConfigError, option
from storyrl.rewards import SPEC_HELP, build_reward, resolve_reward
from storyrl.rewards.base import RewardConfig
from storyrl.rewards.composite import CompositeReward, prompt_key, unique_names

__all__ = ["NORMALIZATIONS", "Weighted", "WeightedComponent", "WeightedConfig", "group_zscore", "range_scale",
           "zscore"]

NORMALIZATIONS = ("none", "batch", "group", "range")


def zscore(values: np.ndarray) -> np.ndarray:
    """(x − mean) / std over the finite values (population std); NaN stays
    NaN; all equal → 0."""
    values = np.asarray(values, dtype=np.float64)
    out = np.full(values.shape, np.nan)
    finite = np.isfinite(values)
    if finite.any():
        v = values[finite]
        # An exact spread test: equal values can still give a std of 1e-17.
        out[finite] = 0.0 if np.ptp(v) == 0 else (v - v.mean()) / v.std()
    return out


def group_zscore(values: np.ndarray, keys: list) -> np.ndarray:
    """:func:`zscore` within each group of equal ``keys``."""
    values = np.asarray(values, dtype=np.float64)
    out = np.full(values.shape, np.nan)
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    for index in groups.values():
        out[index] = zscore(values[index])
    return out


def range_scale(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """(x − lo) / (hi − lo)."""
    return (np.asarray(values, dtype=np.float64) - lo) / (hi - lo)


@dataclass
class WeightedComponent(Config):
    """One term of a weighted reward."""

    reward: str | dict[str, Any] = option(help=f"The reward: {SPEC_HELP}.")
    options: dict[str, Any] = option(factory=dict, help="Options replacing the reward's (e.g. device).", cli=False)
    weight: float = option(1.0, "Weight in the sum (0: scored and logged only).")
    normalize: str = option("none", "none, batch (z-score over the batch), group (z-score within each prompt's "
                            "group) or range (fixed [lo, hi] to [0, 1]).", choices=NORMALIZATIONS)
    range: tuple[float, float] | None = option(None, "[lo, hi] for normalize: range.")
    name: str | None = option(None, "Name in the logs (default: the reward's name, made unique by _2, _3...).")

    def _problems(self) -> list[str]:
        problems = []
        if self.normalize == "range":
            if self.range is None:
                problems.append("normalize 'range' needs range: [lo, hi]")
            elif not (all(map(math.isfinite, self.range)) and self.range[0] < self.range[1]):
                problems.append(f"range must be finite [lo, hi] with lo < hi, got {list(self.range)}")
        elif self.range is not None:
            problems.append(f"range is only used with normalize: range (normalize is {self.normalize!r})")
        if self.name is not None and (not self.name.strip() or "/" in self.name):
            problems.append(f"name must be a non-empty name without '/', got {self.name!r}")
        return problems


def _component(value: Any, index: int) -> Any:
    if isinstance(value, WeightedComponent) or not isinstance(value, dict):
        return value  # the type check reports a non-mapping
    try:
        return WeightedComponent.from_mapping(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError.of(exc).named(f"components[{index}]", WeightedComponent._label()) from None


@dataclass
class WeightedConfig(RewardConfig):
    components: list[WeightedComponent] = option(
        help="The terms: each {reward, options, weight, normalize, range, name}.", cli=False)

    def __post_init__(self) -> None:
        # Built here, not by the generic nested-config path, so that an error names components[i].
        if isinstance(self.components, list):
            self.components = [_component(c, i) for i, c in enumerate(self.components)]
        super().__post_init__()

    def _problems(self) -> list[str]:
        if not self.components:
            return ["components: give at least one reward"]
        problems = []
        for i, c in enumerate(self.components):
            try:
                resolve_reward(c.reward, c.options)
            except (TypeError, ValueError) as exc:
                problems.append(f"components[{i}]: {exc}")
        names = [c.name for c in self.components if c.name is not None]
        problems += [f"components: name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        return problems


class Weighted(CompositeReward):
    """A weighted sum of rewards, each optionally normalised (none, batch or
    group z-score, fixed range). ``last_components`` (and the TRL logs) hold
    each component's raw scores by its name, and ``<name>/normalized`` for
    normalised ones. Options: :class:`WeightedConfig`."""

    name = "weighted"
    higher_is_better = True
    config_class = WeightedConfig

    def __init__(self, config: WeightedConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        rewards = [build_reward(c.reward, c.options) for c in self.components]
        names = unique_names([c.name or r.name for c, r in zip(self.components, rewards)],
                             [c.name is not None for c in self.components])
        self.component_rewards = dict(zip(names, rewards))
        self.terms = dict(zip(names, self.components))

    def _combine(self, texts, context, prompts):
        n = len(texts)
        raw = self._score_components(texts, context)
        keys = None
        total = np.zeros(n)
        values: dict[str, np.ndarray] = {}
        for name, term in self.terms.items():
            x = values[name] = raw[name]
            if term.normalize == "batch":
                x = zscore(x)
            elif term.normalize == "group":
                keys = keys if keys is not None else self._group_keys(context, prompts, n)
                x = group_zscore(x, keys)
            elif term.normalize == "range":
                x = range_scale(x, *term.range)
            if term.normalize != "none":
                values[f"{name}/normalized"] = x
            if term.weight != 0:
                total += term.weight * x
        for i in np.flatnonzero(np.isnan(total)):
            for name, term in self.terms.items():
                if term.weight != 0 and np.isnan(raw[name][i]):
                    self._unscorable(f"{name}: unscorable")
        return total, values

    def _group_keys(self, context: dict[str, Any], prompts: list | None, n: int) -> list:
        ids = context.get("story_id")
        if prompts is None and ids is None:
            raise ValueError(f"{self.name}: normalize 'group' needs the prompts (TRL's call) or a story_id context "
                             "column to tell the groups apart")
        return [
            (prompt_key(prompts[i]) if prompts is not None else None, None if ids is None else str(ids[i]))
            for i in range(n)
        ]

    def _metrics(self, values):
        metrics = super()._metrics(values)
        for name in self.component_rewards:
            column = values[name]
            finite = column[np.isfinite(column)]
            if len(finite):
                metrics[f"{name}/std"] = float(finite.std())
        return metrics
