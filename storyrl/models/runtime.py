"""Devices, precision and the process-wide model registry shared by the
model-based rewards.

Models load once per process (:func:`shared_model`): every reward asking for
the same model gets the same instance, and with it the same in-memory
embedding caches. :func:`release_models` forgets them all. Light to import:
torch is imported only inside the functions that need it.

Precision (a model reward's ``precision`` option) is the dtype the model's
weights are held in and its floating inputs are cast to; its outputs are
converted to float32 before any math (normalisation, cosine, softmax). Every
model runs one tiny input when it loads (:func:`check_runs`), so that a
precision it cannot run in is refused then (:class:`PrecisionError`, one
line naming the option) rather than failing every story, and non-finite
outputs (fp16 overflow) raise :class:`ModelFailure` instead of NaN scores.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any

PRECISIONS = ("auto", "fp32", "fp16", "bf16")


def resolve_device(device: str | None = None):
    """``None``/"auto" → CUDA when available, else CPU."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class PrecisionError(ValueError):
    """A precision a model cannot run in on its device: refused when the model
    is set up (one line naming the ``precision`` option), never coerced."""


class ModelFailure(RuntimeError):
    """A model failed in a way no story causes (non-finite outputs): rewards
    raise it once instead of giving every story NaN."""


def resolve_precision(precision: str, device) -> str:
    """"auto" → fp16 on CUDA (what the authors' CLIP runs in on GPU), fp32
    elsewhere. bf16 on a CUDA card without bf16 (before Ampere) is refused:
    torch would emulate it or fail inside the first forward pass."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kind = getattr(device, "type", str(device))
    if precision == "auto":
        return "fp16" if kind == "cuda" else "fp32"
    if precision == "bf16" and kind == "cuda":
        import torch

        if torch.cuda.is_available() and not cuda_native_bf16():
            raise PrecisionError(f"precision bf16: {device} does not support bfloat16; use fp16 or fp32")
    return precision


def cuda_native_bf16() -> bool:
    """Whether the current CUDA device computes in bfloat16 natively (compute
    capability 8.0 or newer). ``torch.cuda.is_bf16_supported()`` counts slow
    emulation as support since torch 2.3 (a T4 says yes), which would let
    "auto" pick bf16 and the bf16 refusals pass on such a card."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3: no emulation argument, and no emulation counted
        return bool(torch.cuda.is_bf16_supported())


def resolve_dtype(precision: str, device):
    """The torch dtype of :func:`resolve_precision`'s answer."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[resolve_precision(precision, device)]


def autocast_forward(net, batch: dict, device, dtype):
    """``net``'s float32 output on ``batch`` (tensors moved to ``device``),
    run under autocast of ``dtype`` (none at fp32): weights held in that
    dtype still get autocast's fp32 ops (softmax, layer norm)."""
    import torch

    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        return net(**{k: v.to(device) for k, v in batch.items()}).float()


def check_finite(values, what: str, precision: str) -> None:
    """ModelFailure unless every value of ``values`` (a model's float output,
    tensor or array) is finite: fp16 overflows above 65504 into inf, and a
    NaN score per story would hide that from the user."""
    import torch

    if not bool(torch.isfinite(torch.as_tensor(values)).all()):
        hint = ("fp16 overflows above 65504: set the precision option to bf16 or fp32" if precision == "fp16"
                else "set the precision option to fp32" if precision == "bf16"
                else "the model's weights may be broken")
        raise ModelFailure(f"{what} gave non-finite outputs at precision {precision}; {hint}")


def check_runs(run: Callable[[], Any], what: str, precision: str, device) -> None:
    """Run ``run()`` (a freshly loaded model on one tiny input, returning its
    float output) once at load time, so that a precision the model cannot run
    in on ``device`` is refused then, in one line naming the option, instead
    of failing every story."""
    try:
        out = run()
    except Exception as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        if precision == "fp32":
            raise
        raise PrecisionError(f"{what} cannot run at precision {precision} on {device} ({detail}); "
                             "set the precision option to fp32") from exc
    try:
        check_finite(out, what, precision)
    except ModelFailure as exc:
        if precision == "fp32":
            raise
        raise PrecisionError(str(exc)) from None  # a load-time refusal, like the error above


_SHARED: dict[Hashable, Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_model(key: Hashable, load: Callable[[], Any]) -> Any:
    """The process-wide object for ``key``, created by ``load()`` on first use:
    every reward asking for the same model gets the same instance."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = load()
        return _SHARED[key]


def release_models() -> None:
    """Forget every loaded model and its caches (frees memory)."""
    with _SHARED_LOCK:
        _SHARED.clear()


def free_memory() -> None:
    """Collect garbage and hand CUDA's cached blocks back (after dropping a
    model; :func:`release_models` forgets the shared ones first)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# What a saved transformers tokenizer writes (one of them suffices).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "spiece.model", "vocab.txt")


def has_saved_tokenizer(directory) -> bool:
    """Whether ``directory`` holds a saved tokenizer. transformers 5 builds an
    empty-vocabulary tokenizer from a directory holding only the model's
    config, so a tokenizer is loaded from a directory only when this is true."""
    from pathlib import Path

    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)
