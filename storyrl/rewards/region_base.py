"""Shared base of the rewards that embed image regions (``groovist``,
``clipscore``, ``rovist_vg``): resolving a story's images, cutting them into
regions, embedding every region of a batch in one pass, and turning image
problems into per-story reasons instead of errors.

Subclasses set ``image_root`` and implement :meth:`_embed_region_list`
(their model's cached, batched region embedding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from storyrl.rewards.base import Reward


class RegionReward(Reward):
    image_root: str | None = None

    def _embed_region_list(self, regions: list) -> np.ndarray:
        """``[len(regions), dim]`` embeddings (raises ImageError for an
        unreadable image)."""
        raise NotImplementedError

    def _set_region_source(self, regions, region_table, crops_dir, top_b, grid) -> None:
        """``regions`` (kind), ``region_source`` and ``region_options`` from
        the reward's region options."""
        from storyrl.images import region_source_from_options

        self.regions, self.region_source = region_source_from_options(regions, region_table, crops_dir, top_b, grid)
        self.region_options = {"region_table": region_table, "crops_dir": crops_dir, "top_b": top_b, "grid": grid}

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
