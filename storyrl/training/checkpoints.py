"""The files :func:`storyrl.training.loop.fit` keeps in its output directory.

Saving and finding the resume checkpoint (``last/``: accelerate's state plus
``trainer_state.json``), promoting a new ``best/``, the crash-safe directory
swap behind both (``*.tmp`` → final, the previous copy kept as ``*.old`` until
the new one is in place), ``history.jsonl``, the check of a checkpoint's
settings against the resuming run's, and the global RNG states a mid-epoch
resume restores. The directory layout is described in :mod:`storyrl.training.loop`.

Writing a checkpoint (:func:`write_checkpoint`) and resuming from one
(:func:`load_checkpoint`, :func:`scheduler_state`) are shared with the PPO
trainer, which keeps ``checkpoint-<step>/`` directories instead of ``last/``
(:mod:`storyrl.training.storyteller.rl.ppo.checkpoints`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RESUME_MAY_CHANGE",
    "TRAINER_STATE",
    "find_checkpoint",
    "load_checkpoint",
    "restore_best",
    "rng_state",
    "save_best",
    "save_checkpoint",
    "scheduler_state",
    "set_rng_state",
    "swap_in",
    "write_checkpoint",
    "write_history",
]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
#: fit's settings that may legitimately change when resuming (train longer,
#: stop sooner, different logging); anything else differing gets a warning.
RESUME_MAY_CHANGE = {"epochs", "max_steps", "patience", "log_every", "num_workers", "output_dir"}


def swap_in(tmp: Path, final: Path) -> None:
    """Replace directory ``final`` by the complete ``tmp`` so that a crash at
    any point leaves the old (``final``.old) or the new one intact."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        # final only ever appears by this rename, so it is complete and any
        # .old left by an earlier crash is stale.
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    # Otherwise an earlier crash came between the two renames: .old is the
    # only complete copy, kept until tmp is in place.
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def save_best(save_fn: Callable[[torch.nn.Module, Path], None], model: torch.nn.Module, output_dir: Path) -> None:
    """``save_fn(model, output_dir/best.tmp)``, then swapped in as ``best/``."""
    # Written aside and swapped in: best/ is always complete.
    tmp = output_dir / "best.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_fn(model, tmp)
    if tmp.exists():  # a save_fn may write nothing there
        swap_in(tmp, output_dir / "best")


def restore_best(output_dir: Path) -> None:
    """On resume: a best.old means the interrupted run crashed while
    replacing best/, before its checkpoint recorded the new best (the
    checkpoint is written after best/), so best.old is the best/ that goes
    with the checkpoint; the epoch is run again and re-saves it if due."""
    best, old, tmp = output_dir / "best", output_dir / "best.old", output_dir / "best.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    if old.exists():
        if best.exists():
            shutil.rmtree(best)
        os.replace(old, best)
        logger.warning("%s: restored best/ from best.old (left by an interrupted save)", output_dir)


def find_checkpoint(output_dir: Path) -> Path | None:
    for candidate in (output_dir / "last", output_dir / "last.old"):  # .old: crash mid-swap
        if (candidate / TRAINER_STATE).is_file():
            return candidate
    return None


def write_checkpoint(accelerator, tmp: Path, state: dict[str, Any]) -> None:
    """accelerate's full state (model, optimizer, RNG, grad scaler) and the
    trainer's own (``trainer_state.json``) into ``tmp``, a directory the
    caller then moves into place on the main process (every process takes
    part; a stale ``tmp`` from a crash is removed first)."""
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process: per-process RNG files
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")


def save_checkpoint(accelerator, output_dir: Path, state: dict) -> None:
    """The loop's resume checkpoint: written to last.tmp, then swapped in as last/."""
    write_checkpoint(accelerator, output_dir / "last.tmp", state)
    if accelerator.is_main_process:
        swap_in(output_dir / "last.tmp", output_dir / "last")
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, checkpoint: Path, config: dict[str, Any],
                    may_change: Collection[str] = RESUME_MAY_CHANGE) -> dict[str, Any]:
    """Restore accelerate's state from ``checkpoint`` and return the
    trainer's own (``trainer_state.json``), warning about settings of
    ``config`` (a config's ``to_dict()``) that differ from the checkpoint's
    other than those a resume may change (``may_change``)."""
    from storyrl.training.guards import check_checkpoint_files

    state = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
    state["scheduler"] = scheduler_state(accelerator, checkpoint, state)  # never unpickled
    check_checkpoint_files(checkpoint)  # a corrupted or planted file is named, not a long unpickling error
    accelerator.load_state(str(checkpoint))
    changed = sorted(k for k, v in state.get("config", {}).items() if k not in may_change and config.get(k, v) != v)
    if changed:
        logger.warning("resuming with changed settings (the checkpoint used other values): %s", ", ".join(changed))
    return state


def scheduler_state(accelerator, checkpoint: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The learning-rate schedule's state of a checkpoint, before
    ``accelerator.load_state`` (every process calls it).

    storyrl keeps it in ``trainer_state.json``; a ``custom_checkpoint_*.pkl``
    there (accelerate would unpickle it, running any code it holds) was not
    written by storyrl and is refused. A checkpoint from before storyrl kept
    the schedule in ``custom_checkpoint_0.pkl``: read with
    ``weights_only=True`` (a state dict of numbers needs no code), then moved
    aside to ``.legacy`` so that accelerate, which loads every such file it
    finds, does not."""
    files = sorted(checkpoint.glob("custom_checkpoint_*.pkl"))
    if "scheduler" in state:
        if files:
            raise ValueError(f"{files[0]}: not a file storyrl writes (the schedule is in {TRAINER_STATE}); it is "
                             "never loaded: remove it to resume")
        return state["scheduler"]
    legacy = checkpoint / "custom_checkpoint_0.pkl"
    aside = legacy.with_name(legacy.name + ".legacy")
    try:
        schedule = torch.load(legacy if legacy.exists() else aside, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing, or a pickle that wants to run code
        raise ValueError(f"{checkpoint}: no learning-rate schedule in {TRAINER_STATE} and {legacy.name} cannot be "
                         f"read safely ({type(exc).__name__}); start the run again (--overwrite)") from None
    accelerator.wait_for_everyone()  # every process has read it before it moves
    if accelerator.is_main_process and legacy.exists():
        os.replace(legacy, aside)
    accelerator.wait_for_everyone()
    return schedule


def write_history(path: Path, history: list[dict]) -> None:
    text = "".join(json.dumps(record) + "\n" for record in history)
    try:
        if path.read_text(encoding="utf-8") == text:
            return  # as it is (a finished run resumed changes no file)
    except (OSError, UnicodeDecodeError):
        pass
    # Written aside and renamed: a crash never leaves a truncated history.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """The global RNG states a training step can draw from (those accelerate's
    checkpoints save, for CPU and CUDA)."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
