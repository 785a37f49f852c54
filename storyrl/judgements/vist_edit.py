"""VIST-Edit (Hsu et al. 2019, ``tingyaohsu/VIST-Edit``): machine stories of
AREL and GLAC and their human edits, used by the VHED paper (§5.1) as
preference pairs: every human edit is preferred to the machine story it
edits (AREL-edit and GLAC-edit, all splits; 14,905 pairs in the paper).

Layout: ``ROOT/AREL/{train,dev,test}/*.json`` and ``ROOT/GLAC/...`` (at least
one of the two model folders; a split folder may be missing). One file is one
machine story::

    {"photo_sequence_id": "...", "photo_sequence_ids": [...],
     "auto_story_text_normalized": "we had ... .",
     "edited_stories": [{"worker_id": ..., "normalized_edited_story_text_sent": ["sent .", ...]}, ...],
     "data_split": "dev", "model": "AREL", "album_id": "8139"}

Texts are compared in normalised form, as the paper's counts imply: the
machine story is ``auto_story_text_normalized``, an edit is its
``normalized_edited_story_text_sent`` joined by single spaces.

An edit identical to the machine story (after joining, whitespace aside) is KEPT: the paper
pairs every edited story (14,905 edited stories → 14,905 pairs), so such a
pair is in the data and, its two stories being the same, scores a tie —
wrong for every metric (Eq. 1). :attr:`VistEditData.identical` counts them so
a report can say how much of the accuracy ceiling they take.

The subset of a pair is ``<model folder>-edit``; a file whose ``model`` field
names another model is an error. Faults raise a one-line
:class:`~storyrl.judgements.JudgementDataError` naming the file (and edit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.input_text import json_loads, read_text
from storyrl.judgements import JudgementDataError
from storyrl.judgements.pairs import PreferencePair

__all__ = ["MODELS", "SPLITS", "VistEditData", "VistEditStory", "load_vist_edit", "vist_edit_pairs"]

MODELS = ("AREL", "GLAC")
SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class VistEditStory:
    model: str
    split: str
    photo_sequence_id: str
    photo_ids: tuple[str, ...] | None
    machine: str
    edits: tuple[str, ...]
    path: Path


@dataclass
class VistEditData:
    stories: list[VistEditStory]
    root: Path
    #: edits identical to the machine story (kept; see the module docstring)
    identical: int = 0
    files: dict[str, int] = field(default_factory=dict)  # per model folder


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise JudgementDataError(f"{where}: {key!r} must be a non-empty string")
    return value


def _story(obj: Any, path: Path, model: str, split: str) -> VistEditStory:
    where = str(path)
    if not isinstance(obj, dict):
        raise JudgementDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    named = obj.get("model")
    if named is not None and str(named).upper() != model.upper():
        raise JudgementDataError(f"{where}: 'model' is {named!r} but the file is under {model}/")
    machine = _text(obj.get("auto_story_text_normalized"), where, "auto_story_text_normalized")
    edited = obj.get("edited_stories")
    if not isinstance(edited, list):
        raise JudgementDataError(f"{where}: 'edited_stories' must be a list")
    edits = []
    for k, edit in enumerate(edited, start=1):
        at = f"{where}: edited_stories[{k}]"
        sents = edit.get("normalized_edited_story_text_sent") if isinstance(edit, dict) else None
        if not isinstance(sents, list) or not sents or not all(isinstance(s, str) for s in sents):
            raise JudgementDataError(f"{at}: 'normalized_edited_story_text_sent' must be a non-empty list of strings")
        text = " ".join(s.strip() for s in sents if s.strip())
        if not text:
            raise JudgementDataError(f"{at}: the edited story is empty")
        edits.append(text)
    ids = obj.get("photo_sequence_ids")
    photo_ids = tuple(str(i) for i in ids) if isinstance(ids, list) else None
    return VistEditStory(model=model, split=split, photo_sequence_id=str(obj.get("photo_sequence_id", path.stem)),
                         photo_ids=photo_ids, machine=machine, edits=tuple(edits), path=path)


def load_vist_edit(root: str | os.PathLike) -> VistEditData:
    """Read every story file under ``root`` (module docstring)."""
    root = Path(root)
    models = [m for m in MODELS if (root / m).is_dir()]
    if not models:
        raise JudgementDataError(f"{root}: no AREL/ or GLAC/ folder (a VIST-Edit root holds AREL/ and GLAC/)")
    stories, files = [], {}
    for model in models:
        paths = [(split, p) for split in SPLITS for p in sorted((root / model / split).glob("*.json"))]
        if not paths:
            raise JudgementDataError(f"{root / model}: no {'/, '.join(SPLITS)}/*.json files")
        files[model] = len(paths)
        for split, path in paths:
            try:
                obj = json_loads(read_text(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise JudgementDataError(f"{path}: cannot read: {exc}") from None
            except json.JSONDecodeError as exc:
                raise JudgementDataError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
            stories.append(_story(obj, path, model, split))
    identical = sum(edit.split() == s.machine.split() for s in stories for edit in s.edits)
    return VistEditData(stories=stories, root=root, identical=identical, files=files)


def vist_edit_pairs(data: VistEditData) -> list[PreferencePair]:
    """Every edit preferred to its machine story; subset ``<model>-edit``;
    context ``story_id`` = the photo sequence id, ``image_ids`` = its photos."""
    return [
        PreferencePair(better=edit, worse=s.machine, subsets=(f"{s.model}-edit",), story_id=s.photo_sequence_id,
                       image_ids=s.photo_ids, source=f"{s.path}: edited_stories[{k}]")
        for s in data.stories for k, edit in enumerate(s.edits, start=1)
    ]
