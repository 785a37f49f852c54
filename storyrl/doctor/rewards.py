"""What a reward needs, read from its options' values (a reward config file,
a registered name at its defaults, or an inline mapping; composites through
their components)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storyrl.doctor.pieces import (
    _OPTION_HINTS,
    GLOVE_URL,
    REGIONS_URL,
    ROVIST_URL,
    VIST_URL,
    Piece,
    Requirements,
    _gpu_piece,
    _model_piece,
    _pathlike,
    _server_piece,
)
from storyrl.models.hub import open_clip_hub_id
from storyrl.models.runtime import has_saved_tokenizer

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
    if isinstance(config, ModelConfig):  # models run on CPU too, only slower, unless the config asks for CUDA
        pieces.append(_gpu_piece(str(values.get("device") or "").startswith("cuda")))
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
    if name == "remote":  # nothing to download: its client library, and a server that answers
        pieces.append(Piece("package", "httpx", "httpx (remote reward client)", "pip install 'storyrl[remote]'",
                            required))
        pieces.append(_server_piece(values["url"], required))
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

