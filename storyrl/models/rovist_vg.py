"""The RoViST-VG model (Wang et al., 2022) behind the ``rovist_vg`` reward,
and its process-wide embedder.

Model (RoViST paper §3.1, GROOViST paper Appendix C): an image encoder (a timm
ViT, ``vit_base_patch16_224`` as the authors, then ``Linear(768, 1024)`` and
tanh) and a text encoder (the mean 300-d GloVe vector of the noun's words,
:mod:`storyrl.models.glove`, then ``Linear(300, 1024)`` and tanh). Train it
with :mod:`storyrl.training.judges.rovist_vg`; :meth:`RovistVGModel.save_pretrained`
writes the directory the reward's ``model`` option names. How a story's score
follows from the embeddings is the metric's, in :mod:`storyrl.rewards.rovist_vg`.

Region crops are resized to the ViT input without cropping
(``crop_mode="squash"``), as the authors' ViT feature extractor does: a
centre crop would cut off part of a detected box.

Region pixels come from either image pipeline (issue 32, as for the CLIP
rewards): ``exact`` (PIL and the model's timm transform) or ``fast``
(:mod:`storyrl.images.tensor_preprocess`: decoding in worker processes,
resizing and normalising as tensors, overlapped with the forward passes).
Their vectors differ by resampling round-off and are cached apart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from storyrl.models.caches import LruDict, pipeline_key
from storyrl.models.glove import GloVe
from storyrl.models.runtime import check_finite, check_runs, resolve_device, resolve_precision, shared_model

log = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_VIT",
    "RovistVGEmbedder",
    "RovistVGModel",
    "rovist_vg_embedder",
]

DEFAULT_VIT = "vit_base_patch16_224"
CONFIG_FILE = "storyrl_rovist_vg.json"
WEIGHTS_FILE = "model.safetensors"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"  # read when safetensors is unavailable
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


# -- the model -------------------------------------------------------------------


def _default_data_config(vit) -> dict[str, Any]:
    """timm's preprocessing for ``vit``, at the size the model was built for
    (timm keeps the pretrained 224 config when ``img_size`` is overridden) and
    without cropping (see the module docstring)."""
    from timm.data import resolve_data_config

    cfg = dict(resolve_data_config({}, model=vit))
    size = getattr(getattr(vit, "patch_embed", None), "img_size", None)
    if size is not None:
        size = (size, size) if isinstance(size, int) else tuple(size)
        cfg["input_size"] = (cfg["input_size"][0], *size)
    cfg.update(crop_pct=1.0, crop_mode="squash")
    return cfg


def _as_json(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def _from_json(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}


class RovistVGModel(nn.Module):
    """The RoViST-VG encoders: ``embed_images(pixels)`` →
    ``tanh(W_i · ViT(pixels) + b_i)`` and ``embed_texts(glove_vectors)`` →
    ``tanh(W_t · vectors + b_t)``, both ``[batch, embed_dim]``, unnormalised
    (as in training)."""

    def __init__(
        self,
        vit,
        vit_name: str = DEFAULT_VIT,
        embed_dim: int = 1024,
        word_dim: int = 300,
        timm_kwargs: dict[str, Any] | None = None,
        data_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.vit = vit
        self.vit_name = vit_name
        self.embed_dim = int(embed_dim)
        self.word_dim = int(word_dim)
        self.timm_kwargs = dict(timm_kwargs or {})
        self.image_proj = nn.Linear(vit.num_features, self.embed_dim)  # W_i, b_i
        self.text_proj = nn.Linear(self.word_dim, self.embed_dim)  # W_t, b_t
        self.data_config = dict(data_config) if data_config else _default_data_config(vit)

    @classmethod
    def from_config(
        cls,
        vit_name: str = DEFAULT_VIT,
        pretrained_vit: bool = True,
        embed_dim: int = 1024,
        word_dim: int = 300,
        timm_kwargs: dict[str, Any] | None = None,
        **more_timm_kwargs: Any,
    ) -> RovistVGModel:
        """A new model: the timm ViT ``vit_name`` (ImageNet weights when
        ``pretrained_vit``, the starting point of training) with fresh
        projections. ``timm_kwargs`` and further keyword arguments go to
        ``timm.create_model`` (e.g. ``img_size``, ``depth`` for tiny test
        models, or ``pretrained_cfg_overlay={"file": ...}`` for local weights
        offline); the ViT's own width goes in ``timm_kwargs={"embed_dim": ...}``
        since ``embed_dim`` here is the joint embedding size."""
        import timm

        from storyrl.models.hub import require_hub_model, timm_hub_id

        timm_kwargs = {**(timm_kwargs or {}), **more_timm_kwargs}
        hub_id = timm_hub_id(vit_name, timm_kwargs.get("pretrained_cfg_overlay")) if pretrained_vit else None
        if hub_id:
            require_hub_model(hub_id, what=f"timm model {vit_name!r} (weights)",
                              hint="pass local weights with pretrained_cfg_overlay={'file': PATH} or build with "
                                   "pretrained_vit=False")

        try:
            vit = timm.create_model(vit_name, pretrained=pretrained_vit, num_classes=0, **timm_kwargs)
        except (RuntimeError, OSError) as exc:
            if not pretrained_vit:
                raise
            raise RuntimeError(
                f"cannot load pretrained timm model {vit_name!r}: {exc}. Offline, pass local weights with "
                "pretrained_cfg_overlay={'file': PATH} or build with pretrained_vit=False"
            ) from exc
        return cls(vit, vit_name, embed_dim, word_dim, timm_kwargs)

    def embed_images(self, pixels):
        return torch.tanh(self.image_proj(self.vit(pixels)))

    def embed_texts(self, vectors):
        return torch.tanh(self.text_proj(vectors))

    def forward(self, pixels, vectors):
        """(image embeddings, text embeddings) of matching pairs."""
        return self.embed_images(pixels), self.embed_texts(vectors)

    def image_transform(self):
        """PIL image → normalised tensor, from the saved timm data config."""
        from timm.data import create_transform

        return create_transform(**_from_json(self.data_config), is_training=False)

    # -- storage ----------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "format": "storyrl-rovist-vg",
            "version": 1,
            "vit": self.vit_name,
            "timm_kwargs": self.timm_kwargs,
            "embed_dim": self.embed_dim,
            "word_dim": self.word_dim,
            "feature_dim": int(self.image_proj.in_features),
            "data_config": _as_json(self.data_config),
        }

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``storyrl_rovist_vg.json`` (architecture, preprocessing) and
        the weights (``model.safetensors``) to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            text = json.dumps(self.config(), indent=1)
        except TypeError as exc:
            raise ValueError(f"timm_kwargs must be JSON-serialisable to save the model: {exc}") from exc
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        try:
            from safetensors.torch import save_file
        except ImportError:
            torch.save(state, directory / TORCH_WEIGHTS_FILE)
        else:
            save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(text, encoding="utf-8")  # last: marks a complete save

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> RovistVGModel:
        """A directory written by :meth:`save_pretrained` (on CPU, eval mode)."""
        directory = Path(directory)
        meta_path = directory / CONFIG_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{directory}: not a storyrl RoViST-VG model directory (no {CONFIG_FILE})")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            model = cls.from_config(
                meta["vit"], False, meta["embed_dim"], meta["word_dim"], timm_kwargs=meta.get("timm_kwargs")
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{meta_path}: malformed RoViST-VG config: {exc}") from exc
        if meta.get("data_config"):
            model.data_config = _from_json(meta["data_config"])
        if (directory / WEIGHTS_FILE).is_file():
            from safetensors.torch import load_file

            state = load_file(str(directory / WEIGHTS_FILE))
        elif (directory / TORCH_WEIGHTS_FILE).is_file():
            state = torch.load(directory / TORCH_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} (or {TORCH_WEIGHTS_FILE})")
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise ValueError(f"{directory}: weights do not fit the configured model: {exc}") from exc
        return model.eval()


# -- shared embedder --------------------------------------------------------------------


class RovistVGEmbedder:
    """L2-normalised RoViST-VG embeddings of image regions and nouns, each
    computed once per process: in-memory LRU caches keyed by region
    (:attr:`storyrl.images.Region.key`) and by (GloVe file, noun).

    Use :func:`rovist_vg_embedder` for the process-wide shared instance.
    Memory: ``max_cached`` 1024-d float32 vectors per cache (~400 MB at 100k).
    """

    def __init__(
        self, model_dir: str, device: str | None = None, precision: str = "auto", max_cached: int = 100_000
    ) -> None:
        self.model_dir = model_dir
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype = getattr(torch, _DTYPES[self.precision])
        # Cast whole (timm ViT and projections alike): inputs are cast to self.dtype.
        self.model = RovistVGModel.from_pretrained(model_dir).to(self.device, self.dtype).eval()
        self.transform = self.model.image_transform()
        check_runs(self._probe, f"RoViST-VG model {model_dir}", self.precision, self.device)
        self.regions = LruDict(max_cached)
        self.texts = LruDict(max_cached)
        self.stats = {"texts_embedded": 0, "regions_embedded": 0}
        self._lock = threading.Lock()

    def embed_regions(
        self, regions: Sequence[Any], load: Callable[[Sequence[Any]], list], batch_size: int = 64,
        pipeline: str = "exact",
    ) -> np.ndarray:
        """``[len(regions), dim]`` float32, rows L2-normalised. ``pipeline``
        "exact": ``load(regions)`` gives PIL images of the regions not cached
        yet, preprocessed by the model's timm transform; "fast": the regions
        are decoded in worker processes and preprocessed as tensors
        (``load`` is not called). The two are cached apart."""
        key = pipeline_key(pipeline)
        fast = pipeline == "fast" and self.fast_spec is not None

        with self._lock:
            vecs, encoded = self.regions.fetch(
                {key(r): r for r in regions}, lambda chunk: self._encode_images(load(chunk)), batch_size,
                batches=(lambda todo: self._fast_batches(todo, batch_size)) if fast else None)
            self.stats["regions_embedded"] += encoded
            if not regions:
                return np.zeros((0, self.model.embed_dim), np.float32)
            return np.stack([vecs[key(r)] for r in regions])

    def _fast_batches(self, todo: list, batch_size: int):
        from storyrl.images.tensor_preprocess import encoded_batches

        # Pixels in the dtype the model was cast to.
        return encoded_batches(todo, self.fast_spec, self.device, self.dtype, batch_size, self._encode_images)

    @property
    def fast_spec(self):
        """What the fast pipeline reproduces of the model's transform (None:
        it cannot, and the exact pipeline is used, said once)."""
        if not hasattr(self, "_fast_spec"):
            from storyrl.images.tensor_preprocess import reproducible_spec

            self._fast_spec = reproducible_spec(self.transform, f"RoViST-VG model {self.model_dir}", log)
        return self._fast_spec

    def embed_phrases(self, phrases: Sequence[str], glove: GloVe, batch_size: int = 64) -> np.ndarray:
        """``[len(phrases), dim]`` float32, rows L2-normalised; every phrase
        must have a GloVe vector (:meth:`GloVe.phrase_vector` not None)."""
        # Vectors of a table read by hand (not shared_glove) may differ from the
        # file's, so such tables get their own cache entries.
        source = glove.cache_key or ("glove", id(glove))
        with self._lock:
            todo = list(dict.fromkeys(p for p in phrases if self.texts.get_fresh((source, p)) is None))
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                vectors = []
                for phrase in chunk:
                    vec = glove.phrase_vector(phrase)
                    if vec is None:
                        raise ValueError(f"no GloVe vector for any word of {phrase!r}")
                    vectors.append(vec)
                for phrase, vec in zip(chunk, self._encode_vectors(np.stack(vectors))):
                    self.texts.put((source, phrase), vec)
            self.stats["texts_embedded"] += len(todo)
            if not phrases:
                return np.zeros((0, self.model.embed_dim), np.float32)
            return np.stack([self.texts[(source, p)] for p in phrases])

    def _probe(self):
        """One blank image and one word vector through the model (no cache, no stats)."""
        from PIL import Image

        images = self._encode_images([Image.new("RGB", (32, 32))])
        texts = self._encode_vectors(np.ones((1, self.model.word_dim), np.float32))
        return torch.from_numpy(np.concatenate([images, texts]))

    def _encode_images(self, images) -> np.ndarray:
        """One forward pass: PIL images (the exact pipeline's, preprocessed
        here) or a ready pixel batch (the fast one's)."""
        if isinstance(images, torch.Tensor):
            pixels = images
        else:
            # PIL resizing releases the GIL: preprocess in threads.
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                pixels = torch.stack(list(pool.map(self.transform, images)))
        with torch.inference_mode():
            emb = self.model.embed_images(pixels.to(self.device, self.dtype)).float()
            check_finite(emb, f"RoViST-VG model {self.model_dir} (images)", self.precision)
            emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()

    def _encode_vectors(self, vectors: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            emb = self.model.embed_texts(torch.from_numpy(vectors).to(self.device, self.dtype)).float()
            check_finite(emb, f"RoViST-VG model {self.model_dir} (nouns)", self.precision)
            emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()


def rovist_vg_embedder(
    model_dir: str | os.PathLike, device: str | None = None, precision: str = "auto"
) -> RovistVGEmbedder:
    """The process-wide embedder of a model directory on a device and precision
    (loaded on first use; :func:`storyrl.models.release_models` forgets it)."""
    resolved = os.path.abspath(model_dir)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    # A directory saved again (e.g. training's best/ improving) is loaded afresh.
    version = [
        (st.st_size, st.st_mtime_ns) for st in _stats(Path(resolved), (CONFIG_FILE, WEIGHTS_FILE, TORCH_WEIGHTS_FILE))
    ]
    key = ("rovist_vg", resolved, str(dev), prec, tuple(version))
    return shared_model(key, lambda: RovistVGEmbedder(resolved, str(dev), prec))


def _stats(directory: Path, names: Sequence[str]) -> list[os.stat_result]:
    out = []
    for name in names:
        try:
            out.append(os.stat(directory / name))
        except OSError:
            pass
    return out
