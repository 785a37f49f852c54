"""The resume and divergence guards of storyrl's TRL runs (SFT, DPO, the
reward model, GRPO, RLOO), used by :mod:`storyrl.training.storyteller.rl.trl_trainers`:

* :func:`resume_checkpoint` / :func:`latest_complete_checkpoint`: the
  ``checkpoint-<step>/`` a ``--resume`` continues from; an incomplete one
  (a kill while it was written) is removed, one whose state records another
  step than its name, or whose files cannot be loaded safely, is refused.
* :class:`RunGuard`: a resumed run whose checkpoint already holds every step
  trains none (transformers' Trainer trains one step past ``max_steps``
  when the run ended inside an epoch: it only checks after a step), one
  past ``max_steps`` is refused; a NaN/inf loss or trainable weight stops
  the run before anything is saved.
* :func:`run_training`: ``trainer.train`` that returns instead when the
  checkpoint already held every step (:class:`TrainingDone`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

from storyrl.training.runs import RunFailedError

__all__ = ["RunGuard", "TrainingDone", "latest_complete_checkpoint", "resume_checkpoint", "run_training"]

logger = logging.getLogger(__name__)


class TrainingDone(RunFailedError):
    """Raised at the start of a resumed ``trainer.train`` whose checkpoint
    already holds every step of the run: nothing is left to train (the
    model and state are the checkpoint's). :func:`run_training` catches it."""


class RunGuard(TrainerCallback):
    """What keeps a TRL run from ending silently wrong (module docs): at
    the start of a resumed run, a checkpoint past ``max_steps`` is refused
    and one at ``max_steps`` raises :class:`TrainingDone` (transformers
    would train a step past it when it ended inside an epoch); at each
    logged step a NaN/inf loss or trainable weight, and at the end a
    NaN/inf weight, stops the run with one line before anything is saved
    (the logged loss alone does not tell: transformers' logging_nan_inf_filter
    logs the mean of the earlier losses in place of a NaN one)."""

    def on_train_begin(self, args, state, control, **kwargs):
        from storyrl.training.guards import check_resume_step

        if state.global_step > 0:  # resumed
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            check_resume_step(checkpoint, state.global_step, state.max_steps)
            if state.global_step == state.max_steps:
                raise TrainingDone(f"{checkpoint}: already at the run's max_steps {state.max_steps}; nothing left "
                                   "to train")

    def on_log(self, args, state, control, logs=None, **kwargs):
        from storyrl.training.guards import check_finite_loss, check_finite_weights

        if logs and "loss" in logs:
            check_finite_loss(logs["loss"], f"step {state.global_step}")
            if kwargs.get("model") is not None:
                check_finite_weights(kwargs["model"], f"step {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        from storyrl.training.guards import check_finite_weights

        if kwargs.get("model") is not None:
            check_finite_weights(kwargs["model"], f"step {state.global_step}")


def run_training(trainer, checkpoint: Path | None) -> bool:
    """``trainer.train()`` from ``checkpoint`` (None: from the start); False
    when the checkpoint already held every step (:class:`TrainingDone`: the
    trainer holds the checkpoint's model and state, nothing was trained)."""
    try:
        trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    except TrainingDone as done:
        logger.info("resume: %s", done)
        return False
    return True


def resume_checkpoint(output_dir: str | Path, resume: bool, max_steps: int | None = None) -> Path | None:
    """The checkpoint a run continues from: with ``resume`` the latest
    complete one (a warning when there is none: the run starts over), its
    weight and state files checked readable
    (:func:`~storyrl.training.guards.check_checkpoint_files`) and its step
    at most ``max_steps`` when given (:class:`RunGuard` checks it against
    the steps an epoch-long run makes)."""
    if not resume:
        return None
    from storyrl.training.guards import check_checkpoint_files, check_resume_step

    checkpoint = latest_complete_checkpoint(output_dir)
    if checkpoint is None:
        logger.warning("resume: no complete checkpoint-<step>/ in %s; starting from the beginning", output_dir)
        return None
    check_resume_step(checkpoint, int(checkpoint.name.rsplit("-", 1)[1]), max_steps)
    check_checkpoint_files(checkpoint)
    return checkpoint


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``checkpoint-<step>/`` that TRL finished writing (its
    ``trainer_state.json``, written last, reads back); a newer incomplete
    one (a kill while it was written) is removed with a warning. One whose
    state names another step than its name was not written by this run
    (TRL writes the state of the step it is named after): refused."""
    import shutil

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from storyrl.training.guards import check_resume_step

    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = []
    for path in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        suffix = path.name[len(PREFIX_CHECKPOINT_DIR) + 1:]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    for step, path in sorted(found, reverse=True):
        try:
            recorded = json.loads((path / "trainer_state.json").read_text(encoding="utf-8")).get("global_step")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded is not None:
            check_resume_step(path, recorded, None, named_step=step)
            return path
        logger.warning("resume: %s is incomplete (interrupted while it was written); removed", path)
        shutil.rmtree(path, ignore_errors=True)
    return None
