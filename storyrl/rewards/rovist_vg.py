"""RoViST-VG (Wang et al., 2022): visual grounding of a story's nouns in the
regions of its image sequence, with a dedicated contrastively trained model.

Model (RoViST paper §3.1, GROOViST paper Appendix C): an image encoder (a timm
ViT, ``vit_base_patch16_224`` as the authors, then ``Linear(768, 1024)`` and
tanh) and a text encoder (the mean 300-d GloVe vector of the noun's words,
then ``Linear(300, 1024)`` and tanh). Train it with
:mod:`storyrl.training.rovist_vg`; :meth:`RovistVGModel.save_pretrained`
writes the directory the reward's ``model`` option names.

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
* Region crops are resized to the ViT input without cropping
  (``crop_mode="squash"``), as the authors' ViT feature extractor does: a
  centre crop would cut off part of a detected box.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from storyrl.rewards.region_base import RegionReward

log = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_VIT",
    "GloVe",
    "RovistVG",
    "RovistVGEmbedder",
    "RovistVGModel",
    "load_glove",
    "rovist_vg_embedder",
    "rovist_vg_score",
    "scale_score",
    "shared_glove",
]

DEFAULT_VIT = "vit_base_patch16_224"
CONFIG_FILE = "storyrl_rovist_vg.json"
WEIGHTS_FILE = "model.safetensors"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"  # read when safetensors is unavailable
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


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


# -- GloVe -----------------------------------------------------------------------


class GloVe:
    """Word vectors: ``vectors[index[word]]``. Words are looked up lower-cased
    (GloVe 6B/42B are lower-case; a cased file only answers for its
    lower-case entries)."""

    def __init__(self, words: Sequence[str], vectors: np.ndarray, path: str | None = None) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(words):
            raise ValueError(f"{len(words)} words but vectors of shape {vectors.shape}")
        self.index = {w: i for i, w in enumerate(words)}
        self.vectors = vectors
        self.path = path
        self.cache_key: Any = None  # set for shared (whole-file) tables

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, word: str) -> bool:
        return word.lower() in self.index

    def vector(self, word: str) -> np.ndarray | None:
        row = self.index.get(word.lower())
        return None if row is None else self.vectors[row]

    def phrase_vector(self, phrase: str) -> np.ndarray | None:
        """Mean vector of the phrase's whitespace-separated words that have
        one (the authors average multi-word mentions); None when none has."""
        rows = [self.index.get(w) for w in phrase.lower().split()]
        rows = [r for r in rows if r is not None]
        if not rows:
            return None
        return self.vectors[rows].mean(axis=0)

    def __repr__(self) -> str:
        return f"GloVe({len(self)} words, dim={self.dim}, path={self.path!r})"


def load_glove(path: str | os.PathLike, vocabulary: Collection[str] | None = None, dim: int | None = None) -> GloVe:
    """Read GloVe's text format: per line a word then its numbers, separated
    by single spaces. ``vocabulary`` keeps only those words (compared as
    written; lower-case words for GloVe 6B), to save memory. ``dim`` defaults
    to the first line's number of values; words containing spaces (as in
    glove.840B) are the leading fields beyond ``dim``. A word2vec-style header
    line ``<count> <dim>`` is accepted. Repeated words: the first one wins.
    Errors (ValueError) name the file and line; lines dropped by
    ``vocabulary`` are not checked.
    """
    path = str(path)
    words: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    lineno = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                line = line.rstrip("\r\n").rstrip(" ")
                if not line.strip():
                    continue
                parts = line.split(" ")
                if dim is None:
                    if lineno == 1 and len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                        dim = int(parts[1])  # word2vec text header
                        continue
                    dim = len(parts) - 1
                    if dim < 1:
                        raise ValueError(
                            f"{path}, line {lineno}: expected a word followed by numbers, got {line[:80]!r}"
                        )
                if len(parts) < dim + 1:
                    raise ValueError(
                        f"{path}, line {lineno}: expected a word and {dim} numbers, found {len(parts)} fields"
                    )
                word = parts[0] if len(parts) == dim + 1 else " ".join(parts[: len(parts) - dim])
                if (vocabulary is not None and word not in vocabulary) or word in seen:
                    continue
                try:
                    vec = np.asarray(parts[len(parts) - dim :], dtype=np.float32)
                except ValueError:
                    bad = next(p for p in parts[len(parts) - dim :] if not _is_number(p))
                    raise ValueError(f"{path}, line {lineno}: {bad[:40]!r} is not a number (word {word!r})") from None
                if not np.isfinite(vec).all():
                    raise ValueError(f"{path}, line {lineno}: non-finite value in the vector of {word!r}")
                seen.add(word)
                words.append(word)
                rows.append(vec)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}, line {lineno + 1}: not valid UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read GloVe vectors: {exc.strerror or exc}") from exc
    if dim is None:
        raise ValueError(f"{path}: no word vectors in the file")
    vectors = np.stack(rows) if rows else np.zeros((0, dim), np.float32)
    return GloVe(words, vectors, path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def shared_glove(path: str | os.PathLike) -> GloVe:
    """The whole GloVe file, read once per process (and again if it changes)."""
    from storyrl.models import shared_model

    resolved = os.path.abspath(path)
    try:
        st = os.stat(resolved)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read GloVe vectors: {exc.strerror or exc}") from exc
    key = ("glove", resolved, st.st_size, st.st_mtime_ns)

    def load() -> GloVe:
        glove = load_glove(resolved)
        glove.cache_key = key  # noun embeddings are cached per file version
        return glove

    return shared_model(key, load)


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

        timm_kwargs = {**(timm_kwargs or {}), **more_timm_kwargs}

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
        from storyrl.models import LruDict, resolve_device, resolve_precision

        self.model_dir = model_dir
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype = getattr(torch, _DTYPES[self.precision])
        self.model = RovistVGModel.from_pretrained(model_dir).to(self.device, self.dtype).eval()
        self.transform = self.model.image_transform()
        self.regions = LruDict(max_cached)
        self.texts = LruDict(max_cached)
        self.stats = {"texts_embedded": 0, "regions_embedded": 0}
        self._lock = threading.Lock()

    def embed_regions(
        self, regions: Sequence[Any], load: Callable[[Sequence[Any]], list], batch_size: int = 64
    ) -> np.ndarray:
        """``[len(regions), dim]`` float32, rows L2-normalised; ``load(regions)``
        gives PIL images of the regions not cached yet."""
        with self._lock:
            todo = list({r.key: r for r in regions if self.regions.get_fresh(r.key) is None}.values())
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                for region, vec in zip(chunk, self._encode_images(load(chunk))):
                    self.regions.put(region.key, vec)
            self.stats["regions_embedded"] += len(todo)
            if not regions:
                return np.zeros((0, self.model.embed_dim), np.float32)
            return np.stack([self.regions[r.key] for r in regions])

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

    def _encode_images(self, images: list) -> np.ndarray:
        # PIL resizing releases the GIL: preprocess in threads.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            pixels = torch.stack(list(pool.map(self.transform, images)))
        with torch.inference_mode():
            emb = self.model.embed_images(pixels.to(self.device, self.dtype))
            emb = torch.nn.functional.normalize(emb.float(), dim=-1)
        return emb.cpu().numpy()

    def _encode_vectors(self, vectors: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            emb = self.model.embed_texts(torch.from_numpy(vectors).to(self.device, self.dtype))
            emb = torch.nn.functional.normalize(emb.float(), dim=-1)
        return emb.cpu().numpy()


def rovist_vg_embedder(
    model_dir: str | os.PathLike, device: str | None = None, precision: str = "auto"
) -> RovistVGEmbedder:
    """The process-wide embedder of a model directory on a device and precision
    (loaded on first use; :func:`storyrl.models.release_models` forgets it)."""
    from storyrl.models import resolve_device, resolve_precision, shared_model

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


class RovistVG(RegionReward):
    """RoViST-VG as a reward (higher = better grounded).

    Story context: ``images`` (paths or PIL images, one per position) or
    ``image_ids`` (resolved against ``image_root``); optionally ``nouns``
    (per story, a list of nouns) to skip spaCy. Without ``nouns``, a
    ``noun_phrases`` column is used the same way (a multi-word entry gets the
    mean vector of its words) -- note that GROOViST's noun chunks are not
    RoViST's nouns, so give ``nouns`` when a dataset serves both rewards.

    Args:
        model: a RoViST-VG model directory (:meth:`RovistVGModel.save_pretrained`).
        glove: the GloVe text file the model was trained with (300-d).
        idf_corpus: story set (JSON/JSONL) or an ``Idf.to_json`` table giving
            the nouns' idf weights; None = weights 1.0 (not the paper's metric).
        scaled: return Eq. 3's scaled score in (−1, 1) instead of S_VG.
        regions: "table" (detector boxes cut from the images; the authors'
            setup with top_b=10), "crops" (pre-cut crop files), "grid" (3×3
            crops + whole image), "whole"; default: table/crops when given,
            else grid.
        region_table, crops_dir, top_b, grid: region source options.
        spacy_pipeline: spaCy pipeline for POS tags (nouns = NOUN/PROPN).
        device, precision ("auto": fp16 on CUDA, fp32 on CPU), batch_size
            (regions/nouns per forward pass), image_root.
    """

    name = "rovist_vg"
    higher_is_better = True

    def __init__(
        self,
        model: str | None = None,
        glove: str | None = None,
        idf_corpus: str | None = None,
        scaled: bool = False,
        regions: str | None = None,
        region_table: str | None = None,
        crops_dir: str | None = None,
        top_b: int = 10,
        grid: int = 3,
        spacy_pipeline: str = "en_core_web_trf",
        device: str | None = None,
        precision: str = "auto",
        batch_size: int = 64,
        image_root: str | None = None,
    ) -> None:
        super().__init__()
        from storyrl.models import check_run_options

        check_run_options(precision, batch_size)
        if idf_corpus is None:
            log.warning("rovist_vg: no idf_corpus, so every noun weighs 1.0 (the paper weights by idf)")
        self.model = str(model) if model else None
        self.glove = str(glove) if glove else None
        self.idf_corpus = idf_corpus
        self.scaled = scaled
        self.value_range = (-1.0, 1.0) if self.scaled else (-math.inf, math.inf)
        self._set_region_source(regions, region_table, crops_dir, top_b, grid)
        self.spacy_pipeline = spacy_pipeline
        self.device = device
        self.precision = precision
        self.batch_size = batch_size
        self.image_root = image_root
        self._extractor = self._glove = self._idf = None

    def config(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "glove": self.glove,
            "idf_corpus": self.idf_corpus,
            "scaled": self.scaled,
            "regions": self.regions,
            **self.region_options,
            "spacy_pipeline": self.spacy_pipeline,
            "device": self.device,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "image_root": self.image_root,
        }

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
        if not (Path(self.model) / CONFIG_FILE).is_file():
            raise ValueError(f"{self.model}: not a storyrl RoViST-VG model directory (no {CONFIG_FILE})")
        if not Path(self.glove).is_file():
            raise ValueError(f"{self.glove}: GloVe file not found")
        self.embedder  # noqa: B018
        self.word_vectors  # noqa: B018
        self.idf  # noqa: B018

    @property
    def embedder(self) -> RovistVGEmbedder:
        return rovist_vg_embedder(self.model, self.device, self.precision)

    @property
    def word_vectors(self) -> GloVe:
        if self._glove is None:
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

        return self.embedder.embed_regions(regions, load_regions, self.batch_size)
