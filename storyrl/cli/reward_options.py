"""The reward options of ``score`` and ``groovist-calibrate``: generated
from the rewards' configs (:mod:`storyrl.cli.config_options`), how their
values reach each reward, and the story-context files (``--image-ids``,
``--noun-phrases``) the commands read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from storyrl.cli.common import _FILE, _fail
from storyrl.cli.config_options import given, split_reward_options

# Story-context files: not reward options, but read into the records.
CONTEXT_FILE_OPTIONS = [
    click.option("--image-ids", "image_id_map", type=_FILE, help="JSON {story_id: [image ids]} for story sets without images."),
    click.option("--noun-phrases", "noun_phrase_map", type=_FILE, help="Precomputed NPs, JSON {story_id: [phrases]} (skips spaCy)."),
]
# score only: rovist_vg is the one reward that reads nouns.
NOUNS_OPTION = click.option("--nouns", "noun_map", type=_FILE,
                            help="Precomputed nouns for rovist_vg, JSON {story_id: [nouns]} (skips spaCy).")
EPILOG = ("Every option of a reward also has the spelling --<reward>-<option> (e.g. --coherence-model, "
          "--groovist-batch-size), which reaches only that reward; `storyrl rewards NAME` lists a reward's options.")


def context_file_options(function):
    for option in reversed(CONTEXT_FILE_OPTIONS):
        function = option(function)
    return function


def input_paths(values: dict[str, Any]) -> list[str]:
    """Every path-like value given, for the check that no output overwrites an input."""
    found = []
    for value in given(values).values():
        found += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
    return found


def make_rewards(names: list[str], configs, values: dict[str, Any]) -> list:
    """The rewards named by ``--metrics`` and by ``--config`` files, with the
    given command-line options (which win over a config file's)."""
    from storyrl.rewards import REWARDS, create_reward, load_reward_config

    try:
        names = [REWARDS.resolve(n) for n in names]
    except KeyError as exc:  # a name the command line got wrong: a usage error (exit 2)
        _fail(f"--metrics: {exc.args[0]}", exit_code=2)
    try:
        in_files = [_config_reward_name(c) for c in configs]
        in_files = [REWARDS.resolve(n) if n in REWARDS else None for n in in_files]
        per_reward = split_reward_options(values, {n for n in (*names, *in_files) if n is not None})
        rewards = [load_reward_config(c, overrides=per_reward.get(n)) for c, n in zip(configs, in_files)]
        rewards += [create_reward(name, **per_reward[name]) for name in names]
    except (KeyError, TypeError, ValueError) as exc:
        _fail(str(exc.args[0] if isinstance(exc, KeyError) else exc))
    return rewards


def _config_reward_name(path: Path) -> str | None:
    from storyrl.config import ConfigFileError, load_yaml

    try:
        data = load_yaml(path)
    except ConfigFileError:
        return None  # load_reward_config reports it
    return data.get("reward") if isinstance(data, dict) else None


def attach_context_files(records, image_id_map: Path | None, noun_phrase_map: Path | None,
                         noun_map: Path | None = None) -> None:
    """Fill records' image ids / noun phrases / nouns from ``--image-ids`` /
    ``--noun-phrases`` / ``--nouns``."""
    from storyrl.data import StoryDataError, load_id_lists

    files = (("image_ids", image_id_map, "image ids"), ("noun_phrases", noun_phrase_map, "phrases"),
             ("nouns", noun_map, "nouns"))
    for key, path, what in files:
        if path is None:
            continue
        try:
            table = load_id_lists(path, what)
        except StoryDataError as exc:
            _fail(str(exc))
        missing = [r.story_id for r in records if r.story_id not in table]
        if missing:
            _fail(f"{path}: no entry for story {missing[0]!r} ({len(missing)} stories missing)")
        for r in records:
            setattr(r, key, table[r.story_id])
