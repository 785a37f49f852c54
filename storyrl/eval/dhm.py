"""d_HM: how far a model's stories are from human stories (lower is better).

Per story id, |human − model| for each selected dimension: grounding (from the
raw GROOViST score, mapped to [−1, 1] by tanh), coherence (RoViST-C) and
repetition (RoViST-NR). A story counts only when every selected dimension is
finite in both tables. Each dimension's distance is the mean over the counted
stories; d_HM is the mean of the dimension distances (Surikuchi et al., 2024).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from storyrl.data import ScoreTable

# The dimensions and the per-story distance live below rewards (the dhm reward
# uses them too); re-exported here under their old names.
from storyrl.rewards.dhm_distance import DHM_DIMENSIONS, dimension_distance

__all__ = ["DHM_DIMENSIONS", "DhmResult", "dhm"]


@dataclass
class DhmResult:
    n: int
    #: mean |human − model| per dimension, keyed by dimension name
    #: (``grounding``, ``coherence``, ``repetition``)
    distances: dict[str, float]
    d_hm: float
    #: ids of the counted stories and their per-dimension distances
    story_ids: list[str] = field(default_factory=list)
    per_story: dict[str, np.ndarray] = field(default_factory=dict)
    #: stories in both tables left out because a score is missing or NaN
    n_excluded: int = 0

    def summary(self) -> dict[str, float | int]:
        return {"n": self.n, **self.distances, "d_hm": self.d_hm}


def dhm(human: ScoreTable, model: ScoreTable, metrics: Sequence[str] | None = None) -> DhmResult:
    """d_HM between a human and a model score table over the ``metrics``
    columns (default: every d_HM column present in both tables)."""
    if metrics is None:
        metrics = [m for m in DHM_DIMENSIONS if m in human.scores and m in model.scores]
    if not metrics:
        raise ValueError(f"no d_HM metric to compare; choose from {list(DHM_DIMENSIONS)}")
    for m in metrics:
        if m not in DHM_DIMENSIONS:
            raise ValueError(f"unknown d_HM metric {m!r}; choose from {list(DHM_DIMENSIONS)}")
        for name, table in (("human", human), ("model", model)):
            if m not in table.scores:
                raise ValueError(f"the {name} table has no {m!r} column (it has {table.metrics})")
    model_ids = set(model.ids)
    in_both = [sid for sid in human.ids if sid in model_ids]
    counted = [
        sid
        for sid in in_both
        if all(
            math.isfinite(t.scores[m].get(sid, math.nan)) for m in metrics for t in (human, model)
        )
    ]
    per_story = {}
    for m in metrics:
        h = np.array([human.scores[m][sid] for sid in counted], dtype=np.float64)
        g = np.array([model.scores[m][sid] for sid in counted], dtype=np.float64)
        per_story[DHM_DIMENSIONS[m][0]] = dimension_distance(m, h, g)
    distances = {dim: float(d.mean()) if len(d) else math.nan for dim, d in per_story.items()}
    return DhmResult(
        n=len(counted),
        distances=distances,
        d_hm=float(np.mean(list(distances.values()))) if counted else math.nan,
        story_ids=counted,
        per_story=per_story,
        n_excluded=len(in_both) - len(counted),
    )
