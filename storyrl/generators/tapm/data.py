"""Training and generation data for TAPM: stories with image keys and one
sentence per image."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TapmExample", "load_examples", "split_story"]

logger = logging.getLogger(__name__)


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


def load_examples(paths: list[str]) -> list[TapmExample]:
    """Examples of every file, in file order; stories that cannot give one
    sentence per image are skipped (logged)."""
    from storyrl.datasets import is_vist_sis, load_records, read_vist_sis, vist_sis_records
    from storyrl.generators.tapm.features import image_keys

    examples, skipped = [], 0
    for name in paths:
        path = Path(name)
        if is_vist_sis(path):  # each image's own storylet text, not the joined story
            storylets = read_vist_sis(path)
            records = vist_sis_records(storylets)
            per_image = {sid: [str(it["text"]).strip() for it in items] for sid, items in storylets.items()}
        else:
            records, per_image = load_records(path), {}
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
