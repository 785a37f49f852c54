"""Evaluation: d_HM distances, score tables, meta-evaluation."""

from storyrl.eval.dhm import DHM_DIMENSIONS, DhmResult, dhm
from storyrl.eval.grounding import OriginalVsRandom, original_vs_random

__all__ = ["DHM_DIMENSIONS", "DhmResult", "OriginalVsRandom", "dhm", "original_vs_random"]
