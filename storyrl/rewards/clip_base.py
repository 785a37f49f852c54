"""Shared base of the CLIP-based rewards (``groovist``, ``clipscore``): which
CLIP to use, where a story's images come from, and the shared embedder.

The reward object itself holds only settings; the model and its embedding
caches live in :mod:`storyrl.models`, shared per process, so rewards stay
small and picklable (TRL, multiprocessing) and load the model on first use.
"""

from __future__ import annotations

from typing import Any

from storyrl.rewards.base import Reward


class ClipReward(Reward):
    """Settings common to CLIP rewards.

    Args:
        clip_model: open_clip model name (default ViT-B-32, as the authors).
        clip_pretrained: open_clip pretrained tag ("openai" = the authors'
            weights), a local checkpoint file, or None (random weights).
        device: "cuda", "cpu", ... (default: CUDA when available).
        precision: "auto" (fp16 on CUDA, fp32 on CPU), "fp32", "fp16", "bf16".
        image_root: directory that relative image paths and ``image_ids`` are
            resolved against.
        batch_size: texts/regions per forward pass.
        cache_dir: directory of an on-disk region-embedding cache (optional).
    """

    def __init__(
        self,
        clip_model: str = "ViT-B-32",
        clip_pretrained: str | None = "openai",
        device: str | None = None,
        precision: str = "auto",
        image_root: str | None = None,
        batch_size: int = 64,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        from storyrl.models import PRECISIONS, ClipSpec

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.spec = ClipSpec(clip_model, clip_pretrained, device, precision)
        self.image_root = image_root
        self.batch_size = batch_size
        self.cache_dir = cache_dir

    def _setup(self) -> None:
        self.embedder  # noqa: B018  (loads the model: a failure is not a story's)

    @property
    def embedder(self):
        """The process-wide CLIP embedder (loads the model on first use)."""
        from storyrl.models import clip_embedder

        embedder = clip_embedder(self.spec, batch_size=self.batch_size)
        embedder.use_disk_cache(self.cache_dir)
        return embedder

    def config(self) -> dict[str, Any]:
        return {
            "clip_model": self.spec.model,
            "clip_pretrained": self.spec.pretrained,
            "device": self.spec.device,
            "precision": self.spec.precision,
            "image_root": self.image_root,
            "batch_size": self.batch_size,
            "cache_dir": self.cache_dir,
        }

    def _story_images(self, i: int, images, image_ids, need_files: bool = True) -> tuple[list, list[str] | None]:
        """Story ``i``'s image sequence and its ids (raises ImageError).
        Without ``need_files`` (regions come from crop files named by image
        id), ids alone are enough and stand in for the images."""
        from storyrl.images import resolve_images

        paths = images[i] if images is not None else None
        ids = image_ids[i] if image_ids is not None else None
        if not need_files and ids is not None and paths is None:
            return list(ids), ids
        return resolve_images(images=paths, image_ids=ids, image_root=self.image_root), ids

    def _embedded_regions(self, reasons: list, images, image_ids, source, need_files: bool = True):
        """Regions and their embeddings for every story whose ``reasons`` entry
        is None; a story whose images cannot be used gets a reason instead.
        Returns ``(regions per story, embeddings per story)``."""
        from storyrl.images import ImageError, sequence_regions

        story_regions: list = [None] * len(reasons)
        for i, reason in enumerate(reasons):
            if reason is not None:
                continue
            try:
                seq, ids = self._story_images(i, images, image_ids, need_files)
                story_regions[i] = sequence_regions(source, seq, ids)
            except ImageError as exc:
                reasons[i] = f"images: {exc}"
                continue
            if not story_regions[i]:
                reasons[i] = "no images or regions"
        embeddings = self._embed_regions(story_regions)
        for i, emb in enumerate(embeddings):
            if isinstance(emb, Exception):
                reasons[i], story_regions[i] = f"images: {emb}", None
        return story_regions, embeddings

    def _embed_regions(self, story_regions: list) -> list:
        """Embeddings per story for lists of regions (None entries stay None).
        All regions are embedded in one batched pass; if an image turns out to
        be unreadable, stories are embedded one by one and the story that
        fails gets its :class:`~storyrl.images.ImageError` instead."""
        from storyrl.images import ImageError, load_regions

        embedder = self.embedder
        wanted = [regs for regs in story_regions if regs]
        try:
            flat = embedder.embed_regions([r for regs in wanted for r in regs], load_regions)
        except ImageError:
            out = []
            for regs in story_regions:
                try:
                    out.append(embedder.embed_regions(regs, load_regions) if regs else None)
                except ImageError as exc:
                    out.append(exc)
            return out
        out, start = [], 0
        for regs in story_regions:
            if regs:
                out.append(flat[start : start + len(regs)])
                start += len(regs)
            else:
                out.append(None)
        return out
