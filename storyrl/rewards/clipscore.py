"""CLIPScore (Hessel et al., 2021) over an image sequence, as the GROOViST
paper uses it for stories: sentence *i* is paired with image *i*, each pair
scores ``2.5 · max(cos, 0)`` (CLIP ViT-B/32, caption prefixed with
"A photo depicts"), and the story score is the mean over the image sequence.

Sentences come from storyrl's NLTK-compatible splitter. When the story has
fewer sentences than images, the images without a sentence score 0 (a story
cannot gain by saying less); sentences beyond the last image are ignored.

Images go through the ``fast`` image pipeline by default (worker-process
decoding, resizing and normalising on the model's device);
``image_pipeline="exact"`` is PIL and CLIP's transform, Hessel et al.'s.
Scores differ by at most 1.9e-5 (the authors' VWP/VIST frames and stories,
ViT-B/32 architecture): :mod:`storyrl.rewards.clip_base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards.clip_base import ClipConfig, ClipReward

WEIGHT = 2.5
PREFIX = "A photo depicts"


def clipscore_from_cosines(cosines: np.ndarray, n_images: int, w: float = WEIGHT) -> float:
    """Story CLIPScore from the cosines of its (sentence i, image i) pairs."""
    if n_images < 1:
        return math.nan
    return float(np.sum(w * np.maximum(np.asarray(cosines, dtype=np.float64), 0.0)) / n_images)


def with_prefix(sentence: str, prefix: str | None) -> str:
    # Hessel et al.'s reference joins prefix and caption with one space.
    return f"{prefix.rstrip()} {sentence}" if prefix else sentence


@dataclass
class CLIPScoreConfig(ClipConfig):
    prefix: str | None = option(PREFIX, "Text put before every sentence, as in Hessel et al. (null: none).")


class CLIPScore(ClipReward):
    """CLIPScore of a story against its image sequence (range [0, 2.5]).

    Story context: ``images`` or ``image_ids`` as for ``groovist``.
    ``prefix`` (default "A photo depicts"; None to disable) is put before
    every sentence, as in Hessel et al.
    """

    name = "clipscore"
    higher_is_better = True
    value_range = (0.0, WEIGHT)
    config_class = CLIPScoreConfig

    def _prepare_source(self):
        from storyrl.images import WholeImage

        return WholeImage()  # as scoring: one embedding per image

    def _score_batch(self, stories: list[str], images=None, image_ids=None, **_: Any) -> np.ndarray:
        from storyrl.images import WholeImage
        from storyrl.text import split_sentences

        sentences = [split_sentences(s) for s in stories]
        reasons: list[str | None] = [None if s else "no sentences" for s in sentences]
        story_regions, region_embs = self._embedded_regions(reasons, images, image_ids, WholeImage())
        texts = {
            i: [with_prefix(s, self.prefix) for s in sentences[i][: len(story_regions[i])]]
            for i in range(len(stories))
            if reasons[i] is None
        }
        unique = list(dict.fromkeys(t for ts in texts.values() for t in ts))
        text_embs = self.embedder.embed_texts(unique)
        row = {t: k for k, t in enumerate(unique)}
        out = np.full(len(stories), np.nan)
        for i in range(len(stories)):
            if reasons[i] is not None:
                out[i] = self._unscorable(reasons[i].split(":")[0], reasons[i])
                continue
            t = text_embs[[row[x] for x in texts[i]]].astype(np.float64)
            cos = np.einsum("kd,kd->k", t, region_embs[i][: len(t)].astype(np.float64))
            out[i] = clipscore_from_cosines(cos, len(story_regions[i]))
        return out
