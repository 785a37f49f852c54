"""The d_HM dimensions and their per-story distance (Surikuchi et al., 2024).

Here, below both the ``dhm`` reward and :mod:`storyrl.eval.dhm`, so that the
reward does not import the eval package (layers point down). Pure numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DHM_DIMENSIONS", "dimension_distance"]

#: Score-table column of each d_HM dimension -> (dimension name, the map
#: applied to the score before the distance: tanh for raw GROOViST, else None).
DHM_DIMENSIONS = {
    "groovist": ("grounding", np.tanh),
    "coherence": ("coherence", None),
    "repetition": ("repetition", None),
}


def dimension_distance(metric: str, human: np.ndarray, model: np.ndarray) -> np.ndarray:
    """Per story, |human − model| of the d_HM column ``metric`` after its map
    (NaN where either score is NaN)."""
    _, transform = DHM_DIMENSIONS[metric]
    if transform is not None:
        human, model = transform(human), transform(model)
    return np.abs(human - model)
