"""The reward options of ``score`` and ``groovist-calibrate``: the click
options, how their values reach each reward, and the story-context files
(``--image-ids``, ``--noun-phrases``) they name."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _fail

# Options of the image-based rewards; each reaches the rewards that accept it.
_REWARD_OPTIONS = [
    click.option("--image-root", type=_DIR, help="Directory that image paths and image ids are resolved against."),
    click.option("--image-ids", "image_id_map", type=_FILE, help="JSON {story_id: [image ids]} for story sets without images."),
    click.option("--regions", type=click.Choice(["table", "crops", "grid", "whole"]), help="Region source (groovist)."),
    click.option("--region-table", type=_FILE, help="Region table CSV (image_id,bbox rows; top-B per image in file order)."),
    click.option("--crops-dir", type=_DIR, help="Directory of precomputed crops named <image_id>_<bbox>.jpg."),
    click.option("--top-b", type=click.IntRange(min=1), help="Regions per image (default 10)."),
    click.option("--clip-model", help="open_clip model name, hf-hub:org/repo or local-dir:PATH (default ViT-B-32)."),
    click.option("--clip-pretrained", help="open_clip pretrained tag or local checkpoint (default openai)."),
    click.option("--device", help="cuda, cpu, ... (default: CUDA when available)."),
    click.option("--precision", type=click.Choice(["auto", "fp32", "fp16", "bf16"])),
    click.option("--theta", help="GROOViST θ: a number or vist, aesop, vwp, custom."),
    click.option("--spacy-pipeline", help="spaCy pipeline for noun phrases (default en_core_web_trf)."),
    click.option("--noun-phrases", "noun_phrase_map", type=_FILE, help="Precomputed NPs, JSON {story_id: [phrases]} (skips spaCy)."),
    click.option("--concreteness", type=_FILE, help="Concreteness ratings file (default: storyrl asset cache)."),
    click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="On-disk region-embedding cache."),
    click.option("--coherence-model", type=click.Path(exists=True, path_type=Path), help="RoViST-C model: storyrl directory or the authors' checkpoint."),
    click.option("--trust-checkpoint/--no-trust-checkpoint", default=None, help="Allow unpickling the authors' RoViST-C checkpoint (only for files you trust)."),
    click.option("--mode", type=click.Choice(["prefix", "adjacent"]), help="Coherence pairs: prefix (d_HM, default) or adjacent (RoViST)."),
    click.option("--rovist-vg-model", type=click.Path(exists=True, file_okay=False, path_type=Path), help="RoViST-VG model directory (storyrl train rovist-vg)."),
    click.option("--glove", type=_FILE, help="GloVe word vectors, text format (rovist_vg)."),
    click.option("--idf-corpus", type=_FILE, help="Story set whose word document frequencies give idf weights."),
]
# CLI option -> (reward, constructor argument) where the name alone would be ambiguous.
_RENAMED_OPTIONS = {"coherence_model": ("coherence", "model"), "rovist_vg_model": ("rovist_vg", "model")}


def _reward_options(function):
    for option in reversed(_REWARD_OPTIONS):
        function = option(function)
    return function


def _option_values(kwargs: dict) -> tuple[dict, dict]:
    """Split command kwargs into reward options and story-context files."""
    context_files = {"image_ids": kwargs.pop("image_id_map"), "noun_phrases": kwargs.pop("noun_phrase_map")}
    options = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items() if v is not None}
    return options, context_files


def _make_rewards(names: list[str], configs, options: dict) -> list:
    from storyrl.rewards import accepted_options, create_reward, get_reward_class, load_reward_config

    def options_for(name: str) -> dict:
        own = {k: v for k, v in options.items() if k not in _RENAMED_OPTIONS}
        own.update({arg: options[k] for k, (reward, arg) in _RENAMED_OPTIONS.items() if reward == name and k in options})
        return own

    try:
        rewards = [load_reward_config(c, overrides=options_for(_config_reward_name(c))) for c in configs]
        for name in names:
            allowed = accepted_options(get_reward_class(name))
            rewards.append(create_reward(name, **{k: v for k, v in options_for(name).items() if k in allowed}))
    except (KeyError, TypeError, ValueError) as exc:
        _fail(str(exc.args[0] if isinstance(exc, KeyError) else exc))
    return rewards


def _config_reward_name(path: Path) -> str | None:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None  # load_reward_config reports it
    return data.get("reward") if isinstance(data, dict) else None


def _attach_context_files(records, files: dict) -> None:
    """Fill records' image ids / noun phrases from ``--image-ids`` / ``--noun-phrases``."""
    from storyrl.data import StoryDataError, load_id_lists

    for key, path in files.items():
        if path is None:
            continue
        try:
            table = load_id_lists(path, "image ids" if key == "image_ids" else "phrases")
        except StoryDataError as exc:
            _fail(str(exc))
        missing = [r.story_id for r in records if r.story_id not in table]
        if missing:
            _fail(f"{path}: no entry for story {missing[0]!r} ({len(missing)} stories missing)")
        for r in records:
            setattr(r, key, table[r.story_id])
