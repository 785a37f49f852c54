"""CLIP loading (open_clip) and the shared CLIP embedder of the CLIP-based
rewards (``groovist``, ``clipscore``).

Every reward asking for the same CLIP (model, pretrained tag, device,
precision) gets the same :class:`ClipEmbedder` (:func:`clip_embedder`), and
with it the same in-memory embedding caches, so ``groovist`` and
``clipscore`` in one run embed a shared image once. open_clip and torch are
imported when an embedder is built, not with this module.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storyrl.models.caches import IMAGE_PIPELINES, DiskEmbeddingCache, LruDict, pipeline_key
from storyrl.models.runtime import check_finite, check_runs, resolve_device, resolve_precision, shared_model

log = logging.getLogger(__name__)

__all__ = ["IMAGE_PIPELINES", "ClipEmbedder", "ClipSpec", "clip_embedder", "image_input_dtype"]


@dataclass(frozen=True)
class ClipSpec:
    """Which CLIP to load. ``model`` is any open_clip model name (or
    ``hf-hub:org/repo``); ``pretrained`` an open_clip pretrained tag
    ("openai", "laion2b_s34b_b79k", ...), a local checkpoint file, or None for
    random weights."""

    model: str = "ViT-B-32"
    pretrained: str | None = "openai"
    device: str | None = None
    precision: str = "auto"

    @property
    def key(self) -> str:
        return f"open_clip:{self.model}:{self.pretrained}"


def _has_schema(model: str) -> bool:
    return model.startswith(("hf-hub:", "local-dir:"))


class ClipEmbedder:
    """L2-normalised CLIP embeddings of texts and image regions, each computed
    once: an in-memory LRU cache (and an optional on-disk cache for regions),
    batched forward passes, and parallel image decoding.

    Use :func:`clip_embedder` to get the process-wide shared instance.
    """

    def __init__(self, spec: ClipSpec, batch_size: int = 64, max_cached: int = 200_000) -> None:
        import open_clip
        import torch

        from storyrl.models.hub import open_clip_hub_id, require_hub_model

        self.spec = spec
        self.batch_size = batch_size
        self.device = resolve_device(spec.device)
        self.precision = resolve_precision(spec.precision, self.device)
        hub_id = open_clip_hub_id(spec.model, spec.pretrained)
        if hub_id:
            require_hub_model(hub_id, what=f"CLIP model {spec.model!r} (pretrained={spec.pretrained!r})",
                              hint="set the reward's clip_pretrained option to a local checkpoint file "
                                   "(--clip-pretrained FILE)")
        try:
            # hf-hub:/local-dir: models carry their own weights and open_clip ignores
            # pretrained for them (logging that it does, for the "openai" default).
            pretrained = None if _has_schema(spec.model) else spec.pretrained
            model, _, preprocess = open_clip.create_model_and_transforms(
                spec.model, pretrained=pretrained, precision=self.precision, device=self.device
            )
        except (RuntimeError, OSError, ValueError) as exc:
            raise RuntimeError(
                f"cannot load CLIP model {spec.model!r} with pretrained={spec.pretrained!r}: {exc}. "
                "Pretrained weights are downloaded to the open_clip/Hugging Face cache on first use; "
                "offline, pass a local checkpoint file as pretrained."
            ) from exc
        self.model = _cast_half_cast_towers(model, self.precision).eval()
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(spec.model)
        self.dtype = image_input_dtype(model)
        self._torch = torch
        check_runs(self._probe, f"CLIP model {spec.model!r}", self.precision, self.device)
        self.texts = LruDict(max_cached)
        self.regions = LruDict(max_cached)
        self.disk: DiskEmbeddingCache | None = None
        self.stats = {"texts_embedded": 0, "regions_embedded": 0, "regions_from_disk": 0}
        self._fast_spec: tuple | None = None
        self._lock = threading.Lock()

    def _probe(self):
        """One blank image and one text through the towers (no cache, no stats)."""
        from PIL import Image

        images = self._encode_images([Image.new("RGB", (32, 32))])
        texts = self._encode_texts(["a photo"])
        return self._torch.from_numpy(np.concatenate([images, texts]))

    # -- texts --------------------------------------------------------------
    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32, rows L2-normalised."""
        with self._lock:
            vecs, encoded = self.texts.fetch({t: t for t in texts}, self._encode_texts, self.batch_size)
            self.stats["texts_embedded"] += encoded
            return np.stack([vecs[t] for t in texts]) if texts else np.zeros((0, 0), np.float32)

    def _encode_texts(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        tokens = self.tokenizer(texts).to(self.device)
        with torch.inference_mode():
            feats = _encode_text_trimmed(self.model, tokens).float()
            check_finite(feats, f"CLIP model {self.spec.model!r} (text)", self.precision)
            feats = torch.nn.functional.normalize(feats, dim=-1)
        return feats.cpu().numpy()

    # -- regions ------------------------------------------------------------
    def use_disk_cache(self, directory: str | os.PathLike | None) -> None:
        if directory is not None and (self.disk is None or self.disk.path.parent != Path(directory)):
            self.disk = DiskEmbeddingCache(directory, self.cache_key)

    @property
    def cache_key(self) -> str:
        """The on-disk cache's model key: the precision is part of it (fp16
        vectors must not stand in for fp32 ones, nor the reverse); fp32 keeps
        the key it always had, so existing caches stay valid."""
        return self.spec.key if self.precision == "fp32" else f"{self.spec.key}:{self.precision}"

    def embed_regions(self, regions: Sequence[Any], load: Callable[[Sequence[Any]], list],
                      pipeline: str = "exact") -> np.ndarray:
        """Embeddings of ``regions`` (:class:`storyrl.images.Region` objects).
        ``pipeline="exact"``: ``load(regions)`` returns their PIL images
        (called only for regions not cached), preprocessed by the model's
        own transform; ``"fast"``: the regions are decoded in worker
        processes and preprocessed as tensors on the model's device
        (:mod:`storyrl.images.tensor_preprocess`; ``load`` is not called).
        The two give slightly different vectors, cached apart (in memory and
        on disk). ``[len(regions), dim]`` float32, rows L2-normalised."""
        key = pipeline_key(pipeline)
        fast = pipeline == "fast" and self.fast_spec is not None
        variant = "" if pipeline == "exact" else ":" + pipeline

        with self._lock:
            # Vectors held here, not read back from the LRU: a call with more
            # regions than it keeps would lose the first ones.
            got = {}
            for r in regions:
                if key(r) not in got and (vec := self.regions.get_fresh(key(r))) is not None:
                    got[key(r)] = vec
            todo = list({key(r): r for r in regions if key(r) not in got}.values())
            if self.disk is not None:
                self.disk.variant = variant  # this call's pipeline, for every read and write below
            if todo and self.disk is not None:
                found = self.disk.get_many([r.key for r in todo])
                for r in todo:
                    if r.key in found:
                        self.regions.put(key(r), found[r.key])
                        got[key(r)] = found[r.key]
                self.stats["regions_from_disk"] += len(found)
                todo = [r for r in todo if r.key not in found]
            for chunk, vecs in (self._fast_batches(todo) if fast else self._exact_batches(todo, load)):
                new = {r.key: v for r, v in zip(chunk, vecs)}
                for r, vec in zip(chunk, vecs):
                    self.regions.put(key(r), vec)
                    got[key(r)] = vec
                if self.disk is not None:
                    self.disk.put_many(new)
            self.stats["regions_embedded"] += len(todo)
            if not regions:
                return np.zeros((0, 0), np.float32)
            return np.stack([got[key(r)] for r in regions])

    def _exact_batches(self, todo: list, load: Callable[[Sequence[Any]], list]):
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start : start + self.batch_size]
            yield chunk, self._encode_images(load(chunk))

    def _fast_batches(self, todo: list):
        from storyrl.images.tensor_preprocess import encoded_batches

        return encoded_batches(todo, self.fast_spec, self.device, self.dtype, self.batch_size, self._encode_images)

    @property
    def fast_spec(self):
        """What the fast pipeline reproduces of the model's transform (None:
        it cannot; the exact pipeline is used, said once)."""
        if self._fast_spec is None:
            from storyrl.images.tensor_preprocess import reproducible_spec

            self._fast_spec = (reproducible_spec(self.preprocess, f"CLIP model {self.spec.model!r}", log),)
        return self._fast_spec[0]

    def _encode_images(self, images) -> np.ndarray:
        """One forward pass of the image tower, for either pipeline: PIL
        images (the exact one's, preprocessed here) or a ready pixel batch
        (the fast one's)."""
        pixels = images if isinstance(images, self._torch.Tensor) else self.exact_pixels(images)
        return self._encode_pixels(pixels)

    def exact_pixels(self, images: list):
        """The exact pipeline's model input for PIL ``images``: the model's
        own transform, on the model's device in its input dtype."""
        # PIL decoding/resizing release the GIL: preprocess in threads.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            pixels = self._torch.stack(list(pool.map(self.preprocess, images)))
        return pixels.to(self.device, self.dtype)

    def _encode_pixels(self, pixels) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            feats = self.model.encode_image(pixels).float()
            check_finite(feats, f"CLIP model {self.spec.model!r} (images)", self.precision)
            feats = torch.nn.functional.normalize(feats, dim=-1)
        return feats.cpu().numpy()


def _cast_half_cast_towers(model, precision: str):
    """``model`` with a Hugging Face text tower cast whole at fp16/bf16.
    open_clip's fp16/bf16 casts conv/linear weights only, which a
    transformers text tower (``hf-hub:`` models with an ``hf_model_name``
    text config) cannot run: its embeddings and layer norms stay fp32 and
    feed fp16 linear layers ("mat1 and mat2 must have the same dtype")."""
    if precision not in ("fp16", "bf16"):
        return model
    import torch
    from open_clip.hf_model import HFTextEncoder

    text = getattr(model, "text", None)
    if isinstance(text, HFTextEncoder):
        text.to(torch.float16 if precision == "fp16" else torch.bfloat16)
    return model


def image_input_dtype(model):
    """The dtype the image tower's first layer computes in, which the pixels
    must match. Not the model's first parameter: open_clip's fp16/bf16 casts
    only conv/linear/attention weights and keeps embeddings (the first
    parameters) in fp32, while timm towers are cast whole. The first conv or
    linear layer of ``model.visual`` is the patch embedding of a ViT, the stem
    of a ResNet and of a timm trunk alike."""
    import torch
    from torch import nn

    for module in model.visual.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)) and module.weight.is_floating_point():
            return module.weight.dtype
    return torch.float32


def _encode_text_trimmed(model, tokens):
    """``model.encode_text`` on tokens cut to the longest text in the batch.

    CLIP's text tower is causal and pools at the end-of-text token, so the
    padding after it never influences the output: cutting it gives the same
    embedding (up to float rounding) at a fraction of the cost for short noun
    phrases. Only for open_clip's standard ``CLIP`` class with argmax pooling;
    any other text tower runs unchanged.
    """
    from open_clip.model import CLIP
    from torch import nn

    if type(model) is not CLIP or getattr(model, "text_pool_type", "argmax") != "argmax":
        return model.encode_text(tokens)
    length = int(tokens.argmax(dim=-1).max()) + 1
    tokens = tokens[:, :length]
    cast_dtype = model.transformer.get_cast_dtype()
    x = model.token_embedding(tokens).to(cast_dtype)
    x = x + model.positional_embedding[:length].to(cast_dtype)
    mask = model.attn_mask[:length, :length] if model.attn_mask is not None else None
    x = model.transformer(x, attn_mask=mask)
    x = model.ln_final(x)
    x = x[tokens.new_tensor(range(x.shape[0])), tokens.argmax(dim=-1)]
    if isinstance(model.text_projection, nn.Linear):
        x = model.text_projection(x)
    elif model.text_projection is not None:
        x = x @ model.text_projection
    return x


def clip_embedder(spec: ClipSpec, batch_size: int = 64) -> ClipEmbedder:
    """The process-wide :class:`ClipEmbedder` for ``spec`` (loaded on first use)."""
    embedder = shared_model(("clip", spec), lambda: ClipEmbedder(spec, batch_size=batch_size))
    embedder.batch_size = batch_size  # a speed setting: the latest caller's applies
    return embedder
