"""PPO checkpoints: ``<output_dir>/checkpoint-<step>/`` holds accelerate's
state (policy and critic, optimizer, every process's RNG) and
``trainer_state.json`` (step, KL coefficient, running score moments,
learning-rate schedule, history, config). Each is written aside (``.tmp``)
and renamed when complete, so a crash never leaves a half-written one;
resume takes the newest complete one. Writing and reading a checkpoint are
:mod:`storyrl.training.checkpoints`' (shared with every trainer); this
module holds the ``checkpoint-<step>`` layout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from storyrl.training.checkpoints import TRAINER_STATE, write_checkpoint

__all__ = ["RESUME_MAY_CHANGE", "TRAINER_STATE", "find_latest_checkpoint", "save_checkpoint"]

#: PPOConfig options a resumed run may change without a warning.
RESUME_MAY_CHANGE = frozenset({"max_steps", "total_episodes", "num_train_epochs", "save_steps", "save_total_limit",
                               "logging_steps", "num_sample_stories", "report_to", "output_dir"})


def _step_of(path: Path) -> int | None:
    suffix = path.name[len("checkpoint-"):]
    return int(suffix) if path.name.startswith("checkpoint-") and suffix.isdigit() else None


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete ``checkpoint-<step>`` with the highest step, or None."""
    found = [(_step_of(p), p) for p in Path(output_dir).glob("checkpoint-*") if (p / TRAINER_STATE).is_file()]
    found = [(s, p) for s, p in found if s is not None]
    return max(found)[1] if found else None


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict[str, Any],
                    keep: int | None = None) -> Path:
    """Write ``checkpoint-<step>`` (every process takes part); keep only the
    newest ``keep`` checkpoints."""
    final, tmp = output_dir / f"checkpoint-{step}", output_dir / f"checkpoint-{step}.tmp"
    write_checkpoint(accelerator, tmp, state)
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep is not None:
            steps = sorted((s, p) for p in output_dir.glob("checkpoint-*") if (s := _step_of(p)) is not None)
            for _, path in steps[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
