"""Training configuration shared by the learned metrics (RoViST-C, RoViST-VG).

A :class:`storyrl.config.Config`: each trainer's config subclasses it, and
``from_yaml``, ``storyrl train`` options and validation come from the fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from storyrl.config import Config, option
from storyrl.training.accelerators import MIXED_PRECISIONS

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig(Config):
    """Settings of :func:`storyrl.training.loop.fit`."""

    _field_word = "key"

    output_dir: str = option(help="Directory for best/, last/ and history.jsonl.", path="new-dir")
    epochs: int = option(20, "Maximum number of epochs.", min=1)
    batch_size: int = option(32, "Examples per optimizer step.", min=1)
    lr: float = option(1e-5, "Learning rate.")
    weight_decay: float = option(1e-5, "Weight decay (adam: L2 in the gradient; adamw: decoupled).")
    optimizer: str = option("adam", "Optimizer: adam (RoViST) or adamw (TAPM).", choices=("adam", "adamw"))
    lr_decay: float = option(0.95, "ExponentialLR gamma, stepped once per epoch.")
    warmup_steps: int = option(0, "Linear learning-rate warm-up over the first optimizer steps.", min=0)
    patience: int = option(5, "Early stopping: epochs without validation-loss improvement.", min=1)
    val_fraction: float = option(0.15, "Fraction of the data held out for validation, in (0, 1).")
    seed: int = option(0, "Seed of the split, the initialisation and the data order.")
    max_steps: int | None = option(None, "Stop after this many optimizer steps (smoke tests).", min=1)
    mixed_precision: str = option("no", "Mixed precision: no (fp32), fp16 (autocast + loss scaling, CUDA or CPU), "
                                  "bf16 (autocast), auto (fp16 on CUDA, no on the CPU).", choices=MIXED_PRECISIONS)
    num_workers: int = option(0, "DataLoader worker processes.", min=0)
    log_every: int = option(50, "Log the training loss every this many steps.", min=1)

    def _problems(self) -> list[str]:
        if not 0.0 < self.val_fraction < 1.0:
            return [f"val_fraction must be in (0, 1), got {self.val_fraction}"]
        return []
