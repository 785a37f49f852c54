"""COSMiC (Inan et al. 2021) as a story reward: a coherence-aware learned
caption metric applied sentence by sentence.

Sentence i of the story (storyrl's NLTK-compatible splitter) is the candidate
caption of image i, with coherence label ``candidate_label`` (default Story:
story sentences narrate, the paper's *Story* relation). The reference
caption is sentence i of the sample's ``reference`` story (context
``reference``: per story a string, split into sentences, or a list of
strings, one per image), labelled ``reference_label`` (default Story too:
VIST's human stories are the usual references; the paper's own test used
Visible COIN captions, so set ``reference_label: Visible`` for descriptive
references). Story score = mean over the sentence scores (the model's
output: trained on ratings in [0, 1], not clipped).

Unscorable stories (NaN, counted by reason):

- images missing or unreadable (``images``/``image_ids`` context as for the
  other image rewards, relative paths resolved against ``image_root``);
- sentence count ≠ image count (``count_mismatch: nan``, default: the metric
  is defined per image–caption pair, and guessing an alignment would score
  pairs the writer never meant); ``count_mismatch: min`` scores the first
  min(sentences, images) pairs instead (a story can then gain by saying less);
- the reference's sentence count ≠ the image count (same option: ``min``
  pairs up to the shortest of the three);
- no reference (``missing_reference: nan``, default: the metric needs one);
  ``missing_reference: self`` uses each sentence as its own reference with
  the candidate's label, a reference-free reading the paper does not have.

The model is a directory written by ``storyrl train cosmic``
(:mod:`storyrl.models.cosmic`), loaded once per process; the reward object
holds settings only (picklable). ``image_pipeline`` takes the CLIP rewards'
values and default: ``fast`` (worker-process decoding, tensor
preprocessing) or ``exact`` (PIL and the tower's transform); the image
vectors differ by resampling round-off and are cached apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.models.clip import IMAGE_PIPELINES
from storyrl.rewards.base import Reward, clean_text
from storyrl.rewards.clip_base import ClipConfig
from storyrl.rewards.region_base import ImageConfig

LABELS = ("Meta", "Visible", "Subjective", "Story", "Action")


@dataclass
class COSMiCConfig(ImageConfig):
    model: str | None = option(None, "A storyrl COSMiC directory (storyrl train cosmic ... -> OUTPUT_DIR/best).",
                               path="dir")
    candidate_label: str = option("Story", "Coherence label of the story's sentences.", choices=LABELS)
    reference_label: str = option("Story", "Coherence label of the reference's sentences.", choices=LABELS)
    count_mismatch: str = option("nan", "Sentence and image (or reference sentence) counts differ: nan, or score "
                                 "the first min(...) pairs.", choices=("nan", "min"))
    missing_reference: str = option("nan", "No reference: nan, or each sentence is its own reference.",
                                    choices=("nan", "self"))
    batch_size: int = option(32, "Images / texts per encoder forward pass.", min=1)
    # The CLIP rewards' default, so that one setting reads the same everywhere.
    image_pipeline: str = option(
        ClipConfig.image_pipeline, "How image pixels are made: fast (decoding in worker processes, resizing and "
        "normalising as tensors on the model's device) or exact (PIL and the image tower's transform).",
        choices=IMAGE_PIPELINES)


class COSMiC(Reward):
    """Mean COSMiC score of (image i, sentence i, reference sentence i).
    Options: :class:`COSMiCConfig`."""

    name = "cosmic"
    higher_is_better = True
    config_class = COSMiCConfig

    def _scorer(self):
        from storyrl.models.cosmic import load_cosmic

        if self.model is None:
            raise ValueError("cosmic needs a trained model: model=<storyrl COSMiC directory> (storyrl train cosmic)")
        return load_cosmic(self.model, self.device, self.precision, self.batch_size)

    def _setup(self) -> None:
        scorer = self._scorer()
        for label in (self.candidate_label, self.reference_label):
            scorer.head.label_index(label)  # a label the model lacks is the reward's error, not a story's

    def prepare(self, context, progress: bool = False) -> dict[str, int]:
        """Embed every row's images with the frozen image tower (in memory:
        COSMiC has no disk cache), ``batch_size`` images per forward; a no-op
        for a model without the image input."""
        from storyrl.console import progress as progress_bar
        from storyrl.images import ImageError, resolve_images
        from storyrl.rewards.base import column_length, story_context

        context = story_context(context)
        images, image_ids = context.get("images"), context.get("image_ids")
        n = column_length(context)
        if (images is None and image_ids is None) or not n:
            return {}
        self.setup()
        scorer = self._scorer()
        if not scorer.head.config.use_image:
            return {}
        encoders = scorer.encoders
        before = encoders.stats["images_embedded"]
        counts = {"sequences": 0, "images": 0, "failed": 0}
        seen: set = set()
        chunk: list[list] = []

        def flush() -> None:
            try:
                encoders.embed_images([s for seq in chunk for s in seq], self.image_pipeline)
            except ImageError:  # the unreadable sequence is scoring's to report
                for seq in chunk:
                    try:
                        encoders.embed_images(seq, self.image_pipeline)
                    except ImageError:
                        counts["failed"] += 1
            chunk.clear()

        bar = progress_bar(total=n, desc=f"{self.name}: embedding images", unit="seq", disable=not progress)
        try:
            for i in range(n):
                bar.update(1)
                try:
                    seq = resolve_images(images=images[i] if images is not None else None,
                                         image_ids=image_ids[i] if image_ids is not None else None,
                                         image_root=self.image_root)
                except ImageError:
                    counts["failed"] += 1
                    continue
                new = [s for s in seq if not isinstance(s, str) or s not in seen]
                seen.update(s for s in new if isinstance(s, str))
                if new:
                    counts["sequences"] += 1
                    counts["images"] += len(new)
                    chunk.append(new)
                if sum(map(len, chunk)) >= self.batch_size:
                    flush()
            if chunk:
                flush()
        finally:
            bar.close()
        counts["embedded"] = encoders.stats["images_embedded"] - before
        return counts

    def _pairs(self, story: str, images: list, reference) -> tuple[list, str | None]:
        """(image, sentence, reference sentence, reference label) per pair, or a reason."""
        from storyrl.text import split_sentences

        sentences = split_sentences(story)
        if not sentences:
            return [], "no sentences"
        if reference is None or (isinstance(reference, str) and not reference.strip()):
            if self.missing_reference == "nan":
                return [], "no reference"
            refs, ref_label = sentences, self.candidate_label
        else:
            # cleaned as the story is (Reward.score): a lone surrogate would break the tokenizer
            refs = (split_sentences(clean_text(reference)) if isinstance(reference, str)
                    else [clean_text(str(r)) for r in reference])
            ref_label = self.reference_label
        n = len(images)
        if (len(sentences) != n or len(refs) != n) and self.count_mismatch == "nan":
            return [], (f"count mismatch: {len(sentences)} sentences, {len(refs)} reference sentences, "
                        f"{n} images")
        k = min(len(sentences), len(refs), n)
        return [(images[j], sentences[j], refs[j], ref_label) for j in range(k)], None

    def _score_batch(self, stories: list[str], images=None, image_ids=None, reference=None, **_: Any) -> np.ndarray:
        from storyrl.images import ImageError, resolve_images
        from storyrl.models.cosmic import CosmicExample

        scorer = self._scorer()
        triples: list[list] = []
        reasons: list[str | None] = []
        for i, story in enumerate(stories):
            try:
                seq = resolve_images(images=images[i] if images is not None else None,
                                     image_ids=image_ids[i] if image_ids is not None else None,
                                     image_root=self.image_root)
            except ImageError as exc:
                triples.append([])
                reasons.append(f"images: {exc}")
                continue
            ref = reference[i] if reference is not None else None
            pairs, reason = self._pairs(story, seq, ref)
            triples.append(pairs)
            reasons.append(reason)
        if scorer.head.config.use_image:
            self._check_images(scorer, triples, reasons, self.image_pipeline)
        examples = [
            CosmicExample(img, sent, ref, self.candidate_label, ref_label)
            for i, pairs in enumerate(triples) if reasons[i] is None for img, sent, ref, ref_label in pairs
        ]
        # A model without the image input has no pixels to make.
        flat = scorer.score(examples, self.image_pipeline) if scorer.head.config.use_image else scorer.score(examples)
        out = np.full(len(stories), np.nan)
        start = 0
        for i, pairs in enumerate(triples):
            if reasons[i] is not None:
                out[i] = self._unscorable(reasons[i].split(":")[0], reasons[i])
                continue
            out[i] = float(np.mean(flat[start : start + len(pairs)])) if pairs else math.nan
            start += len(pairs)
        return out

    @staticmethod
    def _check_images(scorer, triples: list, reasons: list, pipeline: str) -> None:
        """Embed every story's images now (cached for scoring); a story with
        an unreadable image gets a reason instead."""
        from storyrl.images import ImageError

        live = [i for i, r in enumerate(reasons) if r is None]
        try:
            scorer.encoders.embed_images([p[0] for i in live for p in triples[i]], pipeline)
            return
        except ImageError:
            pass
        for i in live:
            try:
                scorer.encoders.embed_images([p[0] for p in triples[i]], pipeline)
            except ImageError as exc:
                reasons[i] = f"images: {exc}"
