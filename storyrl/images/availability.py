"""Which stories' image sequences can be read.

A vision-language run needs every image of every story: ``storyrl train``
refuses a dataset with one image it cannot find, and an image that is
there but cannot be decoded stops training when its row is first read.
Public downloads miss a few photos (VIST's archives do), so
:func:`check_sequences` sorts records into the ones whose images all
resolve (and, with ``decode``, decode) and the ones left out, each with the
first image at fault and why. Each distinct image file is read once, by a
few threads (PIL releases the GIL while it decodes).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from storyrl.data import StoryRecord
from storyrl.images.decode_worker import READ_ERRORS, failure_reason, open_rgb
from storyrl.images.loading import IMAGE_EXTENSIONS, ImageError, resolve_images

__all__ = ["SequenceCheck", "check_sequences"]

#: The reasons :attr:`SequenceCheck.reasons` counts.
NOT_FOUND, UNREADABLE, NO_IMAGES = "image not found", "image unreadable", "no images"


@dataclass
class SequenceCheck:
    """The records whose images can all be read, and the others."""

    kept: list[StoryRecord] = field(default_factory=list)
    #: story id -> the first image at fault and why
    dropped: dict[str, str] = field(default_factory=dict)
    #: stories left out per kind of fault (:data:`NOT_FOUND`, :data:`UNREADABLE`, :data:`NO_IMAGES`)
    reasons: Counter = field(default_factory=Counter)
    #: distinct image files checked
    images: int = 0


def _resolve(record: StoryRecord, image_root) -> tuple[list[str] | None, str | None, str | None]:
    """(paths, None, None), or (None, kind, message) when a path cannot be resolved."""
    if not record.images and not record.image_ids:
        return None, NO_IMAGES, "story has no images or image_ids"
    try:
        return [str(p) for p in resolve_images(record.images, record.image_ids, image_root, IMAGE_EXTENSIONS)], \
            None, None
    except ImageError as exc:
        return None, NOT_FOUND, str(exc)


def _read(path: str) -> str | None:
    """None when ``path`` decodes as RGB, else why not."""
    try:
        open_rgb(path)
    except READ_ERRORS as exc:
        return failure_reason(exc)
    return None


def check_sequences(records: Sequence[StoryRecord], image_root: str | os.PathLike | None = None, *,
                    decode: bool = True, workers: int = 4,
                    progress: Callable[[int], Any] | None = None) -> SequenceCheck:
    """Sort ``records`` (module docs): a record is kept when each of its
    images (paths, or ids looked up under ``image_root``) exists and, with
    ``decode``, decodes. Order is kept. ``progress(n)`` is called as images
    are read."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    result = SequenceCheck()
    resolved = [_resolve(r, image_root) for r in records]
    paths = sorted({p for seq, _, _ in resolved if seq for p in seq})
    result.images = len(paths)
    failed: dict[str, str] = {}
    if decode and paths:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for path, reason in zip(paths, pool.map(_read, paths)):
                if reason is not None:
                    failed[path] = reason
                if progress is not None:
                    progress(1)
    for record, (seq, kind, message) in zip(records, resolved):
        if seq is None:
            result.dropped[record.story_id], result.reasons[kind] = message, result.reasons[kind] + 1
            continue
        bad = next((p for p in seq if p in failed), None)
        if bad is not None:
            result.dropped[record.story_id] = f"{bad}: {failed[bad]}"
            result.reasons[UNREADABLE] += 1
        else:
            result.kept.append(record)
    return result
