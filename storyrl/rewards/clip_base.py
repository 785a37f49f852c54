"""Shared base of the CLIP-based rewards (``groovist``, ``clipscore``): which
CLIP to use, where a story's images come from, and the shared embedder.

The reward object itself holds only settings; the model and its embedding
caches live in :mod:`storyrl.models`, shared per process, so rewards stay
small and picklable (TRL, multiprocessing) and load the model on first use.

``image_pipeline`` (issue 32) chooses how region pixels are made. ``fast``,
the default: files decoded in worker processes, regions taken as tensor
slices, resized (Pillow's weights) and normalised on the model's device in
batches (:mod:`storyrl.images.tensor_preprocess`). ``exact``: PIL and the
model's own torchvision transform per region, the authors' pipeline. The
pixels differ by resampling round-off only; with the authors' ViT-B/32
architecture (random weights: no pretrained ones here) on the real VWP and
VIST frames and 602 of their stories, the scores differed by at most 1.2e-4
(GROOViST, raw) and 1.9e-5 (CLIPScore), 100x below the smallest gap between
two systems in the authors' tables and data (0.012, GROOViST); no system's
order changed. Vectors of the two pipelines are cached apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storyrl.config import option
from storyrl.models.clip import IMAGE_PIPELINES
from storyrl.rewards.region_base import ImageConfig, RegionReward


@dataclass
class ClipConfig(ImageConfig):
    """Options common to CLIP rewards."""

    clip_model: str = option("ViT-B-32", "open_clip model name, hf-hub:org/repo or local-dir:PATH (the authors': "
                             "ViT-B-32).")
    clip_pretrained: str | None = option("openai", "open_clip pretrained tag (openai = the authors' weights), a local "
                                         "checkpoint file, or null (random weights).")
    cache_dir: str | None = option(None, "Directory of an on-disk region-embedding cache.", path="new-dir")
    image_pipeline: str = option(
        "fast", "How region pixels are made: fast (default: decoding in worker processes, resizing and normalising "
        "on the model's device; scores within ~1e-4 of exact) or exact (PIL and the model's transform, the "
        "authors' pipeline).", choices=IMAGE_PIPELINES)


class ClipReward(RegionReward):
    """Base of the CLIP rewards: the process-wide embedder of ``clip_model``."""

    config_class = ClipConfig

    def __init__(self, config: ClipConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        from storyrl.models.clip import ClipSpec

        self.spec = ClipSpec(self.clip_model, self.clip_pretrained, self.device, self.precision)

    def _setup(self) -> None:
        self.embedder  # noqa: B018  (loads the model: a failure is not a story's)

    @property
    def embedder(self):
        """The process-wide CLIP embedder (loads the model on first use)."""
        from storyrl.models.clip import clip_embedder

        embedder = clip_embedder(self.spec, batch_size=self.batch_size)
        embedder.use_disk_cache(self.cache_dir)
        return embedder

    def _embed_region_list(self, regions: list):
        from storyrl.images import load_regions

        return self.embedder.embed_regions(regions, load_regions, self.image_pipeline)
