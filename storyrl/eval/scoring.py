"""Scoring story records with rewards into a score CSV: the one batch loop
that ``storyrl score`` and the prompting sweeps (:mod:`storyrl.eval.sweep`)
share.

Rows are appended as each batch is scored (:class:`storyrl.data.ScoreWriter`),
so an interrupted run keeps what it scored and ``resume=True`` scores only
the missing stories.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from storyrl.data import ScoreWriter, StoryRecord

__all__ = ["CONTEXT_FIELDS", "make_metric", "score_batches", "score_context", "score_to_file"]

#: Record fields a reward may take as per-story context (images for the
#: grounding rewards, the human story as reference, precomputed noun phrases,
#: the story id that keys ``dhm``'s human score table, several human
#: stories for the reference-based baselines, precomputed nouns for RoViST-VG).
CONTEXT_FIELDS = ("story_id", "images", "image_ids", "reference", "references", "noun_phrases", "nouns")


def score_context(batch: Sequence[StoryRecord]) -> dict[str, list]:
    """Per-story context columns that any record of the batch carries."""
    context = {}
    for key in CONTEXT_FIELDS:
        values = [getattr(r, key, None) for r in batch]  # duck-typed records may lack newer fields
        if any(v is not None for v in values):
            context[key] = values
    return context


def score_batches(
    rewards: Sequence[Any],
    records: Sequence[StoryRecord],
    writer: ScoreWriter,
    *,
    batch_size: int = 64,
    progress: bool = True,
    before_write: Callable[[list[StoryRecord], list[str], dict], None] | None = None,
) -> None:
    """Score ``records`` with every reward, ``batch_size`` at a time, and
    append each batch's rows to ``writer`` (one column per reward name).
    ``before_write(batch, texts, context)`` runs before a batch's rows are
    written (e.g. ``--explain`` lines, which must never lag the rows)."""
    from tqdm import tqdm

    with tqdm(total=len(records), unit="story", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(records), batch_size):
            batch = list(records[start : start + batch_size])
            context = score_context(batch)
            texts = [r.story for r in batch]
            scores = {r.name: r.score(texts, **context) for r in rewards}
            if before_write is not None:
                before_write(batch, texts, context)
            writer.write([r.story_id for r in batch], scores)
            bar.update(len(batch))


def score_to_file(
    rewards: Sequence[Any],
    records: Sequence[StoryRecord],
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    batch_size: int = 64,
    progress: bool = True,
) -> int:
    """Score ``records`` into the CSV ``out`` (``story_id`` + one column per
    reward). With ``resume`` the stories already in ``out`` are kept and
    only the rest are scored (the header must match). Returns the number of
    stories scored by this call."""
    columns = [r.name for r in rewards]
    if len(set(columns)) != len(columns):
        raise ValueError(f"a metric is requested twice: {columns}")
    with ScoreWriter(Path(out), columns, resume=resume, overwrite=overwrite) as writer:
        todo = [r for r in records if r.story_id not in writer.done]
        if writer.done and todo and progress:
            print(f"resuming {out}: {len(records) - len(todo)} of {len(records)} stories already scored",
                  file=sys.stderr)
        for reward in rewards if todo else ():
            reward.setup()  # models load only when there is something to score
        score_batches(rewards, todo, writer, batch_size=batch_size, progress=progress)
        return len(todo)


def make_metric(spec: str | Mapping[str, Any], image_root: str | None = None) -> Any:
    """A reward to score with, from ``spec``: a reward config file (YAML,
    ``reward: <name>`` plus options), a registered reward's name (its
    default options) or an inline config ``{reward: <name>, ...options}``.
    ``image_root`` is given to a reward that declares the option and sets
    none. Models are not loaded yet. Errors are ValueErrors."""
    from storyrl.config import option_info
    from storyrl.rewards import REWARDS, get_reward_class, load_reward_config

    if isinstance(spec, str):
        if spec in REWARDS and not Path(spec).is_file():
            name, options = spec, {}
        elif Path(spec).is_file():
            reward = load_reward_config(spec)
            if image_root and "image_root" in _declared(type(reward)) and reward.args.image_root is None:
                reward = load_reward_config(spec, overrides={"image_root": image_root})
            return reward
        else:
            raise ValueError(f"{spec!r} is neither a reward config file nor a reward ({', '.join(REWARDS.names())})")
    elif isinstance(spec, Mapping) and isinstance(spec.get("reward"), str):
        name, options = spec["reward"], {k: v for k, v in spec.items() if k != "reward"}
    else:
        raise ValueError(f"a metric is a reward config file, a reward name or a mapping with 'reward: <name>', "
                         f"got {spec!r}")
    try:
        cls = get_reward_class(name)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    if image_root and "image_root" in {info.name for info in option_info(cls.config_class)}:
        options = {"image_root": image_root, **options}
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _declared(cls: type) -> set[str]:
    from storyrl.config import option_info

    return {info.name for info in option_info(cls.config_class)}
