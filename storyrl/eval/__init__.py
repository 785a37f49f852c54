"""Evaluation: d_HM distances, score tables, meta-evaluation."""

from storyrl.eval.dhm import DHM_DIMENSIONS, DhmResult, dhm

__all__ = ["DHM_DIMENSIONS", "DhmResult", "dhm"]
