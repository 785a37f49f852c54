"""PPO checkpoints: ``<output_dir>/checkpoint-<step>/`` holds accelerate's
state (policy and critic, optimizer, learning-rate schedule, every process's
RNG) and ``trainer_state.json`` (step, KL coefficient, running score
moments, learning-rate schedule, history, config). Each is written aside (``.tmp``) and renamed
when complete, so a crash never leaves a half-written one; resume takes the
newest complete one."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from storyrl.training.checkpoints import scheduler_state

__all__ = ["TRAINER_STATE", "find_latest_checkpoint", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
# Options a resumed run may change without a warning.
RESUME_MAY_CHANGE = {"max_steps", "total_episodes", "num_train_epochs", "save_steps", "save_total_limit",
                     "logging_steps", "num_sample_stories", "report_to", "output_dir"}


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
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep is not None:
            steps = sorted((s, p) for p in output_dir.glob("checkpoint-*") if (s := _step_of(p)) is not None)
            for _, path in steps[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, checkpoint: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Restore accelerate's state and return ``trainer_state.json``, warning
    about settings that differ from the checkpoint's (other than those a
    resume may change)."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
    state["scheduler"] = scheduler_state(accelerator, checkpoint, state)  # never unpickled
    accelerator.load_state(str(checkpoint))
    changed = sorted(k for k, v in state.get("config", {}).items()
                     if k not in RESUME_MAY_CHANGE and config.get(k, v) != v)
    if changed:
        logger.warning("resuming with changed settings (the checkpoint used other values): %s", ", ".join(changed))
    logger.info("resuming from %s (step %d)", checkpoint, state["step"])
    return state
