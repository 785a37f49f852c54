"""The accelerate ``Accelerator`` every storyrl trainer starts from
(:func:`storyrl.training.loop.fit` and the PPO trainer alike)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["make_accelerator"]

logger = logging.getLogger(__name__)


def make_accelerator(mixed_precision: str, **kwargs: Any):
    """An ``Accelerator`` with ``mixed_precision`` (on the CPU when CUDA is
    missing; ``kwargs`` go to it as they are). fp16 without CUDA trains in
    fp32 with a warning: accelerate accepts it there but has no fp16
    autocast on the CPU."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if mixed_precision == "fp16" and not torch.cuda.is_available():
        logger.warning("mixed_precision fp16 needs CUDA; training in fp32")
        mixed_precision = "no"
    kwargs = dict(kwargs, mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    try:
        return Accelerator(**kwargs)
    except ValueError as exc:
        if "already been initialized" not in str(exc) or not hasattr(AcceleratorState, "_reset_state"):
            raise
    # An earlier Accelerator in this process (an earlier run, tests,
    # notebooks) used other settings. Only the accelerator-level state is
    # reset; the process-level one (devices, process group) stays.
    logger.warning("re-initialising accelerate's state for mixed_precision=%r", mixed_precision)
    AcceleratorState._reset_state()
    return Accelerator(**kwargs)
