"""Meta-evaluation of grounding metrics, GROOViST paper criterion 1: a
metric that captures grounding scores the original story of an image sequence
higher than stories written for other sequences.

For each sequence j: Δ_j = score(story_j, images_j) − max over k random other
stories i ≠ j of score(story_i, images_j). The paper reports the mean Δ
(GROOViST on VIST: 0.413, with k = 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Context that belongs to the story text (not to the image sequence).
STORY_KEYS = frozenset({"noun_phrases"})


@dataclass
class OriginalVsRandom:
    """Per-sequence results and the summary of criterion 1."""

    k: int
    original: np.ndarray  # score of each sequence's own story
    random_max: np.ndarray  # best score among its k random stories
    partners: list[list[int]] = field(repr=False)  # the random story indices

    @property
    def deltas(self) -> np.ndarray:
        return self.original - self.random_max

    def summary(self) -> dict[str, Any]:
        """Means, spread and quantiles over the sequences with a finite Δ."""
        keep = np.isfinite(self.deltas)
        d = self.deltas[keep]
        nan = math.nan
        return {
            "n": int(len(d)),
            "k": self.k,
            "n_excluded": int(len(self.deltas) - len(d)),
            "delta_mean": float(d.mean()) if len(d) else nan,
            "delta_std": float(d.std(ddof=1)) if len(d) > 1 else nan,
            "delta_quantiles": dict(
                zip(("p05", "p25", "p50", "p75", "p95"), map(float, np.quantile(d, [0.05, 0.25, 0.5, 0.75, 0.95])))
            )
            if len(d)
            else {},
            "frac_original_higher": float((d > 0).mean()) if len(d) else nan,
            "original_mean": float(self.original[keep].mean()) if len(d) else nan,
            "random_max_mean": float(self.random_max[keep].mean()) if len(d) else nan,
        }


def original_vs_random(
    reward,
    stories: list[str],
    k: int = 5,
    seed: int = 0,
    batch_size: int = 64,
    **context: Any,
) -> OriginalVsRandom:
    """Criterion 1 for ``reward`` (any :class:`~storyrl.rewards.Reward` taking
    per-story image context) over aligned ``stories`` and ``context`` (e.g.
    ``images=[...]`` or ``image_ids=[...]``, one entry per sequence).

    Random partners are drawn without replacement per sequence from the other
    stories (``seed`` fixes them). A sequence whose own score is NaN, or whose
    random stories are all NaN, has Δ = NaN and is left out of the summary.
    """
    n = len(stories)
    if n < 2:
        raise ValueError("criterion 1 needs at least 2 stories")
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1, got k={k}, batch_size={batch_size}")
    k = min(k, n - 1)
    rng = np.random.default_rng(seed)
    partners = []
    for j in range(n):
        pick = rng.choice(n - 1, size=k, replace=False)
        partners.append([int(i + (i >= j)) for i in pick])  # skip j itself

    # Every (story, sequence) pair, scored in batches: the story varies, the
    # sequence's context (images) is that of j.
    pairs = [(j, j) for j in range(n)] + [(i, j) for j in range(n) for i in partners[j]]
    scores = np.empty(len(pairs))
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        texts = [stories[i] for i, _ in chunk]
        sub = {
            key: [value[i if key in STORY_KEYS else j] for i, j in chunk]
            for key, value in context.items()
            if value is not None
        }
        scores[start : start + len(chunk)] = reward.score(texts, **sub)
    original = scores[:n]
    rand = scores[n:].reshape(n, k)
    with np.errstate(all="ignore"):
        finite_any = np.isfinite(rand).any(axis=1)
        random_max = np.where(finite_any, np.nanmax(np.where(np.isfinite(rand), rand, -np.inf), axis=1), np.nan)
    return OriginalVsRandom(k, original, random_max, partners)
