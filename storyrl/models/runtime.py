"""Devices, precision and the process-wide model registry shared by the
model-based rewards.

Models load once per process (:func:`shared_model`): every reward asking for
the same model gets the same instance, and with it the same in-memory
embedding caches. :func:`release_models` forgets them all. Light to import:
torch is imported only by :func:`resolve_device` and :func:`resolve_dtype`.
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


def resolve_precision(precision: str, device) -> str:
    """"auto" → fp16 on CUDA (what the authors' CLIP runs in on GPU), fp32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "fp16" if getattr(device, "type", str(device)) == "cuda" else "fp32"
    return precision


def resolve_dtype(precision: str, device):
    """The torch dtype of :func:`resolve_precision`'s answer."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[resolve_precision(precision, device)]


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
