"""The accelerate ``Accelerator`` every storyrl trainer starts from
(:func:`storyrl.training.loop.fit` and the PPO trainer alike).

``mixed_precision`` is taken as asked, never replaced by another:

* ``no``: fp32.
* ``bf16``: bf16 autocast (accelerate does it on CUDA and on the CPU).
* ``fp16``: fp16 autocast with a ``GradScaler`` (loss scaling, steps with
  inf/NaN gradients skipped). accelerate 1.x makes both on CUDA only; on the
  CPU it accepts ``fp16`` and silently trains in fp32. torch (>= 2.3) has
  fp16 autocast and a ``GradScaler`` on the CPU, so there they are given to
  the accelerator here: the same fp16 path as on a GPU, only slower.
* ``auto``: fp16 on CUDA, ``no`` on the CPU (where fp16 autocast is slow).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["MIXED_PRECISIONS", "cpu_fp16", "make_accelerator", "resolve_mixed_precision"]

logger = logging.getLogger(__name__)

#: The values of every trainer's ``mixed_precision`` key.
MIXED_PRECISIONS = ("auto", "no", "fp16", "bf16")


def resolve_mixed_precision(mixed_precision: str, cuda: bool | None = None) -> str:
    """``auto`` as ``fp16`` on CUDA and ``no`` elsewhere; the others as they
    are. ``cuda`` defaults to whether torch sees a CUDA device."""
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision: expected one of {', '.join(MIXED_PRECISIONS)}, got {mixed_precision!r}")
    if mixed_precision != "auto":
        return mixed_precision
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return "fp16" if cuda else "no"


def make_accelerator(mixed_precision: str, **kwargs: Any):
    """An ``Accelerator`` with ``mixed_precision`` (module docs; on the CPU
    when CUDA is missing; ``kwargs`` go to it as they are)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    mixed_precision = resolve_mixed_precision(mixed_precision)
    kwargs = dict(kwargs, mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    try:
        accelerator = Accelerator(**kwargs)
    except ValueError as exc:
        if "already been initialized" not in str(exc) or not hasattr(AcceleratorState, "_reset_state"):
            raise
        # An earlier Accelerator in this process (an earlier run, tests,
        # notebooks) used other settings. Only the accelerator-level state is
        # reset; the process-level one (devices, process group) stays.
        logger.warning("re-initialising accelerate's state for mixed_precision=%r", mixed_precision)
        AcceleratorState._reset_state()
        accelerator = Accelerator(**kwargs)
    # Elsewhere accelerate made the scaler, or (DeepSpeed) fp16 is the engine's own.
    if mixed_precision == "fp16" and accelerator.scaler is None and accelerator.device.type == "cpu":
        cpu_fp16(accelerator)
    return accelerator


def cpu_fp16(accelerator) -> None:
    """Give a CPU accelerator made with ``mixed_precision="fp16"`` the fp16
    autocast and ``GradScaler`` accelerate makes on CUDA only (module docs;
    also for the accelerator of a transformers ``Trainer`` with
    ``fp16=True``). Set before ``prepare``, which wraps the model's forward
    in the autocast and the optimizer around the scaler; ``backward``,
    ``clip_grad_norm_``, ``save_state`` and ``load_state`` use the scaler too."""
    import torch

    if accelerator.device.type != "cpu":
        raise ValueError(f"cpu_fp16: the accelerator is on {accelerator.device.type!r}, not the CPU")
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")
    with accelerator.autocast():  # a later accelerate that builds its autocast otherwise must not train in fp32
        works = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    if not works:
        raise ValueError("mixed_precision: fp16 autocast on the CPU is not available with this accelerate; use bf16 "
                         "or no")
