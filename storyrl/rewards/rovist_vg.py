"""RoViST-VG (Wang et al., 2022): visual grounding of a story's nouns in the
regions of its image sequence, with a dedicated contrastively trained model.

The model (a timm ViT image encoder and a GloVe text encoder, projected to a
joint space) and its shared embedder are in :mod:`storyrl.models.rovist_vg`,
the GloVe reader in :mod:`storyrl.models.glove`; training is
:mod:`storyrl.training.judges.rovist_vg`. This module is the metric and its reward.

Score of a story::

    nouns   = spaCy NOUN/PROPN tokens of the story, lower-cased, de-duplicated
    cos_i   = max over the top-10 regions of *every* image of cos(T_i, I_j)
    S_VG    = log Σ_i exp(idf_i · cos_i)                       (RoViST Eq. 2)
    scaled  = 2 / (1 + exp(−0.5 · S_VG)) − 1                   (RoViST Eq. 3)

with ``idf = log(N / (1 + df))`` over a story corpus (RoViST Eq. 1).

Choices where the papers leave room, documented here:

* ``scaled`` defaults to False. d_HM (Surikuchi et al., 2024) measures
  grounding with GROOViST, not RoViST-VG, so it fixes no default; RoViST calls
  the scaled form optional and GROOViST's analysis (its Eq. 1) uses the
  unscaled S_VG.
* A noun none of whose words has a GloVe vector (looked up lower-cased) is
  skipped: the text encoder has no input for it. A story left without nouns
  is unscorable (NaN), as is one without usable images.
* Without ``idf_corpus`` every idf weight is 1.0 (an unweighted variant; a
  warning is logged), since the weights need a corpus the reward cannot guess.
* Regions: the authors' top-10 Faster R-CNN boxes correspond to
  ``regions="table"`` with a detector CSV (:func:`storyrl.images.detect_regions`);
  ``grid``/``whole`` work without a detector but are not the authors' setup.
* Region crops are resized to the ViT input without cropping (see
  :mod:`storyrl.models.rovist_vg`): a centre crop would cut off part of a
  detected box.
* ``image_pipeline`` (issue 32) takes the CLIP rewards' values and default:
  ``fast`` (worker-process decoding, tensor preprocessing) or ``exact`` (PIL
  and the ViT's timm transform, the authors' pipeline); the pixels differ by
  resampling round-off, the vectors are cached apart.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from storyrl.config import option
from storyrl.models.clip import IMAGE_PIPELINES
from storyrl.rewards.clip_base import ClipConfig
from storyrl.rewards.region_base import RegionConfig, RegionReward

if TYPE_CHECKING:
    from storyrl.models.glove import GloVe
    from storyrl.models.rovist_vg import RovistVGEmbedder

log = logging.getLogger(__name__)

__all__ = [
    "RovistVG",
    "rovist_vg_score",
    "scale_score",
]


# -- the formula ---------------------------------------------------------------


def rovist_vg_score(max_cos: Sequence[float], idf: Sequence[float] | float = 1.0, scaled: bool = False) -> float:
    """RoViST-VG of one story from its nouns' best cosines and idf weights:
    ``log Σ exp(idf · max_cos)`` (Eq. 2), or its scaled form (Eq. 3).
    NaN without nouns."""
    x = np.asarray(idf, dtype=np.float64) * np.asarray(max_cos, dtype=np.float64)
    if not x.size:
        return math.nan
    top = float(x.max())
    value = top + math.log(float(np.exp(x - top).sum()))  # stable log-sum-exp
    return scale_score(value) if scaled else value


def scale_score(s_vg: float) -> float:
    """``2 / (1 + exp(−0.5 · S_VG)) − 1`` (RoViST Eq. 3), in (−1, 1)."""
    return 2.0 / (1.0 + math.exp(-0.5 * s_vg)) - 1.0


# -- the reward -----------------------------------------------------------------


@dataclass
class NounScore:
    """One noun of a story, for inspection (``explain``)."""

    noun: str
    idf: float
    cosine: float
    image_index: int
    region: str


@dataclass
class StoryAnalysis:
    score: float
    nouns: list[NounScore]
    skipped: list[str] = field(default_factory=list)  # nouns without a GloVe vector
    reason: str | None = None  # why the story is unscorable

    def to_json(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "reason": self.reason,
            "nouns": [asdict(n) for n in self.nouns],
            "skipped": list(self.skipped),
        }


def story_nouns(raw: Sequence[str] | None) -> list[str]:
    """The nouns RoViST-VG scores: lower-cased, stripped, empty ones dropped,
    repeats across the story dropped (order kept)."""
    return list(dict.fromkeys(s for s in (str(p).strip().lower() for p in raw or ()) if s))


@dataclass
class RovistVGConfig(RegionConfig):
    model: str | None = option(None, "RoViST-VG model directory (storyrl train rovist_vg).", path="dir")
    glove: str | None = option(None, "The GloVe text file the model was trained with (300-d).", path="file")
    idf_corpus: str | None = option(None, "Story set (JSON/JSONL) or Idf.to_json table giving the nouns' idf weights; "
                                    "null = weights 1.0 (not the paper's metric).", path="file")
    scaled: bool = option(False, "Return Eq. 3's scaled score in (-1, 1) instead of S_VG.")
    spacy_pipeline: str = option("en_core_web_trf", "spaCy pipeline for POS tags (nouns = NOUN/PROPN).")
    batch_size: int = option(64, "Regions or nouns per forward pass.", min=1)
    # The CLIP rewards' default, so that one setting reads the same everywhere.
    image_pipeline: str = option(
        ClipConfig.image_pipeline, "How region pixels are made: fast (decoding in worker processes, resizing and "
        "normalising as tensors on the model's device) or exact (PIL and the ViT's timm transform, the authors' "
        "pipeline).", choices=IMAGE_PIPELINES)


class RovistVG(RegionReward):
    """RoViST-VG as a reward (higher = better grounded).

    Story context: ``images`` (paths or PIL images, one per position) or
    ``image_ids`` (resolved against ``image_root``); optionally ``nouns``
    (per story, a list of nouns) to skip spaCy. Without ``nouns``, a
    ``noun_phrases`` column is used the same way (a multi-word entry gets the
    mean vector of its words) -- note that GROOViST's noun chunks are not
    RoViST's nouns, so give ``nouns`` when a dataset serves both rewards.

    Options: :class:`RovistVGConfig`.
    """

    name = "rovist_vg"
    higher_is_better = True
    config_class = RovistVGConfig
    #: Record fields that carry the scored units, so that spaCy is not needed.
    text_unit_fields = ("nouns", "noun_phrases")

    def __init__(self, config: RovistVGConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        if self.idf_corpus is None:
            log.warning("rovist_vg: no idf_corpus, so every noun weighs 1.0 (the paper weights by idf)")
        self.value_range = (-1.0, 1.0) if self.scaled else (-math.inf, math.inf)
        self._extractor = self._glove = self._idf = None
        #: Set when every story comes with its nouns (records' nouns, or
        #: noun_phrases): setup() then does not require the spaCy pipeline.
        self.text_units_given = False

    def setup(self) -> RovistVG:
        """Check the spaCy pipeline is installed (unless the nouns are
        given), then load the models."""
        from storyrl.noun_phrases import check_reward_pipeline

        check_reward_pipeline(self, "the nouns precomputed: --nouns, or records' nouns or noun_phrases")
        return super().setup()

    def __getstate__(self) -> dict[str, Any]:
        # Loaded things are rebuilt on demand after unpickling (the model is
        # never held here: it lives in the per-process shared cache).
        state = dict(self.__dict__)
        state["_extractor"] = state["_glove"] = state["_idf"] = None
        return state

    # -- lazily loaded parts ---------------------------------------------------
    def _setup(self) -> None:
        # Load failures are the reward's, not a story's: let them propagate.
        # (Checked here, not in __init__, so configs load before models exist.)
        if not self.model:
            raise ValueError("rovist_vg needs model: a RoViST-VG directory (RovistVGModel.save_pretrained)")
        if not self.glove:
            raise ValueError("rovist_vg needs glove: the GloVe text file the model was trained with")
        from storyrl.models.rovist_vg import CONFIG_FILE

        if not (Path(self.model) / CONFIG_FILE).is_file():
            raise ValueError(f"{self.model}: not a storyrl RoViST-VG model directory (no {CONFIG_FILE})")
        if not Path(self.glove).is_file():
            raise ValueError(f"{self.glove}: GloVe file not found")
        self.embedder  # noqa: B018
        self.word_vectors  # noqa: B018
        self.idf  # noqa: B018

    @property
    def embedder(self) -> RovistVGEmbedder:
        from storyrl.models.rovist_vg import rovist_vg_embedder

        return rovist_vg_embedder(self.model, self.device, self.precision)

    @property
    def word_vectors(self) -> GloVe:
        if self._glove is None:
            from storyrl.models.glove import shared_glove

            self._glove = shared_glove(self.glove)
        return self._glove

    @property
    def idf(self):
        """The idf weighting (``weights(nouns)``), or None for weights 1.0."""
        if self._idf is None and self.idf_corpus is not None:
            from storyrl.word_weights import load_idf

            self._idf = load_idf(self.idf_corpus)
        return self._idf

    @property
    def extractor(self):
        if self._extractor is None:
            from storyrl.noun_phrases import PhraseExtractor

            self._extractor = PhraseExtractor(self.spacy_pipeline, units="nouns")
        return self._extractor

    # -- scoring -----------------------------------------------------------------
    def analyse(
        self, stories: list[str], images=None, image_ids=None, nouns=None, noun_phrases=None, **_: Any
    ) -> list[StoryAnalysis]:
        """Score stories keeping every noun's idf, best cosine and best
        region. Unscorable stories carry a ``reason``."""
        n = len(stories)
        given = nouns if nouns is not None else noun_phrases
        raw = given if given is not None else self.extractor.extract(list(stories))
        glove = self.word_vectors
        units = [story_nouns(r) for r in raw]
        kept = [[u for u in us if glove.phrase_vector(u) is not None] for us in units]
        skipped = [[u for u in us if glove.phrase_vector(u) is None] for us in units]
        reasons: list[str | None] = [
            "no nouns" if not us else "no nouns with word vectors" if not k else None for us, k in zip(units, kept)
        ]
        story_regions, region_embs = self._embedded_regions(reasons, images, image_ids, self.region_source)
        todo = [i for i in range(n) if reasons[i] is None]
        unique = list(dict.fromkeys(u for i in todo for u in kept[i]))
        text_embs = self.embedder.embed_phrases(unique, glove, self.batch_size)
        row = {u: k for k, u in enumerate(unique)}

        out = []
        for i in range(n):
            if reasons[i] is not None:
                out.append(StoryAnalysis(math.nan, [], skipped[i], reasons[i]))
                continue
            t = text_embs[[row[u] for u in kept[i]]].astype(np.float64)
            cos = t @ region_embs[i].T.astype(np.float64)
            best = cos.argmax(axis=1)
            max_cos = cos[np.arange(len(best)), best]
            weights = np.asarray(self.idf.weights(kept[i]) if self.idf is not None else [1.0] * len(kept[i]))
            regs = story_regions[i]
            out.append(
                StoryAnalysis(
                    rovist_vg_score(max_cos, weights, self.scaled),
                    [
                        NounScore(u, float(w), float(c), regs[b].image_index, regs[b].label)
                        for u, w, c, b in zip(kept[i], weights, max_cos, best)
                    ],
                    skipped[i],
                )
            )
        return out

    def _score_batch(self, stories: list[str], **context: Any) -> np.ndarray:
        return self._scores_from(self.analyse(stories, **context))

    def explain(self, stories: list[str], **context: Any) -> list[dict[str, Any]]:
        """Per-story score, reason, per-noun details and skipped nouns as
        JSON-ready dicts."""
        return [a.to_json() for a in self.analyse(list(stories), **context)]

    def _embed_region_list(self, regions: list) -> np.ndarray:
        from storyrl.images import load_regions

        return self.embedder.embed_regions(regions, load_regions, self.batch_size, self.image_pipeline)
