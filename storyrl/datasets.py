"""Loaders of the public datasets' own layouts into story sets.

* VIST story-in-sequence annotations (:func:`load_vist_sis`);
* the VWP test split CSV (:func:`load_vwp`).

Both return :class:`storyrl.data.StoryRecord` lists and raise
:class:`storyrl.data.StoryDataError` on malformed input, like the story-set
readers of :mod:`storyrl.data` (which re-exports these loaders).
"""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from pathlib import Path

from storyrl.data import StoryDataError, StoryRecord
from storyrl.input_text import ENCODING, csv_problem, json_loads, open_text, read_text

__all__ = ["DATA_FORMATS", "is_vist_sis", "load_records", "load_some_records", "load_vist_sis", "load_vwp", "read_vist_sis",
           "vist_sis_records"]

#: What :func:`load_records` reads; ``auto`` tells them apart by content.
DATA_FORMATS = ("auto", "records", "vist-sis", "vwp")


def load_records(path: str | os.PathLike, data_format: str = "auto") -> list[StoryRecord]:
    """Stories with their images from any storyrl input: ``records`` (the
    JSON/JSONL story sets of :func:`storyrl.data.load_stories`), ``vist-sis``
    or ``vwp``; ``auto`` picks ``vwp`` for a .csv file, ``vist-sis`` for a
    JSON object with an ``annotations`` list, else ``records``."""
    from storyrl.data import load_stories

    if data_format not in DATA_FORMATS:
        raise ValueError(f"data format must be one of {', '.join(DATA_FORMATS)}, got {data_format!r}")
    path = Path(path)
    if data_format == "auto":
        data_format = "vwp" if path.suffix.lower() == ".csv" else "vist-sis" if is_vist_sis(path) else "records"
    if data_format == "vwp":
        return load_vwp(path)
    if data_format == "vist-sis":
        return load_vist_sis(path)
    return load_stories(path)


def load_some_records(path: str | os.PathLike, data_format: str = "auto", limit: int | None = None
                      ) -> list[StoryRecord]:
    """The first ``limit`` records (all with None) of :func:`load_records`;
    a ValueError naming the file when there is none (for jobs that need
    input: sweeps, RL runs, ablations)."""
    records = load_records(path, data_format)
    records = records[:limit] if limit else records
    if not records:
        raise ValueError(f"{path}: no stories")
    return records


def is_vist_sis(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a JSON object with an ``annotations`` list (False
    when unreadable: the reader then says what is wrong)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            if f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()[:1] != b"{":
                return False
            f.seek(0)
            data = json_loads(f.read().decode(ENCODING))
    except (OSError, ValueError):
        return False  # the records reader reports what is wrong
    return isinstance(data, dict) and isinstance(data.get("annotations"), list)


def load_vist_sis(path: str | os.PathLike) -> list[StoryRecord]:
    """VIST story-in-sequence annotations (``test.story-in-sequence.json``):
    one record per story id with its 5 image ids in story order and the human
    story (the storylets' ``text`` joined by spaces, as in the d_HM files)."""
    return vist_sis_records(read_vist_sis(path))


def read_vist_sis(path: str | os.PathLike) -> dict[str, list[dict]]:
    """The storylets of a VIST story-in-sequence file by story id, in photo
    order, validated (for callers that need each image's own text)."""
    path = Path(path)
    try:
        data = json_loads(read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoryDataError(path, f"cannot read: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise StoryDataError(path, "not a VIST SIS file: no 'annotations' list")
    storylets: dict[str, list[dict]] = defaultdict(list)
    for k, ann in enumerate(data["annotations"]):
        items = ann if isinstance(ann, list) else [ann]
        for item in items:
            if not isinstance(item, dict):
                raise StoryDataError(path, "annotation is not an object", f"annotations[{k}]")
            for key in ("story_id", "photo_flickr_id", "worker_arranged_photo_order", "text"):
                if key not in item:
                    raise StoryDataError(path, f"missing field '{key}'", f"annotations[{k}]")
            if _photo_order(item["worker_arranged_photo_order"]) is None:
                raise StoryDataError(path, f"worker_arranged_photo_order {item['worker_arranged_photo_order']!r} "
                                           "is not an integer", f"annotations[{k}]")
            storylets[str(item["story_id"])].append(item)
    for story_id, items in storylets.items():
        items.sort(key=lambda it: _photo_order(it["worker_arranged_photo_order"]))
        orders = [_photo_order(it["worker_arranged_photo_order"]) for it in items]
        if orders != list(range(len(items))):
            raise StoryDataError(path, f"photo orders {orders} are not 0..{len(items) - 1}", repr(story_id))
    return dict(storylets)


def _photo_order(value) -> int | None:
    """A photo order as an int (VIST writes ints; "3" and 3.0 read as 3), or
    None when it is no whole number (1.5 is refused, never rounded)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def vist_sis_records(storylets: dict[str, list[dict]]) -> list[StoryRecord]:
    """The records of :func:`read_vist_sis`'s storylets (see :func:`load_vist_sis`)."""
    return [
        StoryRecord(
            story_id,
            " ".join(str(it["text"]).strip() for it in items),
            image_ids=[str(it["photo_flickr_id"]) for it in items],
        )
        for story_id, items in storylets.items()
    ]


def load_vwp(path: str | os.PathLike, text_column: str = "story") -> list[StoryRecord]:
    """The VWP test split CSV (``vwp_v2.1_test.csv`` layout: ``scene_full_id``,
    ``story``, ``link0``..``link9`` image URLs, ``select_imgs_list``).

    Story ids are ``<scene_full_id>;<k>`` with ``k`` the story's position among
    the rows of its scene (the id scheme of the d_HM VWP files); images are the
    non-empty ``linkN`` cells in order; ``image_ids`` come from
    ``select_imgs_list`` when present.
    """
    path = Path(path)
    try:
        with open_text(path) as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
    except (OSError, UnicodeDecodeError) as exc:
        raise StoryDataError(path, f"cannot read: {exc}") from exc
    except csv.Error as exc:
        raise StoryDataError(path, f"malformed CSV: {csv_problem(exc)}", f"at line {reader.reader.line_num}") from None
    if rows and ("scene_full_id" not in rows[0] or text_column not in rows[0]):
        raise StoryDataError(path, f"not a VWP split: needs 'scene_full_id' and '{text_column}' columns")
    per_scene: dict[str, int] = defaultdict(int)
    records = []
    for lineno, row in enumerate(rows, 2):
        scene = row["scene_full_id"].strip()
        if not scene:
            raise StoryDataError(path, "empty scene_full_id", f"at line {lineno}")
        story_id = f"{scene};{per_scene[scene]}"
        per_scene[scene] += 1
        links = [row[f"link{k}"].strip() for k in range(10) if (row.get(f"link{k}") or "").strip()]
        image_ids = None
        if (row.get("select_imgs_list") or "").strip():
            image_ids = _parse_id_list(row["select_imgs_list"], path, f"{story_id!r} at line {lineno}")
        records.append(StoryRecord(story_id, row[text_column], images=links or None, image_ids=image_ids))
    return records


def _parse_id_list(cell: str, path: Path, record: str) -> list[str]:
    import ast

    try:
        value = ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        value = [v for v in cell.replace(",", " ").split() if v]
    if isinstance(value, (str, int)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise StoryDataError(path, f"select_imgs_list is not a list: {cell!r}", record)
    return [str(v) for v in value]
