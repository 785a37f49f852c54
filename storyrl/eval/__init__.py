"""Evaluation: d_HM distances, score tables, meta-evaluation, prompting sweeps,
reward ablations."""

from storyrl.eval.ablation import AblationConfig, AblationResult, run_ablation

from storyrl.eval.dhm import DHM_DIMENSIONS, DhmResult, dhm
from storyrl.eval.grounding import OriginalVsRandom, original_vs_random
from storyrl.eval.scoring import score_to_file
from storyrl.eval.sweep import SweepConfig, SweepResult, run_sweep

__all__ = ["DHM_DIMENSIONS", "AblationConfig", "AblationResult", "run_ablation", "DhmResult", "OriginalVsRandom", "SweepConfig", "SweepResult", "dhm",
           "original_vs_random", "run_sweep", "score_to_file"]
