"""TAPM-style storytellers (Yu et al. 2021, "Transitional Adaptation of
Pretrained Models for Visual Storytelling"; the d_HM paper's upgrades, §5 and
App. B).

Architecture (:class:`TapmModel`, a transformers ``PreTrainedModel`` with
``generate``, ``save_pretrained``/``from_pretrained``; config
:class:`TapmConfig`, ``model_type = "storyrl_tapm"``):

* Per feature type (``image``: ResNet, with +ViT the ViT features
  concatenated; optional ``boxes``: region features) a deep encoder: Linear
  → d (the decoder's hidden size unless ``encoder_dim``), LeakyReLU, Linear,
  LeakyReLU, three residual MLP blocks.
* Neighbour pooling: for image i, a story-global token (a linear of the mean
  over the story) and one token per offset -2, -1, +1, +2 (a linear per
  direction of that image's mean token, zero past the story's ends), then the
  image's own tokens; projected to the decoder width.
* Visual prefix before each sentence: ``[cls] image tokens [sep] box tokens
  [sep]``, then the sentence's start token (BOS, or EOS for GPT-2). One
  sentence per image, greedy, at most 30 new tokens; the story is the
  sentences joined.
* Decoders: GPT-2 small (default), LLaMA-2-7B in 4 bit (bitsandbytes NF4) with
  LoRA r=8, α=8 on q/k/v/o_proj (peft), any causal LM (AutoModelForCausalLM).

Training (:mod:`storyrl.training.storyteller.tapm`): adaptation (decoder frozen; margin-1
hinge between the L2-normalised decoder state at each sentence's start token,
detached, and the image's pooled visual encoding, against the story's other
images, both directions; plus the same hinge between each direction-projected
encoding and the neighbouring sentence's state), then downstream
cross-entropy. Features come from ``storyrl features``
(:mod:`storyrl.generators.tapm.features`).

Deviations from the authors: [cls]/[sep] are learned embeddings of the
visual encoder rather than new vocabulary entries (the decoder's vocabulary
stays untouched, which a frozen or 4-bit decoder needs); dropout (0.5) is on
the visual prefix rather than on the decoder's output; box features are the
image backbone's features of region crops (zero-padded to ``max_boxes``, not
masked) rather than Faster R-CNN class scores; the 4,000 AdamW warm-up
steps restart in each of the two stages (two ``fit`` runs); stories shorter than the longest in a batch are masked in the
neighbour pooling (the authors roll over a fixed group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storyrl.config import option
from storyrl.generators.base import Generator, GeneratorConfig
from storyrl.models.runtime import PRECISIONS

__all__ = ["TapmConfig", "TapmGenerator", "TapmGeneratorConfig", "TapmModel"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the generator registry must not import torch/transformers.
    if name == "TapmModel":
        from storyrl.generators.tapm.model import TapmModel

        return TapmModel
    if name == "TapmConfig":
        from storyrl.generators.tapm.config import TapmConfig

        return TapmConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(kw_only=True)
class TapmGeneratorConfig(GeneratorConfig):
    """Options of :class:`TapmGenerator`."""

    model: str = option(help="A trained TAPM directory (storyrl train tapm: OUTPUT_DIR/best).", path="dir")
    features: str | None = option(None, "Feature directory from `storyrl features` (default: compute them "
                                  "from the records' images with the model's backbones).", path="dir")
    image_root: str | None = option(None, "Directory that image ids resolve against (on-the-fly features).",
                                    path="dir")
    max_new_tokens: int = option(30, "Token limit of each sentence.", min=1)
    device: str | None = option(None, "torch device (default: CUDA when available).")
    precision: str = option("auto", "Weights' precision (auto: fp16 on CUDA, fp32 on CPU).", choices=PRECISIONS)


class TapmGenerator(Generator):
    """One greedy sentence per image from a trained TAPM model, joined into a story."""

    name = "tapm"
    config_class = TapmGeneratorConfig

    def _setup(self) -> None:
        if getattr(self, "_model", None) is not None:
            return
        from transformers import AutoTokenizer

        from storyrl.generators.tapm.features import FeatureExtractor, FeatureStore
        from storyrl.generators.tapm.model import TapmModel
        from storyrl.models.runtime import resolve_device, resolve_dtype

        device = resolve_device(self.args.device)
        dtype = resolve_dtype(self.args.precision, device)
        model = TapmModel.from_pretrained(self.args.model, dtype=dtype)
        if model.config.quantization is None:
            model.to(device)
        self._tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        if self.args.features is not None:
            self._store, self._extractor = FeatureStore(self.args.features), None
            if self._store.types != {t: {"dim": model.config.feature_dims[t], "tokens": model.config.feature_tokens[t]}
                                     for t in model.config.feature_dims}:
                raise ValueError(f"{self.args.features}: features {self._store.types} do not match the model's "
                                 f"{model.config.feature_dims}")
        else:
            backbones = model.config.backbones
            if not backbones.get("backbone"):
                raise ValueError(f"{self.args.model}: the model does not name its feature backbones; give features")
            if "boxes" in model.config.feature_dims:
                raise ValueError(f"{self.args.model}: the model uses region features; give features "
                                 "(storyrl features --region-table ...)")
            self._store = None
            self._extractor = FeatureExtractor(backbones["backbone"], vit=backbones.get("vit"),
                                               pretrained=backbones.get("pretrained", True), device=device,
                                               image_pipeline=backbones.get("image_pipeline", "exact"))
        self._model = model

    def _features(self, records) -> tuple[dict, Any]:
        from storyrl.generators.tapm.features import image_keys, pad_story_features

        per_story = []
        for record in records:
            keys = image_keys(record)
            if self._store is not None:
                per_story.append(self._store.get(keys, where=f" (story {record.story_id!r})"))
            else:
                from storyrl.images import resolve_images

                sources = resolve_images(record.images, record.image_ids, self.args.image_root)
                per_story.append(self._extractor(sources, keys))
        return pad_story_features(per_story)

    def _generate_batch(self, records) -> list[str]:
        self._setup()
        features, mask = self._features(records)
        tokens = self._model.generate_sentences(features, mask, max_new_tokens=self.args.max_new_tokens)
        stories = []
        for sentences in tokens:
            texts = [self._tokenizer.decode(s, skip_special_tokens=True).strip() for s in sentences]
            story = " ".join(t for t in texts if t)
            # An empty story is a failure with its reason, not a story: Generator.generate
            # records an exception in a record's place as that record's failure.
            stories.append(story or ValueError(f"empty story: the model generated no text for any of its "
                                               f"{len(sentences)} images (max_new_tokens={self.args.max_new_tokens})"))
        return stories
