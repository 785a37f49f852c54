"""RoViST-VG's training dataset: a torch ``Dataset`` of (region pixels,
phrase vector) pairs. Apart from :mod:`storyrl.training.judges.rovist_vg` because
subclassing ``Dataset`` imports torch, which that module's config (read by
``storyrl train rovist_vg --help`` and config checks) must not."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from storyrl.models.glove import GloVe
    from storyrl.training.judges.rovist_vg import RegionPhrase

__all__ = ["RegionPhraseDataset"]

log = logging.getLogger("storyrl.training.judges.rovist_vg")  # the trainer's logger, as before the split


class RegionPhraseDataset(Dataset):
    """``(pixels [3, H, W], phrase vector [word_dim])`` per pair with a GloVe
    vector; ``skipped`` counts the pairs without one. Holds one vector per
    distinct phrase, not per pair, and no GloVe table (picklable for workers)."""

    def __init__(self, pairs: list[RegionPhrase], glove: GloVe, transform) -> None:
        self.transform = transform
        phrase_row: dict[str, int] = {}
        vectors: list[np.ndarray] = []
        self.items: list[tuple[str, Any, int]] = []
        self.skipped = 0
        skipped_phrases: dict[str, int] = {}
        for pair in pairs:
            k = phrase_row.get(pair.phrase)
            if k is None:
                vec = glove.phrase_vector(pair.phrase)
                if vec is None:
                    self.skipped += 1
                    skipped_phrases[pair.phrase] = skipped_phrases.get(pair.phrase, 0) + 1
                    continue
                k = phrase_row[pair.phrase] = len(vectors)
                vectors.append(vec.astype(np.float32))
            self.items.append((pair.image, pair.box, k))
        self.vectors = np.stack(vectors) if vectors else np.zeros((0, glove.dim), np.float32)
        if self.skipped:
            common = sorted(skipped_phrases.items(), key=lambda kv: -kv[1])[:5]
            log.warning(
                "skipped %d of %d pairs whose phrase has no GloVe vector (e.g. %s)",
                self.skipped,
                len(pairs),
                ", ".join(f"{p!r} x{n}" for p, n in common),
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        from storyrl.images import Region, load_region

        image, box, k = self.items[index]
        pixels = self.transform(load_region(Region(image, box)))
        return pixels, torch.from_numpy(self.vectors[k])
