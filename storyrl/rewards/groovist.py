"""GROOViST (Surikuchi et al., 2023): visual grounding of a story's noun
phrases in the regions of its image sequence.

For every noun phrase (NP) of a story: its CLIP text embedding is compared
with the embeddings of the top-B region crops of *every* image of the
sequence, and the best cosine is kept (temporal misalignment is fine). Then,
as the authors' implementation does (``shared/docs/reference-notes.md``)::

    s = 2.5 * max_cos
    s = s            if s >= theta
        -(theta - s) otherwise          (penalty for poorly grounded NPs)
    s = s * weight                      (concreteness of the NP's words)
    GROOViST = mean over the story's NPs       (unbounded; tanh → [-1, 1])

Quirks kept for parity: NPs are de-duplicated across the story and pronouns
dropped before scoring; the concreteness weight is the mean 1–5 rating of the
NP's words (1 when no word is rated), so scores are not bounded by 2.5.
The paper's pseudo-code starts each NP's max at 0.0; the authors' code does
not (a negative best cosine stays negative) — storyrl follows the code.
A story whose scoring fails gets 0.0 in the authors' tool; storyrl returns
NaN unless ``on_failure="zero"``.

Ablations (paper Table 2/3): ``weighting="none"`` (−C), ``penalty=False``
(−P), ``weighting="idf"`` (−C +idf; word idf from a story corpus, averaged
over the NP's words), ``units="nouns"`` (−NPs +Ns).

Region pixels come from the ``fast`` image pipeline by default (decoding in
worker processes, crops as tensor slices, resizing and normalising on the
model's device); ``image_pipeline="exact"`` is PIL and CLIP's transform per
crop, as the authors compute them. Scores differ by at most 1.2e-4 (measured
on the authors' VWP/VIST frames and stories, ViT-B/32 architecture), 100x
below the smallest GROOViST gap between two systems in the authors' tables
(0.012): see :mod:`storyrl.rewards.clip_base` and benchmarks/README.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards.clip_base import ClipConfig, ClipReward
from storyrl.rewards.region_base import RegionConfig

#: θ per dataset: the mean NP score (2.5 · best cosine) over the dataset's
#: stories with CLIP ViT-B/32 and detector regions (authors' thresholds.ini).
THETA_PRESETS = {
    "vist": 0.6159241924121119,
    "aesop": 0.5949957337433985,
    "vwp": 0.6193549522736276,
    "custom": 0.5,
}
SCALE = 2.5
UNITS = ("noun_phrases", "nouns")
WEIGHTINGS = ("concreteness", "idf", "none")


def resolve_theta(theta: float | str) -> float:
    """A number, or a preset name (vist, aesop, vwp, custom)."""
    if isinstance(theta, str):
        if theta.lower() in THETA_PRESETS:
            return THETA_PRESETS[theta.lower()]
        try:
            theta = float(theta)
        except ValueError:
            raise ValueError(f"unknown theta preset {theta!r}; presets: {', '.join(THETA_PRESETS)}") from None
    theta = float(theta)
    if not math.isfinite(theta):
        raise ValueError(f"theta must be finite, got {theta}")
    return theta


def groovist_phrase_scores(
    max_cos: np.ndarray, weights: np.ndarray, theta: float, penalize: bool = True, scale: float = SCALE
) -> np.ndarray:
    """Per-NP scores from each NP's best cosine and its weight."""
    s = scale * np.asarray(max_cos, dtype=np.float64)
    if penalize:
        s = np.where(s >= theta, s, -(theta - s))
    return s * np.asarray(weights, dtype=np.float64)


def groovist_score(
    max_cos: np.ndarray, weights: np.ndarray, theta: float, penalize: bool = True, bounded: bool = False
) -> float:
    """GROOViST of one story from its NPs' best cosines and weights (NaN
    without NPs)."""
    scores = groovist_phrase_scores(max_cos, weights, theta, penalize)
    if not len(scores):
        return math.nan
    value = float(scores.mean())
    return math.tanh(value) if bounded else value


@dataclass
class PhraseScore:
    """One NP of a story, for inspection (``--explain``)."""

    phrase: str
    weight: float
    cosine: float
    score: float
    image_index: int
    region: str


@dataclass
class StoryAnalysis:
    score: float
    phrases: list[PhraseScore]
    reason: str | None = None  # why the story is unscorable

    def to_json(self) -> dict[str, Any]:
        return {"score": self.score, "reason": self.reason, "phrases": [asdict(p) for p in self.phrases]}


@dataclass
class GROOViSTConfig(ClipConfig, RegionConfig):
    """GROOViST's options (besides the CLIP and region options)."""

    theta: float | str = option("vist", "θ: a number or a preset (vist, aesop, vwp, custom).")
    bounded: bool = option(False, "Return tanh(score) in [-1, 1] instead of the raw score.")
    spacy_pipeline: str = option("en_core_web_trf", "spaCy pipeline for noun chunks (the authors': en_core_web_trf; "
                                 "en_core_web_sm is faster).")
    units: str = option("noun_phrases", "Scored units: noun_phrases or nouns (the -NPs +Ns ablation).", choices=UNITS)
    weighting: str = option("concreteness", "Word weights: concreteness, idf (needs idf_corpus) or none.",
                            choices=WEIGHTINGS)
    penalty: bool = option(True, "Apply the θ penalty (false: the -P ablation).")
    concreteness: str | None = option(None, "Concreteness ratings file (default: storyrl asset cache).", path="file")
    pronouns: str | None = option(None, "Pronoun list file (default: storyrl asset cache).", path="file")
    idf_corpus: str | None = option(None, "Story set (JSON/JSONL) whose word document frequencies give idf weights.",
                                    path="file")
    on_failure: str = option("nan", "Score of a story without NPs or usable regions: nan, or zero (the authors' 0.0).",
                             choices=("nan", "zero"))

    def _problems(self) -> list[str]:
        problems = super()._problems()
        try:
            resolve_theta(self.theta)
        except ValueError as exc:
            problems.append(f"theta: {exc}")
        if self.weighting == "idf" and not self.idf_corpus:
            problems.append("weighting='idf' needs idf_corpus (a story set to count word document frequencies in)")
        return problems


class GROOViST(ClipReward):
    """GROOViST as a reward (higher = better grounded).

    Story context: ``images`` (paths or PIL images, one per position) or
    ``image_ids`` (resolved against ``image_root``); optionally
    ``noun_phrases`` (per story, the authors' NP file format) to skip spaCy.
    Options: :class:`GROOViSTConfig`.
    """

    name = "groovist"
    higher_is_better = True
    config_class = GROOViSTConfig
    #: Record fields that carry the scored units, so that spaCy is not needed.
    text_unit_fields = ("noun_phrases",)

    def __init__(self, config: GROOViSTConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        self.theta = resolve_theta(self.args.theta)  # the number; args.theta keeps the setting (a preset name)
        self.value_range = (-1.0, 1.0) if self.bounded else (-math.inf, math.inf)
        self._extractor = self._weights = self._pronoun_set = None
        #: Set when every story comes with its noun phrases (storyrl score
        #: --noun-phrases): setup() then does not require the spaCy pipeline.
        self.text_units_given = False

    def setup(self) -> GROOViST:
        """Check the spaCy pipeline is installed (unless the noun phrases are
        given), then load the models."""
        from storyrl.noun_phrases import check_reward_pipeline

        check_reward_pipeline(self, "the noun phrases precomputed: --noun-phrases or records' noun_phrases")
        return super().setup()

    def __getstate__(self) -> dict[str, Any]:
        # spaCy pipelines and word tables are rebuilt on demand after unpickling.
        state = dict(self.__dict__)
        state["_extractor"] = state["_weights"] = state["_pronoun_set"] = None
        return state

    # -- lazily built text side ------------------------------------------------
    @property
    def extractor(self):
        if self._extractor is None:
            from storyrl.noun_phrases import PhraseExtractor

            self._extractor = PhraseExtractor(self.spacy_pipeline, units=self.units)
        return self._extractor

    @property
    def word_weights(self):
        if self._weights is None:
            from storyrl import word_weights

            if self.weighting == "concreteness":
                self._weights = word_weights.Concreteness.from_path(self.concreteness)
            elif self.weighting == "idf":
                self._weights = word_weights.load_idf(self.idf_corpus)
            else:
                self._weights = word_weights.NoWeights()
        return self._weights

    @property
    def pronoun_set(self) -> frozenset[str]:
        if self._pronoun_set is None:
            from storyrl.noun_phrases import load_pronouns

            self._pronoun_set = load_pronouns(self.pronouns)
        return self._pronoun_set

    # -- scoring -----------------------------------------------------------------
    def analyse(
        self, stories: list[str], images=None, image_ids=None, noun_phrases=None, **_: Any
    ) -> list[StoryAnalysis]:
        """Score stories and keep every NP's best cosine, weight, score and
        best region. Unscorable stories carry a ``reason``."""
        from storyrl.noun_phrases import scoring_phrases

        n = len(stories)
        raw = noun_phrases if noun_phrases is not None else self.extractor.extract(list(stories))
        phrases = [scoring_phrases(list(p or ()), self.pronoun_set) for p in raw]
        reasons: list[str | None] = [None if p else "no noun phrases" for p in phrases]
        story_regions, region_embs = self._embedded_regions(reasons, images, image_ids, self.region_source)
        todo = [i for i in range(n) if reasons[i] is None]
        unique = list(dict.fromkeys(p for i in todo for p in phrases[i]))
        text_embs = self.embedder.embed_texts(unique)
        row = {p: k for k, p in enumerate(unique)}

        out = []
        for i in range(n):
            if reasons[i] is not None:
                out.append(StoryAnalysis(math.nan, [], reasons[i]))
                continue
            cos = text_embs[[row[p] for p in phrases[i]]].astype(np.float64) @ region_embs[i].T.astype(np.float64)
            best = cos.argmax(axis=1)
            max_cos = cos[np.arange(len(best)), best]
            weights = np.asarray(self.word_weights.weights(phrases[i]), dtype=np.float64)
            # The story score comes from groovist_score, the tested formula, so the
            # reward cannot drift from it; the per-NP scores (for --explain) are
            # the same groovist_phrase_scores that groovist_score averages.
            value = groovist_score(max_cos, weights, self.theta, self.penalty, self.bounded)
            scores = groovist_phrase_scores(max_cos, weights, self.theta, self.penalty)
            regs = story_regions[i]
            out.append(
                StoryAnalysis(
                    value,
                    [
                        PhraseScore(p, float(w), float(c), float(s), regs[b].image_index, regs[b].label)
                        for p, w, c, s, b in zip(phrases[i], weights, max_cos, scores, best)
                    ],
                )
            )
        return out

    def _score_batch(self, stories: list[str], **context: Any) -> np.ndarray:
        return self._scores_from(self.analyse(stories, **context), 0.0 if self.on_failure == "zero" else None)

    def explain(self, stories: list[str], **context: Any) -> list[dict[str, Any]]:
        """Per-story score, reason and per-NP details as JSON-ready dicts."""
        return [a.to_json() for a in self.analyse(list(stories), **context)]


def calibrate_theta(
    reward: GROOViST, stories: list[str], batch_size: int = 64, progress=None, **context: Any
) -> dict[str, Any]:
    """θ for a dataset as the authors define it: the mean NP score
    (2.5 · best cosine, before penalty and weighting) over all scored NPs of
    all stories. ``progress(n)`` is called after each batch of n stories.
    Returns ``{"theta", "n_phrases", "n_stories", "n_unscorable"}``."""
    from storyrl.rewards.base import take_column

    total, n_phrases, n_bad = 0.0, 0, 0
    n = len(stories)
    for start in range(0, n, batch_size):
        index = list(range(start, min(n, start + batch_size)))
        sub = {k: take_column(k, v, index, n) for k, v in context.items() if v is not None}
        for result in reward.analyse([stories[i] for i in index], **sub):
            if result.reason is not None:
                n_bad += 1
            for p in result.phrases:
                total += SCALE * p.cosine
                n_phrases += 1
        if progress is not None:
            progress(len(index))
    if not n_phrases:
        raise ValueError("no noun phrase could be scored: cannot calibrate theta")
    return {"theta": total / n_phrases, "n_phrases": n_phrases, "n_stories": n, "n_unscorable": n_bad}
