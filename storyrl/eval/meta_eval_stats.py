"""The figures of ``storyrl meta-eval`` as pure functions of scores.

Pair accuracy (VHED paper Eq. 1–2): a pair is correct iff the metric prefers
the story people prefer; a tie or a NaN is wrong, and n counts every pair of
the subset. Correlations with ratings: Kendall τ-b, Spearman ρ and Pearson r
(scipy) over the stories with a finite score; a percentile bootstrap
confidence interval for Kendall τ-b resamples stories with replacement
(seeded; resamples where τ is undefined, e.g. all ratings equal, are left
out). System level (COSMiC's protocol): Kendall τ-b between the systems'
mean human rating and mean metric score.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["bootstrap_ci", "correlations", "pair_accuracy", "pair_correct", "system_means", "system_tau"]


def pair_correct(better: Any, worse: Any = None) -> np.ndarray:
    """Per pair: ``better > worse`` (two score arrays), or, with one array of
    pairwise values (``compare(better, worse)``), value > 0. NaN and ties
    are False."""
    better = np.asarray(better, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        if worse is None:
            return np.nan_to_num(better, nan=0.0) > 0
        worse = np.asarray(worse, dtype=np.float64)
        return np.isfinite(better) & np.isfinite(worse) & (better > worse)


def pair_accuracy(correct: Sequence[bool]) -> float:
    """The share of correct pairs (NaN for no pair)."""
    correct = np.asarray(correct, dtype=bool)
    return float(correct.mean()) if len(correct) else math.nan


def correlations(human: Sequence[float], metric: Sequence[float]) -> dict[str, float]:
    """Kendall τ-b, Spearman and Pearson of two aligned arrays (NaN when
    fewer than 2 values or a constant array)."""
    from scipy import stats

    x, y = np.asarray(human, dtype=np.float64), np.asarray(metric, dtype=np.float64)
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return {"kendall": math.nan, "spearman": math.nan, "pearson": math.nan}
    return {
        "kendall": float(stats.kendalltau(x, y, variant="b").statistic),
        "spearman": float(stats.spearmanr(x, y).statistic),
        "pearson": float(stats.pearsonr(x, y).statistic),
    }


def bootstrap_ci(human: Sequence[float], metric: Sequence[float], *, n_boot: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of Kendall τ-b, resampling stories."""
    from scipy import stats

    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"n_boot must be >= 1 and level in (0, 1), got {n_boot}, {level}")
    x, y = np.asarray(human, dtype=np.float64), np.asarray(metric, dtype=np.float64)
    if len(x) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    taus = np.empty(n_boot)
    for b in range(n_boot):
        pick = rng.integers(0, len(x), len(x))
        xs, ys = x[pick], y[pick]
        if np.all(xs == xs[0]) or np.all(ys == ys[0]):
            taus[b] = math.nan
        else:
            taus[b] = stats.kendalltau(xs, ys, variant="b").statistic
    taus = taus[np.isfinite(taus)]
    if not len(taus):
        return math.nan, math.nan
    alpha = (1 - level) / 2
    low, high = np.quantile(taus, [alpha, 1 - alpha])
    return float(low), float(high)


def system_means(systems: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    """Mean of ``values`` per system (first-seen order)."""
    sums: dict[str, list[float]] = {}
    for system, value in zip(systems, values):
        sums.setdefault(system, []).append(float(value))
    return {s: sum(v) / len(v) for s, v in sums.items()}


def system_tau(human: Mapping[str, float], metric: Mapping[str, float]) -> dict[str, float]:
    """Correlations over systems of their mean human rating and mean score."""
    names = list(human)
    return correlations([human[s] for s in names], [metric[s] for s in names])
