"""The storyteller's trainers, in the order a run takes them: supervised
fine-tuning (:mod:`~storyrl.training.storyteller.sft`), story preference
pairs and a learned reward model
(:mod:`~storyrl.training.storyteller.reward_model`), DPO
(:mod:`~storyrl.training.storyteller.dpo`) and RL
(:mod:`storyrl.training.storyteller.rl`); and TAPM-style storytellers
(:mod:`~storyrl.training.storyteller.tapm`).

The options they share live in :mod:`~storyrl.training.storyteller.config`,
re-exported here so ``from storyrl.training.storyteller import
StorytellerConfig`` works. Importing this package loads no torch or TRL
(the trainers import them lazily).
"""

from storyrl.training.storyteller.config import (
    POLICIES,
    SETTINGS,
    LoraOptions,
    RunResult,
    StorytellerConfig,
    TrlRunOptions,
    match_precision,
)

__all__ = ["POLICIES", "SETTINGS", "LoraOptions", "RunResult", "StorytellerConfig", "TrlRunOptions", "match_precision"]
