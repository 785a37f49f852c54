"""The models behind the model-based rewards, and what they share.

* :mod:`storyrl.models.runtime`: devices, precision, and the process-wide
  model registry (:func:`shared_model`, :func:`release_models`);
* :mod:`storyrl.models.caches`: in-memory LRU and on-disk embedding caches;
* :mod:`storyrl.models.clip`: CLIP loading and the shared CLIP embedder
  (``groovist``, ``clipscore``);
* :mod:`storyrl.models.coherence`: the RoViST-C sentence-order model
  (``coherence``);
* :mod:`storyrl.models.rovist_vg`: the RoViST-VG model and its embedder
  (``rovist_vg``), with the GloVe reader in :mod:`storyrl.models.glove`;
* :mod:`storyrl.models.vlm`: vision-language models for zero-shot story
  generation (``storyrl.generators.prompting``).

Models load once per process: every reward asking for the same model gets the
same instance, and with it the same embedding caches. The reward files keep
the metrics' math and the reward classes.

``import storyrl.models`` stays light (no torch): the names of the torch-based
modules (``coherence``, ``rovist_vg``) are imported on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from storyrl.models.caches import DiskEmbeddingCache, LruDict
from storyrl.models.clip import ClipEmbedder, ClipSpec, clip_embedder
from storyrl.models.glove import GloVe, load_glove, shared_glove
from storyrl.models.runtime import (
    PRECISIONS,
    release_models,
    resolve_device,
    resolve_precision,
    shared_model,
)
from storyrl.models.vlm import DEFAULT_VLM, VisionLanguageModel, load_vlm

# name -> submodule, imported on first access (these submodules import torch)
_LAZY = {
    "CoherenceModel": "coherence",
    "encode_pairs": "coherence",
    "load_coherence_model": "coherence",
    "RovistVGEmbedder": "rovist_vg",
    "RovistVGModel": "rovist_vg",
    "rovist_vg_embedder": "rovist_vg",
}

__all__ = [
    "DEFAULT_VLM",
    "PRECISIONS",
    "ClipEmbedder",
    "ClipSpec",
    "DiskEmbeddingCache",
    "GloVe",
    "LruDict",
    "VisionLanguageModel",
    "clip_embedder",
    "load_glove",
    "load_vlm",
    "release_models",
    "resolve_device",
    "resolve_precision",
    "shared_glove",
    "shared_model",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
