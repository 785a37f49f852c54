"""What keeps a training run from ending silently wrong, for every trainer
(TRL's, storyrl's PPO and :func:`storyrl.training.loop.fit`):

* :func:`check_finite_weights`: a run whose trainable weights turned NaN/inf
  (a learning rate that diverged) stops in one line instead of saving them
  as ``final/``.
* :func:`check_resume_step`: a checkpoint whose step is not its name's, or
  lies past the run's ``max_steps``, is refused rather than resumed (the
  run would report steps it was never asked for).
* :func:`check_checkpoint_files`: the files a resume loads are readable
  (safetensors headers, torch pickles that load with ``weights_only``),
  checked before loading, so that a corrupted or planted one is named
  instead of surfacing as a long error about no file.
* :func:`finished_history`: a run that already wrote ``final/`` with the
  same config: ``--resume`` on it is a no-op, and this is its history.

Imports no torch at module level.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from storyrl.models.pretrained import check_weight_files
from storyrl.training.runs import RunFailedError

__all__ = ["TrainingDiverged", "check_checkpoint_files", "check_finite_loss", "check_finite_weights",
           "check_named_checkpoint", "check_resume_step", "finished_history", "nonfinite_weights"]


class TrainingDiverged(RunFailedError):
    """The loss or the trainable weights became NaN/inf; nothing is saved as ``final/``."""


def nonfinite_weights(model: Any) -> list[str]:
    """Names of ``model``'s trainable floating-point parameters holding a NaN
    or an infinity. Min and max reductions: no copy of a weight is made,
    and one device sync for the whole model."""
    import torch

    names, flags = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad or not param.is_floating_point() or param.numel() == 0:
            continue  # frozen, quantised, or a shard held by another process (ZeRO-3)
        data = param.detach()
        names.append(name)
        flags.append(torch.stack([data.amax(), data.amin()]).float())
    if not flags:
        return []
    finite = torch.stack([f.to(flags[0].device) for f in flags]).isfinite().all(dim=1).tolist()
    return [name for name, ok in zip(names, finite) if not ok]


def check_finite_weights(model: Any, when: str) -> None:
    """TrainingDiverged (one line, ``when`` first, e.g. "step 3") if a
    trainable weight of ``model`` is NaN/inf."""
    bad = nonfinite_weights(model)
    if bad:
        raise TrainingDiverged(f"{when}: training diverged: {len(bad)} trainable weight tensor(s) hold NaN/inf "
                               f"(first: {bad[0]}); lower the learning rate (or the loss's scale); no final/ is "
                               "written")


def check_finite_loss(loss: float, when: str) -> None:
    """TrainingDiverged if the (logged) training ``loss`` is NaN/inf."""
    if isinstance(loss, (int, float)) and not math.isfinite(loss):
        raise TrainingDiverged(f"{when}: training diverged: the loss is {loss}; lower the learning rate (or the "
                               "loss's scale); no final/ is written")


def check_resume_step(checkpoint: Path, step: int, max_steps: int | None, named_step: int | None = None) -> None:
    """ValueError naming ``checkpoint`` if its recorded ``step`` is not the
    one its name says (``named_step``) or exceeds the run's ``max_steps``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{checkpoint}: its trainer state records step {step!r}, not a step count; not resumed")
    if named_step is not None and step != named_step:
        raise ValueError(f"{checkpoint}: its trainer state records step {step}, its name step {named_step}: not "
                         "a checkpoint this run wrote; remove it to resume")
    if max_steps is not None and step > max_steps:
        raise ValueError(f"{checkpoint}: at step {step}, past this run's max_steps {max_steps}; resume with "
                         f"max_steps >= {step}, or start again (--overwrite)")


def check_named_checkpoint(checkpoint: Path, step_key: str, max_steps: int | None) -> int:
    """The step a ``checkpoint-<step>/`` records in its ``trainer_state.json``
    under ``step_key``, checked against its name and ``max_steps``
    (:func:`check_resume_step`)."""
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        step = state[step_key]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{checkpoint}: trainer_state.json cannot be read ({type(exc).__name__}: {exc}); not "
                         "resumed") from None
    suffix = checkpoint.name.rsplit("-", 1)[-1]
    check_resume_step(checkpoint, step, max_steps, named_step=int(suffix) if suffix.isdigit() else None)
    return step


#: Files of a checkpoint that no resume loads (transformers' pickled
#: TrainingArguments, which ``weights_only`` cannot read by design).
NOT_LOADED = frozenset({"training_args.bin"})
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")


def check_checkpoint_files(checkpoint: Path) -> None:
    """ValueError naming the file if one of ``checkpoint``'s weight or state
    files cannot be read: a safetensors file whose header does not parse
    or does not fit the file, a torch pickle that ``torch.load(...,
    weights_only=True)`` refuses (corrupted, or holding code). Pickles are
    loaded memory-mapped, so their tensors are not read. accelerate's
    ``custom_checkpoint_*.pkl`` is left to
    :func:`storyrl.training.checkpoints.scheduler_state`."""
    check_weight_files(checkpoint)
    for path in sorted(checkpoint.iterdir()):
        if (path.is_file() and path.suffix in PICKLE_SUFFIXES and path.name not in NOT_LOADED
                and not path.name.startswith("custom_checkpoint_")):
            _check_pickle(path)


def _check_pickle(path: Path) -> None:
    import numpy as np
    import torch

    # What transformers and accelerate allow when they load these (numpy RNG states).
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        from accelerate.utils.other import TORCH_SAFE_GLOBALS

        allowed += list(TORCH_SAFE_GLOBALS)
    except ImportError:
        pass
    with torch.serialization.safe_globals(allowed):
        try:
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
        except Exception as exc:  # noqa: BLE001  (garbage fails in many ways: UnpicklingError, KeyError, EOFError...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"{path}: cannot be loaded safely ({type(exc).__name__}: {first[:200]}); not a file "
                             "the trainer wrote, or corrupted: remove the checkpoint or start again") from None


def finished_history(config: Any, config_file: str) -> list[dict] | None:
    """The log history (``OUTPUT_DIR/history.jsonl``) of a run that already
    finished with this same ``config``: ``final/<config_file>``, which a
    trainer writes last into ``final/``, reads back equal to it. None when
    it does not (no final/, another config: a resume with a larger
    max_steps trains on), or the history cannot be read."""
    output = Path(config.output_dir)
    saved = output / "final" / config_file
    if not saved.is_file():
        return None
    try:
        if type(config).from_yaml(saved).to_dict() != config.to_dict():
            return None
        lines = (output / "history.jsonl").read_text(encoding="utf-8").splitlines()
        history = [json.loads(line) for line in lines if line.strip()]
    except (OSError, TypeError, ValueError):
        return None
    if not history or not all(isinstance(h, dict) and isinstance(h.get("step"), int) for h in history):
        return None
    return history
