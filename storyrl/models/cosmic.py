"""COSMiC Vanilla (Inan et al. 2021, §4.2): a coherence-aware learned caption
metric ``s = M(I, g, r, g_c, r_c)``.

- image: a frozen image tower's global (average-pooled) vector → ``Linear_1``
  → 512 (Eq. 3). The paper used Keras ResNet50V2 (ImageNet). Default here:
  timm ``resnetv2_50.a1h_in1k``, the same pre-activation ResNet-50 v2
  architecture trained on ImageNet-1k, pooled output 2048-d as Keras'
  (``resnetv2_50x1_bit`` is the BiT variant: group norm, weight standardisation,
  ImageNet-21k, so further away). Any timm model (``image_library="timm"``) or
  any open_clip model (``"open_clip"``, its ``encode_image``) can be used.
- texts: the [CLS] vector (last hidden state at position 0) of a frozen
  transformers encoder, default ``bert-large-uncased`` (1024-d) for the
  candidate g and the reference r, each → the SAME ``Linear_2`` → 512 (Eq. 4).
- labels: one-hot coherence labels of g and r → the same ``Linear_3`` → 512
  (Eq. 5). The paper's one-hot has the four labels Meta, Visible, Subjective,
  Story (:data:`DEFAULT_LABELS`); the label list is part of the saved model.
- concat (2560) → MLP 512, 256, 128, 64, 32, 16, 8 with ReLU → ``Linear_4`` → s
  (Eq. 6), no output activation. With the default dimensions this head has
  3,062,913 parameters, the paper's count of trainable parameters.

``use_image=False`` / ``use_labels=False`` drop e_I / (e_gc, e_rc) from the
concatenation: the ablations of the paper's Table 2.

Encoders are frozen and their embeddings cached per image (path, or pixel
hash of an in-memory image) and per text, in memory (:class:`CosmicEncoders`,
one per process and encoder setting via :func:`cosmic_encoders`); only the
head (:class:`CosmicHead`) trains. A saved model is a directory with
``storyrl_cosmic.json`` (head settings + the encoders' names) and
``model.safetensors`` (head weights only).

Images reach the tower through either image pipeline (issue 32, as for the
CLIP rewards): ``exact`` (PIL and the tower's own transform) or ``fast``
(:mod:`storyrl.images.tensor_preprocess`); their vectors differ by
resampling round-off and are cached apart.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from storyrl.models.caches import LruDict, pipeline_key
from storyrl.models.runtime import (
    check_finite,
    check_runs,
    resolve_device,
    resolve_dtype,
    resolve_precision,
    shared_model,
)

log = logging.getLogger(__name__)

DEFAULT_LABELS = ("Meta", "Visible", "Subjective", "Story")
DEFAULT_IMAGE_MODEL = "resnetv2_50.a1h_in1k"
DEFAULT_TEXT_MODEL = "bert-large-uncased"
HIDDEN = (512, 256, 128, 64, 32, 16, 8)
EMBED = 512
IMAGE_LIBRARIES = ("timm", "open_clip")
_CONFIG_FILE = "storyrl_cosmic.json"
_WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class EncoderSpec:
    """Which frozen encoders feed the head. ``image_pretrained``: for timm
    "default" (the model's hub weights), a local weights file, or None
    (random, seeded 0); for open_clip a pretrained tag, a file, or None.
    ``image_kwargs``: extra ``timm.create_model`` arguments as (key, value)
    pairs (hashable: the spec keys the process-wide encoder cache)."""

    image_library: str = "timm"
    image_model: str = DEFAULT_IMAGE_MODEL
    image_pretrained: str | None = "default"
    image_kwargs: tuple = ()
    text_model: str = DEFAULT_TEXT_MODEL
    max_length: int = 512

    def __post_init__(self) -> None:
        if self.image_library not in IMAGE_LIBRARIES:
            raise ValueError(f"image_library must be one of {IMAGE_LIBRARIES}, got {self.image_library!r}")
        if isinstance(self.image_kwargs, dict):
            object.__setattr__(self, "image_kwargs", tuple(sorted(self.image_kwargs.items())))
        # JSON gives lists; timm wants tuples and the spec must hash.
        object.__setattr__(
            self, "image_kwargs", tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in self.image_kwargs)
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["image_kwargs"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.image_kwargs}
        return out


class CosmicEncoders:
    """The frozen image tower and text encoder with their embedding caches.
    ``stats`` counts the images and texts actually run through a model."""

    def __init__(self, spec: EncoderSpec, device=None, precision: str = "auto", batch_size: int = 32,
                 max_cached: int = 200_000) -> None:
        self.spec = spec
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype = resolve_dtype(precision, self.device)
        self.batch_size = batch_size
        require_encoders(spec)
        # Both towers are cast whole to self.dtype, and so are their pixel inputs.
        self._load_image_tower()
        self._load_text_encoder()
        for model in (self.image_model, self.text_model):
            model.eval().requires_grad_(False)
        check_runs(self._probe, f"COSMiC encoders ({spec.image_model}, {spec.text_model})", self.precision,
                   self.device)
        self.images = LruDict(max_cached)
        self.texts = LruDict(max_cached)
        self.stats = {"images_embedded": 0, "texts_embedded": 0}
        self._lock = threading.Lock()

    def _load_image_tower(self) -> None:
        spec = self.spec
        if spec.image_library == "open_clip":
            import open_clip

            model, _, preprocess = open_clip.create_model_and_transforms(
                spec.image_model, pretrained=spec.image_pretrained, device=self.device
            )
            self.image_model, self.preprocess = model.to(self.dtype), preprocess
            self._image_forward = model.encode_image
            return
        import timm
        from timm.data import create_transform, resolve_data_config

        kwargs = dict(spec.image_kwargs)
        pretrained = spec.image_pretrained
        if pretrained not in (None, "default"):
            kwargs["pretrained_cfg_overlay"] = {"file": pretrained}
        if pretrained is None:
            torch.manual_seed(0)  # reproducible random tower (tests, ablations)
        # num_classes=0: the pooled pre-logits vector, AveragePool(ResNet(I)) of Eq. 3.
        model = timm.create_model(spec.image_model, pretrained=pretrained is not None, num_classes=0, **kwargs)
        self.image_model = model.to(self.device, self.dtype)
        self.preprocess = create_transform(**resolve_data_config({}, model=model))
        self._image_forward = model

    def _load_text_encoder(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.text_model)
        self.text_model = AutoModel.from_pretrained(self.spec.text_model).to(self.device, self.dtype)

    def _probe(self):
        """One blank image and one text through the towers (no cache, no stats)."""
        from PIL import Image

        image = self._encode_images([Image.new("RGB", (32, 32))])
        self._image_dim = int(image.shape[1])
        text = self._encode_texts(["a photo"])
        return torch.from_numpy(np.concatenate([image.ravel(), text.ravel()]))

    # -- dimensions -------------------------------------------------------------
    @property
    def text_dim(self) -> int:
        return int(self.text_model.config.hidden_size)

    @property
    def image_dim(self) -> int:
        if not hasattr(self, "_image_dim"):
            from PIL import Image

            probe = Image.new("RGB", (32, 32))
            self._image_dim = int(self._encode_images([probe]).shape[1])
        return self._image_dim

    # -- embeddings ---------------------------------------------------------------
    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """``[len(texts), text_dim]`` float32 [CLS] vectors, each text run once."""
        with self._lock:
            vecs, encoded = self.texts.fetch({t: t for t in texts}, self._encode_texts, self.batch_size)
            self.stats["texts_embedded"] += encoded
            if not texts:
                return np.zeros((0, self.text_dim), np.float32)
            return np.stack([vecs[t] for t in texts])

    def _encode_texts(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.spec.max_length,
                               return_tensors="pt").to(self.device)
        with torch.inference_mode():
            hidden = self.text_model(**batch).last_hidden_state[:, 0].float()
        check_finite(hidden, f"COSMiC text encoder {self.spec.text_model}", self.precision)
        return hidden.cpu().numpy()

    def embed_images(self, sources: Sequence[Any], pipeline: str = "exact") -> np.ndarray:
        """``[len(sources), image_dim]`` float32 for file paths or PIL images,
        each image run once (raises storyrl.images.ImageError when one cannot
        be read). ``pipeline``: "exact" (PIL and the tower's transform) or
        "fast" (worker-process decoding, tensor preprocessing); cached apart."""
        from storyrl.images import Region, load_regions

        key = pipeline_key(pipeline)
        fast = pipeline == "fast" and self.fast_spec is not None
        regions = [Region(s) for s in sources]
        with self._lock:
            vecs, encoded = self.images.fetch(
                {key(r): r for r in regions}, lambda chunk: self._encode_images(load_regions(chunk)), self.batch_size,
                batches=self._fast_batches if fast else None)
            self.stats["images_embedded"] += encoded
        if not regions:
            return np.zeros((0, self.image_dim), np.float32)
        return np.stack([vecs[key(r)] for r in regions])

    def _fast_batches(self, todo: list):
        from storyrl.images.tensor_preprocess import encoded_batches

        # The towers are cast whole to self.dtype: the pixels come in it.
        return encoded_batches(todo, self.fast_spec, self.device, self.dtype, self.batch_size, self._encode_images)

    @property
    def fast_spec(self):
        """What the fast pipeline reproduces of the tower's transform (None:
        it cannot, and the exact pipeline is used, said once)."""
        if not hasattr(self, "_fast_spec"):
            from storyrl.images.tensor_preprocess import reproducible_spec

            self._fast_spec = reproducible_spec(self.preprocess, f"COSMiC image tower {self.spec.image_model!r}", log)
        return self._fast_spec

    def _encode_images(self, images) -> np.ndarray:
        """One forward pass: PIL images (preprocessed here) or a ready pixel batch (the fast pipeline's)."""
        if isinstance(images, torch.Tensor):
            pixels = images
        else:
            pixels = torch.stack([self.preprocess(im) for im in images]).to(self.device, self.dtype)
        with torch.inference_mode():
            feats = self._image_forward(pixels).float()
        check_finite(feats, f"COSMiC image tower {self.spec.image_model}", self.precision)
        return feats.reshape(len(images), -1).cpu().numpy()


def require_encoders(spec: EncoderSpec, image_hint: str = "set image_pretrained to a local weights file",
                     text_hint: str = "set text_model to a local copy's directory") -> None:
    """HubUnreachableError, before anything loads, when an encoder of ``spec``
    must come from an unreachable hub; the hints say what to set instead."""
    from storyrl.models.hub import open_clip_hub_id, require_hub_model, timm_hub_id

    if spec.image_library == "open_clip":
        hub_id = open_clip_hub_id(spec.image_model, spec.image_pretrained)
    else:  # timm reads the hub only for its default weights (a file is an overlay)
        hub_id = timm_hub_id(spec.image_model) if spec.image_pretrained == "default" else None
    if hub_id:
        require_hub_model(hub_id, what=f"COSMiC image tower {spec.image_model!r} (weights)", hint=image_hint)
    require_hub_model(spec.text_model, what="COSMiC text model", hint=text_hint)


def cosmic_encoders(spec: EncoderSpec, device=None, precision: str = "auto", batch_size: int = 32) -> CosmicEncoders:
    """The process-wide :class:`CosmicEncoders` for ``spec`` on a device and
    precision (training and the reward in one process share the caches)."""
    dev = resolve_device(device)
    key = ("cosmic-encoders", spec, str(dev), resolve_precision(precision, dev))
    encoders = shared_model(key, lambda: CosmicEncoders(spec, dev, precision, batch_size))
    encoders.batch_size = batch_size
    return encoders


@dataclass
class HeadConfig:
    image_dim: int
    text_dim: int
    labels: tuple = DEFAULT_LABELS
    hidden: tuple = HIDDEN
    use_image: bool = True
    use_labels: bool = True
    encoders: EncoderSpec = field(default_factory=EncoderSpec)


class CosmicHead(nn.Module):
    """Linear_1..3, the MLP and Linear_4 of Eqs. 3-6 (the trainable part)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.labels = tuple(config.labels)
        self.image_proj = nn.Linear(config.image_dim, EMBED)
        self.text_proj = nn.Linear(config.text_dim, EMBED)
        self.label_proj = nn.Linear(len(self.labels), EMBED)
        width = EMBED * (2 + int(config.use_image) + 2 * int(config.use_labels))
        layers: list[nn.Module] = []
        for size in config.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(width, 1)

    def label_index(self, label: str) -> int:
        try:
            return self.labels.index(label)
        except ValueError:
            raise ValueError(f"coherence label {label!r} is not one of the model's {list(self.labels)}") from None

    def forward(self, image, candidate, reference, candidate_label, reference_label) -> torch.Tensor:
        """Scores ``[B]`` from embeddings ``[B, d]`` and label indices ``[B]``."""
        parts = [self.text_proj(candidate), self.text_proj(reference)]
        if self.config.use_image:
            parts.insert(0, self.image_proj(image))
        if self.config.use_labels:
            n = len(self.labels)
            dtype = parts[0].dtype
            parts += [
                self.label_proj(nn.functional.one_hot(candidate_label, n).to(dtype)),
                self.label_proj(nn.functional.one_hot(reference_label, n).to(dtype)),
            ]
        return self.out(self.mlp(torch.cat(parts, dim=-1))).squeeze(-1)

    # -- storage -------------------------------------------------------------------
    def save_pretrained(self, directory) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        c = self.config
        meta = {"format": "storyrl-cosmic", "version": 1, "image_dim": c.image_dim, "text_dim": c.text_dim,
                "labels": list(c.labels), "hidden": list(c.hidden), "use_image": c.use_image,
                "use_labels": c.use_labels, "encoders": c.encoders.to_dict()}
        (directory / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(directory / _WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, directory) -> CosmicHead:
        from safetensors.torch import load_file

        directory = Path(directory)
        meta_path = directory / _CONFIG_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{directory}: not a storyrl COSMiC model (no {_CONFIG_FILE}; storyrl train cosmic)")
        meta = json.loads(meta_path.read_text())
        config = HeadConfig(
            image_dim=meta["image_dim"], text_dim=meta["text_dim"], labels=tuple(meta["labels"]),
            hidden=tuple(meta["hidden"]), use_image=meta["use_image"], use_labels=meta["use_labels"],
            encoders=EncoderSpec(**meta["encoders"]),
        )
        head = cls(config)
        head.load_state_dict(load_file(str(directory / _WEIGHTS_FILE)))
        return head.eval()


@dataclass(frozen=True)
class CosmicExample:
    """One input of the metric: an image (path or PIL), candidate and
    reference texts and their coherence labels."""

    image: Any
    candidate: str
    reference: str
    candidate_label: str
    reference_label: str


class CosmicScorer:
    """A trained head with its (shared) encoders: ``score(examples)``."""

    def __init__(self, head: CosmicHead, encoders: CosmicEncoders) -> None:
        self.head = head.to(encoders.device).eval()
        self.encoders = encoders

    def embed(self, examples: Sequence[CosmicExample], image_pipeline: str = "exact") -> dict[str, torch.Tensor]:
        """The head's input tensors (embeddings from the caches; images by ``image_pipeline``)."""
        enc, head = self.encoders, self.head
        texts = enc.embed_texts([e.candidate for e in examples] + [e.reference for e in examples])
        n = len(examples)
        image = (enc.embed_images([e.image for e in examples], image_pipeline) if head.config.use_image
                 else np.zeros((n, head.config.image_dim), np.float32))
        return {
            "image": torch.from_numpy(image),
            "candidate": torch.from_numpy(texts[:n]),
            "reference": torch.from_numpy(texts[n:]),
            "candidate_label": torch.tensor([head.label_index(e.candidate_label) for e in examples], dtype=torch.long),
            "reference_label": torch.tensor([head.label_index(e.reference_label) for e in examples], dtype=torch.long),
        }

    def score(self, examples: Sequence[CosmicExample], image_pipeline: str = "exact") -> np.ndarray:
        if not examples:
            return np.zeros(0)
        batch = {k: v.to(self.encoders.device) for k, v in self.embed(examples, image_pipeline).items()}
        with torch.inference_mode():
            return self.head(**batch).double().cpu().numpy()


def load_cosmic(model: str, device=None, precision: str = "auto", batch_size: int = 32) -> CosmicScorer:
    """The process-wide scorer of a saved COSMiC directory. The head runs in
    fp32 (it is small); ``precision`` applies to the encoders."""
    dev = resolve_device(device)
    spec = read_encoder_spec(model)
    where = Path(model) / _CONFIG_FILE
    require_encoders(spec, f"{where} names it: set its encoders.image_pretrained to a local weights file",
                     f"{where} names it: set its encoders.text_model to a local copy's directory")
    # shared_model's lock is not re-entrant: the encoders are fetched first,
    # named by the directory's config, not from inside the scorer's loader.
    encoders = cosmic_encoders(spec, dev, precision, batch_size)
    key = ("cosmic", str(Path(model).resolve()), str(dev), resolve_precision(precision, dev))
    return shared_model(key, lambda: CosmicScorer(CosmicHead.from_pretrained(model), encoders))


def read_encoder_spec(directory) -> EncoderSpec:
    """The encoders a saved COSMiC directory names."""
    meta_path = Path(directory) / _CONFIG_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory}: not a storyrl COSMiC model (no {_CONFIG_FILE}; storyrl train cosmic)")
    return EncoderSpec(**json.loads(meta_path.read_text())["encoders"])
