"""storyrl's PPO trainer (TRL 1.16 has none), one module per concern as TRL
pairs ``<algo>_config`` / ``<algo>_trainer``:

* :mod:`~storyrl.training.storyteller.rl.ppo.config`: :class:`PPOConfig` (import-light);
* :mod:`~storyrl.training.storyteller.rl.ppo.trainer`: :class:`PPOTrainer`, the loop;
* :mod:`~storyrl.training.storyteller.rl.ppo.math`: the arithmetic, pure functions;
* :mod:`~storyrl.training.storyteller.rl.ppo.rollout`: sampling and forwards per policy kind;
* :mod:`~storyrl.training.storyteller.rl.ppo.value`: the critic;
* :mod:`~storyrl.training.storyteller.rl.ppo.rewards`: the reward calls;
* :mod:`~storyrl.training.storyteller.rl.ppo.checkpoints`: ``checkpoint-<step>/``.

The trainer's names load on first use, so reading the config (``storyrl
--help``, the RL config) imports no torch.
"""

from __future__ import annotations

from typing import Any

from storyrl.training.storyteller.rl.ppo.config import PPOConfig

__all__ = ["TRAINER_STATE", "PPOConfig", "PPOResult", "PPOTrainer", "find_latest_checkpoint"]

_LAZY = {"PPOResult": "trainer", "PPOTrainer": "trainer", "TRAINER_STATE": "checkpoints",
         "find_latest_checkpoint": "checkpoints"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
