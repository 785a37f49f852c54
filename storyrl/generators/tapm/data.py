"""Training and generation data for TAPM: stories with image keys and one
sentence per image."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TapmExample", "load_examples", "load_records", "split_story"]

logger = logging.getLogger(__name__)


def _is_vist_sis(path: Path) -> bool:
    if path.suffix != ".json":
        return False
    with open(path, encoding="utf-8") as f:
        head = f.read(4096)
    return '"annotations"' in head


def load_records(path: str | os.PathLike):
    """Story records from a VIST story-in-sequence file (``storyrl.datasets.load_vist_sis``)
    or a storyrl story file (``storyrl.data.load_stories``; JSONL records with
    ``images`` or ``image_ids``)."""
    path = Path(path)
    if _is_vist_sis(path):
        from storyrl.datasets import load_vist_sis

        return load_vist_sis(path)
    from storyrl.data import load_stories

    return load_stories(path)


@dataclass
class TapmExample:
    story_id: str
    keys: list[str]  # feature-store keys of the images, in story order
    sentences: list[str]  # one per image


def split_story(story: str, n: int) -> list[str] | None:
    """``n`` sentences from a story: its sentences when there are ``n``; with
    more, consecutive sentences merged into ``n`` near-equal groups; None with fewer."""
    from storyrl.text import split_sentences

    sentences = [s.strip() for s in split_sentences(story) if s.strip()]
    if len(sentences) < n:
        return None
    groups, start = [], 0
    for i in range(n):
        end = start + (len(sentences) - start) // (n - i)
        groups.append(" ".join(sentences[start:end]))
        start = end
    return groups


def _vist_sentences(path: Path) -> dict[str, list[str]]:
    # load_vist_sis joins the storylets; TAPM needs each image's own text.
    data = json.loads(path.read_text(encoding="utf-8"))
    by_story: dict[str, list[tuple[int, str]]] = {}
    for ann in data["annotations"]:
        for item in ann if isinstance(ann, list) else [ann]:
            by_story.setdefault(str(item["story_id"]), []).append(
                (int(item["worker_arranged_photo_order"]), str(item["text"]).strip()))
    return {k: [t for _, t in sorted(v)] for k, v in by_story.items()}


def load_examples(paths: list[str]) -> list[TapmExample]:
    """Examples of every file, in file order; stories that cannot give one
    sentence per image are skipped (logged)."""
    from storyrl.generators.tapm.features import image_keys

    examples, skipped = [], 0
    for name in paths:
        path = Path(name)
        records = load_records(path)
        per_image = _vist_sentences(path) if _is_vist_sis(path) else {}
        for record in records:
            keys = image_keys(record)
            sentences = per_image.get(record.story_id) or split_story(record.story, len(keys))
            if sentences is None or len(sentences) != len(keys):
                skipped += 1
                continue
            examples.append(TapmExample(record.story_id, keys, sentences))
    if skipped:
        logger.warning("TAPM data: skipped %d stories with fewer sentences than images", skipped)
    return examples
