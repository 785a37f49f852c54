"""``storyrl doctor``: what a real run needs, whether it is here, and how to get it.

A run with the paper's setup needs pieces that storyrl cannot ship: GPU
torch, hub models (CLIP ViT-B/32 ``openai``, ``albert-large-v1``,
LLaVA-NeXT-7B), a spaCy pipeline, the GROOViST word lists (``storyrl
assets``), trained or released metric models, GloVe, and VIST. The pieces
are derived from the rewards' and configs' actual option values (a config
whose ``model:`` is a local directory needs that directory, not a hub id),
so the check follows the defaults when they change.

Checks are lookups only -- the Hugging Face cache, installed packages,
files -- and never load a model, so offline the doctor finishes in seconds.
:func:`fetch` downloads what can be downloaded (hub snapshots, the spaCy
pipeline, the assets) and reports, per piece, what it could not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.models.hub import hub_reachable, in_cache, looks_like_repo_id, open_clip_hub_id
from storyrl.models.runtime import has_saved_tokenizer

__all__ = [
    "PAPER_REWARDS",
    "Piece",
    "Requirements",
    "check",
    "config_requirements",
    "fetch",
    "paper_requirements",
    "reward_requirements",
]

PYTORCH_INSTALL = "https://pytorch.org/get-started/locally/"
VIST_URL = "https://visionandlanguage.net/VIST/dataset.html"
VWP_URL = "https://vwprompt.github.io/"
GLOVE_URL = "https://nlp.stanford.edu/projects/glove/"
ROVIST_URL = "https://github.com/usydnlp/rovist"
REGIONS_URL = "https://github.com/akskuchi/groovist/blob/main/image_regions.md"

#: The d_HM paper's rewards: required when nothing is named, the others optional.
PAPER_REWARDS = ("dhm", "groovist", "coherence", "repetition")
#: Where the shipped configs (configs/sweeps/dhm_vist.yaml, configs/rl/) read VIST.
PAPER_DATA = "data/vist"

#: Kinds of piece; the first three can be downloaded by :func:`fetch`.
FETCHABLE = ("hub", "spacy", "asset")
KINDS = (*FETCHABLE, "torch", "path", "package")

# How to get a reward's file or directory option when it is missing.
_PATH_HINTS = {
    ("coherence", "model"): "storyrl train coherence --config configs/training/coherence.yaml",
    ("rovist_vg", "model"): "storyrl train rovist_vg --config configs/training/rovist_vg.yaml",
    ("rovist_vg", "glove"): GLOVE_URL,
    ("vrank", "model"): "storyrl train vrank --config configs/training/vrank.yaml",
    ("cosmic", "model"): "storyrl train cosmic --config configs/training/cosmic.yaml",
    ("reward_model", "model"): "storyrl train reward_model --config configs/training/reward_model.yaml",
    ("dhm", "human_scores"): "storyrl score HUMAN_STORIES -m groovist,coherence,repetition -o human_scores.csv",
}
_OPTION_HINTS = {
    "region_table": REGIONS_URL,
    "crops_dir": REGIONS_URL,
    "image_root": VIST_URL,
    "idf_corpus": VIST_URL,
    "data": VIST_URL,
}
# What a reward's option is, in the table.
_LABELS = {
    ("coherence", "model"): "RoViST-C model (coherence model)",
    ("coherence", "base_model"): "ALBERT config + tokenizer (coherence base_model)",
    ("rovist_vg", "model"): "RoViST-VG model (rovist_vg model)",
    ("rovist_vg", "glove"): "GloVe vectors (rovist_vg glove)",
    ("vrank", "model"): "Vrank model (vrank model)",
    ("cosmic", "model"): "COSMiC model (cosmic model)",
    ("reward_model", "model"): "story reward model (reward_model model)",
}
# Options a reward cannot run without even though their default is null: the
# reward refuses to set up (see each reward's _loaded / _setup).
_NEEDED_WHEN_UNSET = {("coherence", "model"), ("rovist_vg", "model"), ("rovist_vg", "glove"),
                      ("vrank", "model"), ("cosmic", "model")}


@dataclass
class Piece:
    """One thing a run needs: its ``kind`` (see :data:`KINDS`), ``target``
    (hub repo id, spaCy pipeline, asset file name, path, package, ``cuda``),
    what it is and the one command or link that gets it."""

    kind: str
    target: str
    label: str
    hint: str
    required: bool = True
    needed_by: list[str] = field(default_factory=list)
    present: bool | None = None  # None: not checked yet
    where: str = ""  # where it was found, or why it counts as missing
    fetch_error: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.target

    @property
    def fetchable(self) -> bool:
        return self.kind in FETCHABLE

    def to_json(self) -> dict[str, Any]:
        return {"piece": self.label, "kind": self.kind, "target": self.target, "required": self.required,
                "present": self.present, "where": self.where, "needed_by": list(self.needed_by),
                "get": None if self.present else self.hint, "fetchable": self.fetchable,
                "fetch_error": self.fetch_error}


class Requirements:
    """Pieces in the order they were first needed, one per (kind, target):
    required by anyone means required."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[str, str], Piece] = {}

    def add(self, piece: Piece, owner: str) -> None:
        known = self._pieces.get(piece.key)
        if known is None:
            self._pieces[piece.key] = known = piece
        else:
            known.required = known.required or piece.required
        if owner not in known.needed_by:
            known.needed_by.append(owner)

    @property
    def pieces(self) -> list[Piece]:
        return list(self._pieces.values())

    def missing(self, required_only: bool = True) -> list[Piece]:
        return [p for p in self.pieces if not p.present and (p.required or not required_only)]


# -- what the rewards and configs need --------------------------------------------


def _gpu_piece(required: bool) -> Piece:
    return Piece("torch", "cuda", "GPU torch (CUDA available)", PYTORCH_INSTALL, required)


def _pathlike(name: str) -> bool:
    """A local path, not a hub repo id ("org/name" or a bare legacy name):
    the rule :func:`~storyrl.models.hub.require_hub_model` follows."""
    return Path(name).expanduser().exists() or not looks_like_repo_id(name)


def _model_piece(name: str, label: str, hint: str | None, required: bool) -> Piece:
    """A model given as a hub repo id or a local directory."""
    if _pathlike(name):
        return Piece("path", name, label, hint or f"the local model directory {name}", required)
    repo_id = name.removeprefix("hf-hub:").rstrip("/")
    return Piece("hub", repo_id, label, f"hf download {repo_id}", required)


def _has_tokenizer(directory: str | None) -> bool:
    """A model directory holding a saved tokenizer needs no base_model/tokenizer from elsewhere."""
    return bool(directory) and Path(directory).is_dir() and has_saved_tokenizer(directory)


def _clip_pieces(model: str, pretrained: str | None, required: bool) -> list[Piece]:
    label = f"CLIP {model} ({pretrained}) weights"
    if model.startswith("local-dir:"):
        path = model.removeprefix("local-dir:")
        return [Piece("path", path, f"CLIP model directory {path}", f"the local CLIP directory {path}", required)]
    if pretrained is None:
        return []  # random weights: nothing to get
    if _pathlike(pretrained) or pretrained.endswith((".pt", ".bin", ".safetensors")):
        return [Piece("path", pretrained, f"CLIP checkpoint {pretrained}", f"the CLIP checkpoint file {pretrained}",
                      required)]
    repo_id = open_clip_hub_id(model, pretrained)
    if repo_id is None:  # a tag open_clip fetches from a plain URL: its cache cannot be looked up
        return [Piece("package", f"open_clip:{model}:{pretrained}", label,
                      "runs once with network access (open_clip downloads it on first use)", False)]
    return [Piece("hub", repo_id, label, f"hf download {repo_id}", required)]


def _spacy_piece(name: str, required: bool) -> Piece:
    if Path(name).expanduser().is_dir():
        return Piece("path", name, f"spaCy pipeline directory {name}", f"the spaCy pipeline directory {name}",
                     required)
    return Piece("spacy", name, f"spaCy pipeline {name}", f"python -m spacy download {name}", required)


def _asset_piece(name: str, required: bool) -> Piece:
    from storyrl.assets import ASSETS

    what = "concreteness ratings" if "concreteness" in name else "pronoun list"
    assert name in ASSETS, name  # a renamed asset must be renamed here too
    return Piece("asset", name, f"GROOViST {what} ({name})", "storyrl assets", required)


def _leaf_pieces(name: str, config: Any, required: bool) -> list[Piece]:
    """The pieces of one (non-composite) reward with config ``config``."""
    from storyrl.config import option_info
    from storyrl.rewards.base import ModelConfig

    values = {info.name: getattr(config, info.name) for info in option_info(type(config))}
    infos = {info.name: info for info in option_info(type(config))}
    pieces: list[Piece] = []
    if isinstance(config, ModelConfig):  # models run on CPU too, only slower
        pieces.append(_gpu_piece(False))
    if "clip_model" in values:
        pieces += _clip_pieces(values["clip_model"], values.get("clip_pretrained"), required)
    if "spacy_pipeline" in values:
        pieces.append(_spacy_piece(values["spacy_pipeline"], required))
    # GROOViST's word lists come from the asset cache unless a file is given.
    if values.get("weighting") == "concreteness" and "concreteness" in values and values["concreteness"] is None:
        pieces.append(_asset_piece("concreteness_ratings.csv", required))
    if "pronouns" in values and values["pronouns"] is None:
        pieces.append(_asset_piece("all_pronouns.txt", required))
    for option, value in values.items():
        info = infos[option]
        hint = _PATH_HINTS.get((name, option)) or _OPTION_HINTS.get(option)
        label = _LABELS.get((name, option), f"{name} {option}")
        if value is None:
            if (name, option) in _NEEDED_WHEN_UNSET:
                pieces.append(Piece("path", f"({name}.{option} not set)", label,
                                    hint or f"set {option}", required))
            continue
        if info.path in ("file", "dir", "any") and isinstance(value, str):
            pieces.append(Piece("path", value, label, hint or f"the path set as {option}", required))
        elif option in ("model", "base_model", "tokenizer") and isinstance(value, str) and info.path is None:
            if option != "model" and _has_tokenizer(values.get("model")):
                continue  # the model directory brings its own tokenizer / config
            pieces.append(_model_piece(value, label, hint, required))
    pieces += _special_pieces(name, values, required)
    return pieces


def _special_pieces(name: str, values: dict[str, Any], required: bool) -> list[Piece]:
    """What a reward needs beyond its option values' plain reading."""
    pieces = []
    if name == "groovist" and values.get("region_table") is None and values.get("crops_dir") is None:
        pieces.append(Piece("path", "(groovist region_table)", "authors' detector region table (for parity)",
                            REGIONS_URL, False))
    if name == "coherence":
        model = values.get("model")
        if model and Path(model).is_file() and not values.get("trust_checkpoint"):
            pieces.append(Piece("path", f"(trust_checkpoint for {model})", f"trust_checkpoint: true for {model}",
                                "set trust_checkpoint: true (only for a checkpoint file you trust)", required))
        if not (model and Path(model).exists()):
            pieces.append(Piece("path", "(authors' RoViST-C checkpoint)",
                                "authors' RoViST-C checkpoint (instead of training one)", ROVIST_URL, False))
    if name == "rovist_vg" and values.get("idf_corpus") is None:
        pieces.append(Piece("path", "(rovist_vg idf_corpus)", "rovist_vg idf_corpus (the paper weights by idf)",
                            VIST_URL, False))
    if name == "cosmic" and values.get("model") and Path(values["model"]).is_dir():
        pieces += _cosmic_encoders(values["model"], required)
    return pieces


def _cosmic_encoders(directory: str, required: bool) -> list[Piece]:
    """The frozen encoders a trained COSMiC directory names."""
    import json

    try:
        spec = json.loads((Path(directory) / "storyrl_cosmic.json").read_text(encoding="utf-8"))["encoders"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # not a COSMiC directory: the reward says so when it loads
    pieces = [_model_piece(spec.get("text_model", "bert-large-uncased"), "cosmic text encoder", None, required)]
    image, pretrained = spec.get("image_model"), spec.get("image_pretrained")
    if spec.get("image_library") == "open_clip":
        pieces += _clip_pieces(image, pretrained, required)
    elif pretrained == "default":
        from storyrl.models.hub import timm_hub_id

        repo_id = timm_hub_id(image)
        if repo_id:
            pieces.append(Piece("hub", repo_id, f"cosmic image encoder {image}", f"hf download {repo_id}", required))
    elif pretrained:
        pieces.append(Piece("path", pretrained, "cosmic image encoder weights", f"the file {pretrained}", required))
    return pieces


def _reward_pieces(reward, required: bool) -> list[tuple[str, Piece]]:
    """(owner, piece) of a built reward and, for composites, its components."""
    components = getattr(reward, "component_rewards", None)
    if components is not None:
        out = []
        for sub in components.values():
            out += [(f"{reward.name}/{owner}", piece) for owner, piece in _reward_pieces(sub, required)]
        return out
    return [(reward.name, piece) for piece in _leaf_pieces(reward.name, reward.args, required)]


def reward_requirements(spec: Any, reqs: Requirements, *, required: bool = True, owner: str | None = None,
                        options: Mapping[str, Any] | None = None, expect: str | None = None) -> None:
    """Add the pieces of reward ``spec`` (a registered name, a reward config
    file or an inline mapping) to ``reqs``. TypeError / ValueError naming the
    file or reward at fault when the spec is invalid."""
    from storyrl.rewards import resolve_reward

    cls, config = resolve_reward(spec, options, expect=expect)
    if _is_composite(cls):
        reward = cls(config)  # builds the components (their models load only when scoring)
        pairs = _reward_pieces(reward, required)
    else:
        pairs = [(cls.name, piece) for piece in _leaf_pieces(cls.name, config, required)]
    for name, piece in pairs:
        reqs.add(piece, f"{owner}:{name}" if owner else name)


def _is_composite(cls: type) -> bool:
    from storyrl.rewards.composite import CompositeReward

    return issubclass(cls, CompositeReward)


def _data_piece(path: str, label: str, data_format: str | None = None) -> Piece:
    hint = VWP_URL if (data_format == "vwp" or "vwp" in path.lower()) else VIST_URL
    return Piece("path", path, label, hint, True)


def _generator_requirements(generator: str, options: Mapping[str, Any], reqs: Requirements, owner: str) -> None:
    """The model and files of one generator with ``options`` (the
    generator's declared defaults for what is not given)."""
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    for info in option_info(GENERATORS.get(generator).config_class):
        value = options.get(info.name, None if info.required else info.default)
        if not isinstance(value, str):
            continue
        if info.name == "model" and info.path is None:
            reqs.add(_model_piece(value, f"{owner} model", None, True), owner)
        elif info.path in ("file", "dir", "any"):
            hint = "storyrl train tapm --config configs/training/tapm.yaml" if info.name == "model" else \
                _OPTION_HINTS.get(info.name, f"the path set as {info.name}")
            reqs.add(Piece("path", value, f"{owner} {info.name}", hint, True), owner)
    if options.get("backend") == "vllm":
        reqs.add(Piece("package", "vllm", "vllm (backend: vllm)", 'pip install -e ".[vllm]"', True), owner)
    if options.get("load_in_4bit"):
        reqs.add(Piece("package", "bitsandbytes", "bitsandbytes (load_in_4bit)", 'pip install -e ".[quant]"', True),
                 owner)


def _sweep_requirements(path: Path, reqs: Requirements) -> None:
    from storyrl.eval.sweep import SweepConfig, plan_cells

    config = SweepConfig.from_yaml(path)
    owner = path.name
    reqs.add(_gpu_piece(True), owner)
    reqs.add(_data_piece(config.data, f"{owner} data", config.data_format), owner)
    seen = set()
    for cell in plan_cells(config):
        if cell.model not in seen:  # settings and prompts do not change what a model needs
            seen.add(cell.model)
            _generator_requirements(cell.generator, cell.options, reqs, f"{owner}:{cell.model}")
    for key, value in config.rewards.items():
        reward_requirements(value, reqs, owner=owner, expect=key)
    if config.human_scores:
        reqs.add(Piece("path", config.human_scores, f"{owner} human_scores", "the score CSV of the human stories",
                       True), owner)


# RLConfig is not built: it imports TRL (seconds) and refuses a config whose
# data file is missing -- which is what the doctor must report. Its keys that
# name things to get are read from the file, with RLConfig's defaults.
_RL_PATH_KEYS = ("image_root", "prompts_file", "sequence_image_dir")


def _rl_requirements(path: Path, data: Mapping[str, Any], reqs: Requirements) -> None:
    from storyrl.models.vlm import DEFAULT_VLM

    owner = path.name
    reqs.add(_gpu_piece(True), owner)
    model = data.get("model", DEFAULT_VLM)
    if isinstance(model, str):
        reqs.add(_model_piece(model, f"{owner} policy model", None, True), owner)
    if isinstance(data.get("data"), str):
        reqs.add(_data_piece(data["data"], f"{owner} data", data.get("data_format")), owner)
    for key in _RL_PATH_KEYS:
        if isinstance(data.get(key), str):
            reqs.add(Piece("path", data[key], f"{owner} {key}", _OPTION_HINTS.get(key, f"the path set as {key}"),
                           True), owner)
    if data.get("load_in_4bit") is True:
        reqs.add(Piece("package", "bitsandbytes", "bitsandbytes (load_in_4bit)", 'pip install -e ".[quant]"', True),
                 owner)
    rewards = data.get("rewards")
    if not isinstance(rewards, list) or not rewards:
        raise ValueError(f"{path}: rewards: a list of rewards (names, reward config files or mappings)")
    for i, entry in enumerate(rewards):
        try:
            reward_requirements(entry, reqs, owner=owner)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: rewards[{i}]: {exc}") from None


def config_requirements(path: str | os.PathLike, reqs: Requirements) -> None:
    """Add the pieces of a reward config (``reward:``), an RL config
    (``configs/rl``: ``rewards:`` a list) or a sweep config
    (``configs/sweeps``: ``models:``). ValueError naming the file otherwise."""
    from storyrl.config import load_yaml

    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping (a reward, RL or sweep config)")  # noqa: TRY004
    try:
        if "reward" in data:
            reward_requirements(str(path), reqs, owner=path.name)
        elif isinstance(data.get("models"), list):
            _sweep_requirements(path, reqs)
        elif isinstance(data.get("rewards"), list) or "algorithm" in data:
            _rl_requirements(path, data, reqs)
        else:
            raise ValueError(f"{path}: not a reward config (reward:), an RL config (configs/rl: rewards: [...]) "
                             "or a sweep config (configs/sweeps: models:); the doctor reads those")
    except TypeError as exc:
        raise ValueError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None
    except ValueError as exc:
        message = " ".join(str(exc).split())
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def paper_requirements(reqs: Requirements) -> None:
    """Everything, as when nothing is named: the paper's setup required (GPU
    torch, the d_HM rewards at their defaults, the prompting generator's
    default model -- LLaVA-NeXT --, VIST), every other registered reward's
    pieces optional."""
    from storyrl.generators import GENERATORS
    from storyrl.rewards import REWARDS

    reqs.add(_gpu_piece(True), "paper")
    for name in REWARDS.names():
        try:
            reward_requirements(name, reqs, required=name in PAPER_REWARDS)
        except (TypeError, ValueError):
            continue  # no usable defaults (weighted needs components, remote a URL): named ones only
    prompting = GENERATORS.get("prompting").config_class
    from storyrl.config import option_info

    model = next(i.default for i in option_info(prompting) if i.name == "model")
    reqs.add(_model_piece(model, "generator model (prompting default)", None, True), "prompting")
    reqs.add(Piece("path", PAPER_DATA, f"VIST data ({PAPER_DATA}, as configs/sweeps/dhm_vist.yaml reads it)",
                   VIST_URL, True), "paper")


def requirements(metrics: Iterable[str] = (), configs: Iterable[str | os.PathLike] = ()) -> Requirements:
    """The pieces of the named rewards and config files, or of everything
    (:func:`paper_requirements`) when none is named. KeyError for an unknown
    reward name, ValueError for a bad config."""
    from storyrl.rewards import REWARDS

    metrics, configs = list(metrics), list(configs)
    names = [REWARDS.resolve(m) for m in metrics]  # KeyError first: a usage error
    reqs = Requirements()
    if not names and not configs:
        paper_requirements(reqs)
        return reqs
    for name in names:
        reward_requirements(name, reqs)
    for path in configs:
        config_requirements(path, reqs)
    return reqs


# -- checks ---------------------------------------------------------------------------


def _hub_cache() -> Path:
    from storyrl.models import hub

    return hub._cache_dir()


def _check_torch(piece: Piece) -> None:
    try:
        import torch
    except ImportError:
        piece.present, piece.where = False, "torch is not installed"
        return
    if torch.cuda.is_available():
        try:
            device = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - the name is decoration only
            device = "a GPU"
        piece.present, piece.where = True, f"torch {torch.__version__}, CUDA {torch.version.cuda}, {device}"
    else:
        build = "a CPU build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build, but no GPU is visible"
        piece.present, piece.where = False, f"torch {torch.__version__} is {build}"


def _installed(module: str) -> str | None:
    """Where an importable module lives, or None (nothing is imported)."""
    from importlib.util import find_spec

    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations
                                                                                 or []), None)
    return str(Path(origin).parent) if origin and origin.endswith("__init__.py") else str(origin or module)


def _check_spacy(piece: Piece) -> None:
    from storyrl.noun_phrases import PipelineNotInstalled, require_pipeline

    try:
        require_pipeline(piece.target)
    except PipelineNotInstalled as exc:
        piece.present, piece.where = False, str(exc).split(";")[0].split(":")[0]
        if piece.target == "en_core_web_trf" and _installed("en_core_web_sm"):
            piece.where += ("; en_core_web_sm is installed: spacy_pipeline: en_core_web_sm uses it "
                            "(faster, not the authors')")
        return
    piece.present, piece.where = True, _installed(piece.target) or piece.target


def _check(piece: Piece) -> None:
    if piece.kind == "torch":
        _check_torch(piece)
    elif piece.kind == "hub":
        folder = _hub_cache() / f"models--{piece.target.replace('/', '--')}"
        piece.present = in_cache(piece.target)
        piece.where = str(folder) if piece.present else f"not in the Hugging Face cache ({_hub_cache()})"
    elif piece.kind == "spacy":
        _check_spacy(piece)
    elif piece.kind == "asset":
        from storyrl.assets import asset_path

        try:
            piece.present, piece.where = True, str(asset_path(piece.target))
        except FileNotFoundError:
            from storyrl.assets import cache_dir

            piece.present, piece.where = False, f"not in {cache_dir()}"
    elif piece.kind == "path":
        if piece.target.startswith("("):  # a setting, not a path: nothing configured
            piece.present, piece.where = False, "not configured"
            return
        path = Path(piece.target).expanduser()
        piece.present = path.exists()
        piece.where = str(path.resolve()) if piece.present else f"no such file or directory: {piece.target}"
    elif piece.kind == "package":
        if ":" in piece.target:  # cannot be looked up (see _clip_pieces)
            piece.present, piece.where = False, "cannot be checked offline"
            return
        location = _installed(piece.target)
        piece.present, piece.where = location is not None, location or f"{piece.target} is not installed"
    else:  # pragma: no cover - every kind above
        raise ValueError(f"unknown piece kind {piece.kind!r}")


def check(reqs: Requirements) -> Requirements:
    """Look every piece up (cache, packages, files); nothing is loaded or downloaded."""
    for piece in reqs.pieces:
        _check(piece)
    return reqs


# -- fetching --------------------------------------------------------------------------


def _fetch_hub(piece: Piece) -> None:
    from huggingface_hub import snapshot_download

    if not hub_reachable():
        from storyrl.models.hub import _env_offline, endpoint

        raise RuntimeError("HF_HUB_OFFLINE is set" if _env_offline() else f"{endpoint()} cannot be reached")
    snapshot_download(piece.target)


def _fetch_spacy(piece: Piece) -> None:
    from storyrl.models.hub import _probe

    # spaCy's pipelines are wheels on GitHub releases; without it pip retries for a minute.
    if not _probe("https://github.com"):
        raise RuntimeError("github.com cannot be reached")
    from spacy.cli import download

    try:
        download(piece.target)
    except SystemExit as exc:  # spaCy's CLI exits when pip fails
        raise RuntimeError(f"python -m spacy download {piece.target} failed (exit {exc.code})") from None


def _fetch_asset(piece: Piece) -> None:
    from storyrl.assets import download_assets

    download_assets([piece.target])


_FETCHERS = {"hub": _fetch_hub, "spacy": _fetch_spacy, "asset": _fetch_asset}


def fetch(reqs: Requirements, report: Callable[[str], None] | None = None) -> Requirements:
    """Download every missing required piece that can be downloaded (hub
    snapshots, spaCy pipelines, assets); optional ones are left alone (they
    can be gigabytes the paper's setup does not use). A failure is recorded
    on its piece (``fetch_error``), never raised. ``report(line)`` is told
    what is being fetched (downloads take minutes). Then check again."""
    from storyrl.rewards.base import one_line

    for piece in reqs.pieces:
        if piece.present is None:
            _check(piece)
        if piece.present or not piece.fetchable or not piece.required:
            continue
        if report is not None:
            report(f"fetching {piece.label} ({piece.target}) ...")
        try:
            _FETCHERS[piece.kind](piece)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported per piece, the others still run
            piece.fetch_error = one_line(exc)
    return check(reqs)
