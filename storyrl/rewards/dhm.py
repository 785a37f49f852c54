"""d_HM as a reward: how close a generated story is to the sample's human
story along the d_HM dimensions (Surikuchi et al., 2024).

For each story and each selected dimension, |human − model| as
:mod:`storyrl.eval.dhm` computes it (grounding = tanh of the raw GROOViST
score, coherence = RoViST-C, repetition = RoViST-NR; the transforms come from
``DHM_DIMENSIONS``), then::

    reward = sign × Σ_d w_d |human_d − model_d| / Σ_d w_d

``sign`` −1 (default): higher is better and 0 means as far from the human
story as it is from itself. Weights default to equal (the paper's mean).

The human story's scores come from a score table (``human_scores``: a
storyrl score CSV with ``story_id`` and the ``groovist`` / ``coherence`` /
``repetition`` columns, raw GROOViST as ``storyrl score`` writes it), found by
the ``story_id`` context; otherwise the ``reference`` context (the human
story) is scored with the same component rewards, once: the scores are cached
by (story id, reference text), so the ``num_generations`` copies of a prompt
in a GRPO batch and every later epoch reuse them. The cache keeps the
``human_cache_size`` most recently used references (a long-running reward
server would otherwise grow without bound); a reference pushed out is scored
again when it comes back, to the same values. The reference is scored
with the sample's context (images...) except ``noun_phrases``, which belong to
the stories being scored; give the human story's own as
``reference_noun_phrases``.

A story gets NaN (None through TRL) when a selected dimension is NaN for it
or for its human story, or when it has neither a table row nor a reference;
``stats["reasons"]`` counts why.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards import build_reward, resolve_reward
from storyrl.rewards.base import RewardConfig, clean_text, take_column
from storyrl.rewards.composite import CompositeReward, finite_mean
from storyrl.rewards.dhm_distance import DHM_DIMENSIONS, dimension_distance

__all__ = ["DHM", "DIMENSIONS", "DhmConfig"]

#: d_HM dimension -> the reward (score-table column) it comes from.
DIMENSIONS = {dim: metric for metric, (dim, _) in DHM_DIMENSIONS.items()}


def _dimension(key: str) -> str | None:
    """The dimension named by ``key``: a dimension or its reward's name."""
    if key in DIMENSIONS:
        return key
    return next((dim for dim, metric in DIMENSIONS.items() if metric == key), None)


@dataclass
class DhmConfig(RewardConfig):
    dimensions: list[str] = option(factory=lambda: list(DIMENSIONS), help="d_HM dimensions: grounding (tanh of "
                                   "GROOViST), coherence, repetition (default: all three).")
    weights: dict[str, float] | None = option(None, "Weight of each dimension (default: equal; an unlisted "
                                              "dimension weighs 1).", cli=False)
    sign: int = option(-1, "Reward = sign x d_HM: -1 makes closer to the human story higher.", choices=(-1, 1))
    rewards: dict[str, str | dict[str, Any]] = option(
        factory=dict, help="Each dimension's reward (keys grounding/coherence/repetition or groovist): a reward "
        "config file or its options (default: the reward's defaults).", cli=False)
    human_scores: str | None = option(None, "Score CSV of the human stories (story_id + groovist/coherence/"
                                      "repetition columns), looked up by the story_id context; stories not in it "
                                      "are scored from their reference.", path="file")
    human_cache_size: int = option(50_000, "Human-story scores kept in memory, most recently used first (about "
                                   "1 KB each; 0: none kept beyond one call).", min=0)

    def _problems(self) -> list[str]:
        from pathlib import Path

        problems = []
        dims = self.dimensions
        if not dims:
            problems.append(f"dimensions: give at least one of {', '.join(DIMENSIONS)}")
        unknown = [d for d in dims if d not in DIMENSIONS]
        if unknown:
            problems.append(f"dimensions: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(DIMENSIONS)}")
        twice = sorted({d for d in dims if dims.count(d) > 1})
        if twice:
            problems.append(f"dimensions: {', '.join(map(repr, twice))} given twice")
        for key, weight in (self.weights or {}).items():
            if key not in dims:
                problems.append(f"weights: {key!r} is not a selected dimension ({', '.join(dims)})")
            elif not (math.isfinite(weight) and weight > 0):
                problems.append(f"weights: {key!r} must be a positive number (leave the dimension out of dimensions "
                                f"instead), got {weight!r}")
        seen = {}
        for key, spec in self.rewards.items():
            dim = _dimension(key)
            if dim is None:
                problems.append(f"rewards: {key!r} is not a d_HM dimension; use {', '.join(DIMENSIONS)}")
                continue
            if dim in seen:
                problems.append(f"rewards: {seen[dim]!r} and {key!r} are the same dimension")
            seen[dim] = key
            if dim in dims:  # only the selected dimensions' rewards are built
                try:
                    _, config = resolve_reward(spec, expect=DIMENSIONS[dim])
                except (TypeError, ValueError) as exc:
                    problems.append(f"rewards.{key}: {exc}")
                    continue
                if getattr(config, "bounded", False):
                    problems.append(f"rewards.{key}: d_HM applies tanh to the raw GROOViST score itself; "
                                    "set bounded: false")
        if self.human_scores is not None and not Path(self.human_scores).is_file():
            problems.append(f"human_scores: no such file {self.human_scores}")
        return problems


class DHM(CompositeReward):
    """Minus the d_HM distance to the sample's human story (higher = closer).

    Context: ``reference`` (the human story) and/or ``story_id`` (with
    ``human_scores``), plus what the components need (``images``...).
    ``last_components`` (and the TRL logs) hold per dimension the model's
    score (``grounding``: raw GROOViST), the human story's
    (``grounding/human``) and their distance (``grounding/distance``).
    Options: :class:`DhmConfig`."""

    name = "dhm"
    higher_is_better = True
    value_range = (-math.inf, 0.0)
    config_class = DhmConfig

    def __init__(self, config: DhmConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        self.higher_is_better = self.sign < 0
        self.value_range = (-math.inf, 0.0) if self.sign < 0 else (0.0, math.inf)
        specs = {_dimension(k): v for k, v in self.rewards.items()}
        self.component_rewards = {
            dim: build_reward(specs.get(dim, DIMENSIONS[dim]), expect=DIMENSIONS[dim]) for dim in self.dimensions
        }
        weights = np.array([float((self.weights or {}).get(d, 1.0)) for d in self.dimensions])
        self.dimension_weights = dict(zip(self.dimensions, weights / weights.sum()))
        #: (story id, reference text) -> the human story's score per dimension,
        #: least recently used first, at most ``human_cache_size`` entries
        self.human_cache: OrderedDict[tuple[str | None, str], dict[str, float]] = OrderedDict()
        self.stats["human_scored"] = 0  # references scored (not found in the cache)
        self._table, self._table_ids = None, set()

    # -- human scores ------------------------------------------------------------------
    def _setup(self) -> None:
        super()._setup()
        self.human_table()

    def prepare(self, context, progress: bool = False) -> dict[str, Any]:
        """The components' image side (:meth:`CompositeReward.prepare`), then
        the human story of every row scored and cached (as the first call
        meeting it would; at most ``human_cache_size`` of them, the cache's
        size), so that a training step scores only the generated stories."""
        from storyrl.console import progress as progress_bar
        from storyrl.rewards.base import column_length, story_context

        counts = super().prepare(context, progress=progress)
        context = story_context(context)
        n = min(column_length(context), self.human_cache_size)
        if not n or (context.get("reference") is None and context.get("story_id") is None):
            return counts
        self.setup()
        before = self.stats["human_scored"]
        step = 64
        bar = progress_bar(total=n, desc=f"{self.name}: scoring human stories", unit="story", disable=not progress)
        try:
            for start in range(0, n, step):
                index = list(range(start, min(n, start + step)))
                self._human({k: take_column(k, v, index, column_length(context)) for k, v in context.items()},
                            len(index))
                bar.update(len(index))
        finally:
            bar.close()
        counts["human_scored"] = self.stats["human_scored"] - before
        return counts

    def human_table(self):
        """The ``human_scores`` table (read once), or None."""
        if self.human_scores is None or self._table is not None:
            return self._table
        from storyrl.data import read_scores

        table = read_scores(self.human_scores, require=[DIMENSIONS[d] for d in self.dimensions])
        self._table, self._table_ids = table, set(table.ids)
        return table

    def _human(self, context: dict[str, Any], n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Per story, the human story's score per dimension (NaN where it has
        none) and whether it has no human story at all."""
        out = {dim: np.full(n, np.nan) for dim in self.dimensions}
        absent = np.zeros(n, dtype=bool)
        ids, refs = context.get("story_id"), context.get("reference")
        table = self.human_table()
        todo: dict[tuple[str | None, str], list[int]] = {}
        for i in range(n):
            sid = None if ids is None or ids[i] is None else str(ids[i])
            if table is not None and sid is not None and sid in self._table_ids:
                for dim in self.dimensions:
                    out[dim][i] = table.scores[DIMENSIONS[dim]].get(sid, math.nan)
                continue
            ref = refs[i] if refs is not None else None
            if not isinstance(ref, str) or not ref.strip():
                absent[i] = True
                continue
            key = (sid, ref)
            if key in self.human_cache:
                self.human_cache.move_to_end(key)
                for dim in self.dimensions:
                    out[dim][i] = self.human_cache[key][dim]
            else:
                todo.setdefault(key, []).append(i)
        if todo:
            first = [index[0] for index in todo.values()]
            human_context = {k: v for k, v in context.items() if k not in ("reference", "noun_phrases", "nouns",
                                                                            "reference_noun_phrases")}
            if "reference_noun_phrases" in context:
                human_context["noun_phrases"] = context["reference_noun_phrases"]
            human_context = {k: take_column(k, v, first, n) for k, v in human_context.items()}
            scores = self._score_components([clean_text(refs[i]) for i in first], human_context)
            self.stats["human_scored"] += len(first)
            for j, (key, index) in enumerate(todo.items()):
                entry = {dim: float(scores[dim][j]) for dim in self.dimensions}
                self.human_cache[key] = entry
                for dim in self.dimensions:
                    out[dim][index] = entry[dim]
            while len(self.human_cache) > self.human_cache_size:
                self.human_cache.popitem(last=False)
        return out, absent

    # -- scoring -----------------------------------------------------------------------
    def _combine(self, texts, context, prompts):
        n = len(texts)
        human, absent = self._human(context, n)
        model = self._score_components(texts, context)
        total = np.zeros(n)
        values: dict[str, np.ndarray] = {}
        for dim in self.dimensions:
            distance = dimension_distance(DIMENSIONS[dim], human[dim], model[dim])
            total += self.dimension_weights[dim] * distance
            values[dim], values[f"{dim}/human"], values[f"{dim}/distance"] = model[dim], human[dim], distance
        total *= self.sign
        for i in np.flatnonzero(np.isnan(total)):
            if absent[i]:
                self._unscorable("no human story", "no reference and no human_scores row")
            for dim in self.dimensions:
                if np.isnan(model[dim][i]):
                    self._unscorable(f"{dim}: story unscorable")
                if np.isnan(human[dim][i]) and not absent[i]:
                    self._unscorable(f"{dim}: human story unscorable")
        return total, values

    def _metrics(self, values):
        metrics = super()._metrics(values)
        for dim in self.dimensions:
            for key in ("human", "distance"):
                mean = finite_mean(values[f"{dim}/{key}"])
                if mean is not None:
                    metrics[f"{dim}/{key}_mean"] = mean
            metrics[f"{dim}/human_unscorable_frac"] = float(np.isnan(values[f"{dim}/human"]).mean())
        return metrics
