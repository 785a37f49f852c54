"""Shared base of the CLIP-based rewards (``groovist``, ``clipscore``): which
CLIP to use, where a story's images come from, and the shared embedder.

The reward object itself holds only settings; the model and its embedding
caches live in :mod:`storyrl.models`, shared per process, so rewards stay
small and picklable (TRL, multiprocessing) and load the model on first use.
"""

from __future__ import annotations

from typing import Any

from storyrl.rewards.region_base import RegionReward


class ClipReward(RegionReward):
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
        from storyrl.models.clip import ClipSpec
        from storyrl.models.runtime import check_run_options

        check_run_options(precision, batch_size)
        self.spec = ClipSpec(clip_model, clip_pretrained, device, precision)
        self.image_root = image_root
        self.batch_size = batch_size
        self.cache_dir = cache_dir

    def _setup(self) -> None:
        self.embedder  # noqa: B018  (loads the model: a failure is not a story's)

    @property
    def embedder(self):
        """The process-wide CLIP embedder (loads the model on first use)."""
        from storyrl.models.clip import clip_embedder

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

    def _embed_region_list(self, regions: list):
        from storyrl.images import load_regions

        return self.embedder.embed_regions(regions, load_regions)
