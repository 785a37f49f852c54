"""Training: the shared machinery of every trainer (the epoch loop, checkpoints,
run directories, guards, accelerators, model cards) and the :data:`TRAINERS`
registry. The trainers live in two folders, one per audience:
:mod:`storyrl.training.judges` (the learned metrics' models: RoViST-C, Vrank,
COSMiC, RoViST-VG) and :mod:`storyrl.training.storyteller` (the storyteller's
path: SFT, pairs and a reward model, DPO, RL, and TAPM). Neither imports the
other, and the shared modules import neither (the registry names them by
strings).

Every trainer is a :class:`Trainer` -- a :class:`storyrl.config.Config`
subclass and a ``train(config, resume=False, progress=True)`` function --
registered in :data:`TRAINERS`; ``storyrl train <name>`` is generated from
it (its options are the config's fields).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from storyrl.registry import Registry

__all__ = ["TRAINERS", "TrainResult", "Trainer"]


@runtime_checkable
class TrainResult(Protocol):
    """What every train function returns: ``summary()`` is the JSON line
    ``storyrl train <name>`` prints (:class:`storyrl.training.loop.FitResult`,
    :class:`storyrl.training.storyteller.rl.train.RLResult`)."""

    def summary(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Trainer:
    """A registered trainer: its config class and its train function
    ``train(config, resume=False, progress=True)``, which returns a
    :class:`TrainResult`; ``outputs``, ``config_file`` and ``resume_help``
    are what its command's help says about the output directory, where its
    configs live (``{name}``: the trainer's) and what ``--resume`` does
    (by default :func:`storyrl.training.loop.fit`'s layout)."""

    config_class: type
    train: Callable[..., TrainResult]
    outputs: str = ("Best model in OUTPUT_DIR/best, resumable state in OUTPUT_DIR/last, one JSON line per epoch in "
                    "OUTPUT_DIR/history.jsonl.")
    config_file: str = "configs/training/{name}.yaml"
    resume_help: str = "Continue from OUTPUT_DIR/last."

    def run(self, config, resume: bool = False, progress: bool = True, overwrite: bool = False) -> Any:
        """``train`` inside its output directory's guard
        (:func:`storyrl.training.runs.run_directory`): storyrl's trainers
        hold it themselves (:func:`~storyrl.training.runs.guarded`), a
        trainer registered from outside gets it here."""
        from storyrl.training.runs import guarded

        train = self.train if getattr(self.train, "storyrl_guarded", False) else guarded(self.train)
        return train(config, resume=resume, progress=progress, overwrite=overwrite)


TRAINERS: Registry[Trainer] = Registry("trainer")
TRAINERS.add("coherence", "storyrl.training.judges.coherence:TRAINER",
             "RoViST-C: the ALBERT sentence-order model of the coherence reward.")
TRAINERS.add("rovist_vg", "storyrl.training.judges.rovist_vg:TRAINER",
             "RoViST-VG: the ViT/GloVe region-noun model of the rovist_vg reward.", aliases=("rovist-vg",))
TRAINERS.add("vrank", "storyrl.training.judges.vrank:TRAINER",
             "Vrank: the pairwise story ranker of the vrank reward, on VHED-format CSVs.")
TRAINERS.add("cosmic", "storyrl.training.judges.cosmic:TRAINER",
             "COSMiC Vanilla/Vanilla+: the coherence-aware caption metric's head on RaCCoon-format ratings.")
TRAINERS.add("tapm", "storyrl.training.storyteller.tapm:TRAINER",
             "TAPM-style storyteller: adaptation stage (decoder frozen), then downstream cross-entropy.")
TRAINERS.add("rl", "storyrl.training.storyteller.rl.train:TRAINER",
             "RL fine-tuning of a storyteller (causal LM, VLM or TAPM) against storyrl rewards: ppo, grpo or rloo.")
TRAINERS.add("sft", "storyrl.training.storyteller.sft:TRAINER",
             "Supervised fine-tuning of a storyteller (causal LM or VLM) on human stories (TRL SFTTrainer), RL's prompt.")
TRAINERS.add("dpo", "storyrl.training.storyteller.dpo:TRAINER",
             "DPO of a storyteller (causal LM or VLM) on story preference pairs (TRL DPOTrainer) with RL's monitors.")
TRAINERS.add("reward_model", "storyrl.training.storyteller.reward_model:TRAINER",
             "Story reward model (TRL RewardTrainer, Bradley-Terry) on storyrl pairs; the reward_model reward.")
