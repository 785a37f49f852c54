"""Shared base of the rewards that embed image regions (``groovist``,
``clipscore``, ``rovist_vg``): resolving a story's images, cutting them into
regions, embedding every region of a batch in one pass, and turning image
problems into per-story reasons instead of errors.

Subclasses implement :meth:`_embed_region_list` (their model's cached,
batched region embedding). Their configs build on :class:`ImageConfig`
(where images come from) and :class:`RegionConfig` (how they are cut).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.images import REGION_KINDS
from storyrl.rewards.base import ModelConfig, Reward, column_length, story_context

log = logging.getLogger(__name__)


@dataclass
class ImageConfig(ModelConfig):
    """Options of the rewards that read a story's images."""

    image_root: str | None = option(None, "Directory that image paths and image ids are resolved against.",
                                    path="dir")


@dataclass
class RegionConfig(ImageConfig):
    """Options of the rewards that cut images into regions."""

    regions: str | None = option(
        None, "Region source: table (detector boxes), crops (crop files), grid (3x3 + whole image), whole; "
        "default: table/crops when given, else grid.", choices=REGION_KINDS)
    region_table: str | None = option(None, "Region table CSV (image_id,bbox rows; top-B per image in file order).",
                                      path="file")
    crops_dir: str | None = option(None, "Directory of precomputed crops named <image_id>_<bbox>.jpg.", path="dir")
    top_b: int = option(10, "Regions per image.", min=1)
    grid: int = option(3, "Grid regions: a grid x grid split plus the whole image.", min=1)


class RegionReward(Reward):
    def __init__(self, config: RegionConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        if isinstance(self.args, RegionConfig):
            from storyrl.images import region_source_from_options

            a = self.args
            # The kind in use (a default resolved) and the source that cuts the regions.
            self.regions, self.region_source = region_source_from_options(
                a.regions, a.region_table, a.crops_dir, a.top_b, a.grid
            )

    def _prepare_source(self):
        """The region source :meth:`prepare` cuts images with: the one scoring uses."""
        return self.region_source

    def _region_embedder(self):
        """The model embedder whose ``stats`` count embedded regions (None: not counted)."""
        return getattr(self, "embedder", None)

    def prepare(self, context: Mapping[str, Any], progress: bool = False) -> dict[str, int]:
        """Embed the regions of every row's image sequence into the reward's
        caches (module docs of :mod:`storyrl.rewards.base`), about
        ``batch_size`` regions per forward; regions already cached (in
        memory or in ``cache_dir``) are not embedded again, and with
        ``cache_dir`` each batch is on disk before the next starts, so an
        interrupted run loses at most one batch. Rows whose images cannot be
        read are counted in ``failed`` and left to scoring to report."""
        from storyrl.console import progress as progress_bar
        from storyrl.images import ImageError, sequence_regions

        context = story_context(context)
        images, image_ids = context.get("images"), context.get("image_ids")
        n = column_length(context)
        if (images is None and image_ids is None) or not n:
            return {}
        Reward.setup(self)  # the models, not the text side (GROOViST's spaCy check)
        source = self._prepare_source()
        need_files = getattr(source, "crops_dir", None) is None
        embedder = self._region_embedder()
        before = dict(getattr(embedder, "stats", {}))
        counts = {"sequences": 0, "regions": 0, "failed": 0}
        seen: set = set()
        chunk: list = []

        def flush() -> None:
            for emb in self._embed_regions(chunk):
                if isinstance(emb, Exception):
                    counts["failed"] += 1
            chunk.clear()

        bar = progress_bar(total=n, desc=f"{self.name}: embedding images", unit="seq", disable=not progress)
        try:
            for i in range(n):
                bar.update(1)
                try:
                    seq, ids = self._story_images(i, images, image_ids, need_files)
                    regions = sequence_regions(source, seq, ids)
                except ImageError:
                    counts["failed"] += 1
                    continue
                new = [r for r in regions if r.key not in seen]
                if not new:
                    continue
                seen.update(r.key for r in new)
                counts["sequences"] += 1
                counts["regions"] += len(new)
                chunk.append(new)
                if sum(map(len, chunk)) >= self.batch_size:
                    flush()
            if chunk:
                flush()
        finally:
            bar.close()
        after = getattr(embedder, "stats", {})
        counts["embedded"] = after.get("regions_embedded", 0) - before.get("regions_embedded", 0)
        counts["from_disk"] = after.get("regions_from_disk", 0) - before.get("regions_from_disk", 0)
        cache = getattr(embedder, "regions", None)
        if getattr(embedder, "disk", None) is None and cache is not None and counts["regions"] > cache.maxsize:
            log.warning("%s: %d regions prepared but only the %d last are kept in memory; set cache_dir (a disk "
                        "cache) to keep them all", self.name, counts["regions"], cache.maxsize)
        return counts

    def _embed_region_list(self, regions: list) -> np.ndarray:
        """``[len(regions), dim]`` embeddings (raises ImageError for an
        unreadable image)."""
        raise NotImplementedError

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

    def _embedded_regions(self, reasons: list, images, image_ids, source):
        """Regions and their embeddings for every story whose ``reasons`` entry
        is None; a story whose images cannot be used gets a reason instead.
        Returns ``(regions per story, embeddings per story)``."""
        from storyrl.images import ImageError, sequence_regions

        # Crop files are named by image id: a table with crops needs no image files.
        need_files = getattr(source, "crops_dir", None) is None
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
                reasons[i], story_regions[i], embeddings[i] = f"images: {emb}", None, None
        return story_regions, embeddings

    def _embed_regions(self, story_regions: list) -> list:
        """Embeddings per story for lists of regions (None entries stay None).
        All regions are embedded in one batched pass; if an image turns out to
        be unreadable, stories are embedded one by one and the story that
        fails gets its :class:`~storyrl.images.ImageError` instead."""
        from storyrl.images import ImageError

        try:
            flat = self._embed_region_list([r for regs in story_regions if regs for r in regs])
        except ImageError:
            out: list = []
            for regs in story_regions:
                try:
                    out.append(self._embed_region_list(regs) if regs else None)
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

    def _scores_from(self, analyses: list[Any], failure_score: float | None = None) -> np.ndarray:
        """Scores of analysed stories (objects with ``score`` and ``reason``);
        unscorable ones are counted by reason and get NaN (or
        ``failure_score``)."""
        scores = []
        for result in analyses:
            if result.reason is None:
                scores.append(result.score)
            else:
                nan = self._unscorable(result.reason.split(":")[0], result.reason)
                scores.append(nan if failure_score is None else failure_score)
        return np.asarray(scores, dtype=np.float64)
