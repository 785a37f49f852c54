"""RaCCoon (Inan et al. 2021, COSMiC; ``Merterm/COSMic``, MIT): expert ratings
of machine captions of Conceptual Captions images, in ``RaCCoon.tsv``.

A row is one annotator's judgement of one (image URL, caption) pair. Columns
read (a missing one is an error; others, e.g. ``other``/``cbWhen``, are not
used):

``id_annotation``, ``id_annotator``, ``caption``, ``url``
    identifiers, the caption text and the image URL (all non-empty).
``source``
    the coherence class the captioning model was asked for, then a number:
    ``Meta101``, ``True36``, ``Subjective_21``, ``Story878``, ``Action840``
    (an optional ``_`` between). Mapped to :data:`COHERENCE_CLASSES`:
    Meta → Meta, True → Visible (the paper's Visible: "the caption is true
    just by looking at the picture"), Subjective, Story, Action.
``cbBrokenImg``
    1 = the annotator could not see the image: the row is skipped (counted in
    :attr:`RaCCoonData.broken`), whatever else it holds.
rating columns (0/1 ticks)
    ``cbMetaGood``/``cbMetaBad`` (Meta, binary), ``cbVisible1``-``5`` (Visible,
    1-5), ``cbSubjectiveGood``/``cbSubjectiveBad`` (Subjective, binary),
    ``cbStory1``-``5`` (Story, 1-5). ``cb0``-``cb6`` are the labels the
    annotator ticked (read in the real file: cb0 Meta, cb1 Visible, cb2 Action,
    cb3 Subjective, cb4 Story, cb5/cb6 no ratings; every row with a rating group
    ticked also ticks that label) and are validated (0/1) but not used.

Which rating is the row's (what the file shows, and our reading of §3): the
annotator may tick several labels and rates the caption under each (row 2 of
the real file ticks Meta, Visible and Story and rates all three). The brief
of the metric is the caption's *intended* class (``source``; at test time the
captioning system's label), so a row's rating is the one in its source
class's group: 1-5 ticks → (r − 1) / 4, Good → 1, Bad → 0. A row with no
tick in that group (the annotator did not find the caption to be of its
intended class: 1,485 unbroken rows of the real file) is skipped as
``unrated``, or rated 0 with ``unrated="zero"`` (the caption failed its
goal); one with several ticks (e.g. both Good and Bad) is skipped as
``conflicting``. Action has no rating columns of its own; its
rows are skipped as ``action`` unless ``action_ratings="visible"`` reads them
from the Visible scale (146 of the 153 unbroken Action rows have a Visible
tick). The paper's one-hot labels and its 4,000 pairs cover the other four
classes only.

Images: the file names them by URL. With ``image_dir`` a row's image is the
file ``image_dir/<image_file_stem(url)>.<ext>`` (sha1 of the URL, any of
:data:`storyrl.images.loading.IMAGE_EXTENSIONS`: URL basenames are not unique,
818 for 898 URLs); with ``image_map`` (JSON object ``{url: path}`` or a TSV
with ``url`` and ``path`` columns, relative paths resolved against the map's
folder) the map decides and wins over ``image_dir``. A row whose image file is
missing is skipped as ``missing image``. Without either, records carry no
image and no image check is made.

Every row is validated; a fault raises a one-line
:class:`~storyrl.judgements.JudgementDataError` naming file, 1-based data row,
column and fault.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from storyrl.input_text import csv_problem, json_loads, open_text, read_text
from storyrl.judgements import JudgementDataError

__all__ = [
    "COHERENCE_CLASSES",
    "RATING_COLUMNS",
    "RaCCoonData",
    "RaCCoonRecord",
    "image_file_stem",
    "load_raccoon",
]

#: The five classes of ``source``, in the loader's order.
COHERENCE_CLASSES = ("Meta", "Visible", "Subjective", "Story", "Action")
_SOURCE_PREFIX = {"Meta": "Meta", "True": "Visible", "Subjective": "Subjective", "Story": "Story", "Action": "Action"}
_SOURCE = re.compile(r"^(Meta|True|Subjective|Story|Action)_?(\d+)$")

#: Rating columns per class: (column, normalised rating).
RATING_COLUMNS: dict[str, tuple[tuple[str, float], ...]] = {
    "Meta": (("cbMetaGood", 1.0), ("cbMetaBad", 0.0)),
    "Visible": tuple((f"cbVisible{r}", (r - 1) / 4) for r in range(1, 6)),
    "Subjective": (("cbSubjectiveGood", 1.0), ("cbSubjectiveBad", 0.0)),
    "Story": tuple((f"cbStory{r}", (r - 1) / 4) for r in range(1, 6)),
}
_TICK_COLUMNS = tuple(c for group in RATING_COLUMNS.values() for c, _ in group) + tuple(
    f"cb{i}" for i in range(7)
) + ("cbBrokenImg",)
_TEXT_COLUMNS = ("id_annotation", "id_annotator", "caption", "url", "source")
REQUIRED_COLUMNS = _TEXT_COLUMNS + _TICK_COLUMNS
_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")


@dataclass(frozen=True)
class RaCCoonRecord:
    id_annotation: str
    annotator: str
    caption: str
    url: str
    coherence: str  # one of COHERENCE_CLASSES
    source: str  # the raw `source` value
    rating: float  # in [0, 1]
    image: str | None  # resolved image file, None without image_dir/image_map
    row: int  # 1-based data row


@dataclass
class RaCCoonData:
    records: list[RaCCoonRecord]
    path: Path
    rows: int = 0
    classes: Counter = field(default_factory=Counter)  # every row's class (broken included)
    broken: int = 0
    broken_by_class: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows (unrated, conflicting, action, missing image)

    def summary(self) -> dict:
        return {
            "rows": self.rows,
            "records": len(self.records),
            "classes": dict(self.classes),
            "broken": self.broken,
            "skipped": dict(self.skipped),
        }


def image_file_stem(url: str) -> str:
    """The file stem of ``url``'s image in an ``image_dir``: sha1 of the URL."""
    return hashlib.sha1(url.encode("utf-8")).hexdigest()


def _fail(path: Path, row: int | None, message: str) -> JudgementDataError:
    where = f"row {row}: " if row is not None else ""
    return JudgementDataError(" ".join(f"{path.name}: {where}{message}".split()))


def _read_image_map(path: Path) -> dict[str, str]:
    base = path.parent
    text = read_text(path)
    if path.suffix.lower() == ".json":
        try:
            data = json_loads(text)
        except json.JSONDecodeError as exc:
            raise _fail(path, None, f"not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise _fail(path, None, "an image map must be a JSON object {url: path}")
        items = data.items()
    else:
        reader = csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            missing = [c for c in ("url", "path") if c not in (reader.fieldnames or [])]
            if missing:
                raise _fail(path, None, f"missing column(s) {', '.join(missing)} (an image map TSV needs url and path)")
            items = []
            for n, row in enumerate(reader, 1):
                if not row["url"] or not row["path"]:
                    raise _fail(path, n, "empty url or path")
                items.append((row["url"], row["path"]))
        except csv.Error as exc:
            raise _fail(path, max(reader.reader.line_num - 1, 0), f"malformed TSV: {csv_problem(exc)}") from None
    return {url: str(base / p) if not Path(p).is_absolute() else p for url, p in items}


def _find_in_dir(directory: Path, url: str) -> str | None:
    stem = image_file_stem(url)
    for ext in _EXTENSIONS:
        candidate = directory / (stem + ext)
        if candidate.is_file():
            return str(candidate)
    return None


def load_raccoon(
    path,
    *,
    image_dir=None,
    image_map=None,
    action_ratings: str = "skip",
    unrated: str = "skip",
) -> RaCCoonData:
    """Read and validate a RaCCoon TSV (see the module docs for the rules)."""
    if action_ratings not in ("skip", "visible"):
        raise ValueError(f"action_ratings must be 'skip' or 'visible', got {action_ratings!r}")
    if unrated not in ("skip", "zero"):
        raise ValueError(f"unrated must be 'skip' or 'zero', got {unrated!r}")
    path = Path(path)
    mapping = _read_image_map(Path(image_map)) if image_map is not None else None
    directory = Path(image_dir) if image_dir is not None else None
    if directory is not None and not directory.is_dir():
        raise FileNotFoundError(f"image_dir {directory} is not a directory")
    data = RaCCoonData(records=[], path=path)
    with open_text(path) as f:
        # The authors' TSV has no quoting: a caption's quote character is text.
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            _read_rows(path, reader, data, mapping, directory, action_ratings, unrated)
        except csv.Error as exc:
            raise _fail(path, max(reader.line_num - 1, 0), f"malformed TSV: {csv_problem(exc)}") from None
    return data


def _read_rows(path: Path, reader, data: RaCCoonData, mapping, directory, action_ratings: str, unrated: str) -> None:
    header = next(reader, None)
    if header is None:
        raise _fail(path, None, "empty file (no header)")
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise _fail(path, None, f"missing column(s): {', '.join(missing)}")
    index = {c: header.index(c) for c in REQUIRED_COLUMNS}
    for n, fields in enumerate(reader, 1):
        if not fields or fields == [""]:
            continue  # a blank line (e.g. trailing)
        if len(fields) != len(header):
            raise _fail(path, n, f"{len(fields)} fields for {len(header)} columns")
        record = _parse_row(path, n, fields, index, data, action_ratings, unrated)
        if record is None:
            continue
        if mapping is not None or directory is not None:
            image = mapping.get(record["url"]) if mapping is not None else None
            if image is None and directory is not None:
                image = _find_in_dir(directory, record["url"])
            if image is None or not Path(image).is_file():
                data.skipped["missing image"] += 1
                continue
            record["image"] = image
        data.records.append(RaCCoonRecord(**record, row=n))


def _parse_row(path: Path, n: int, fields: list[str], index: dict, data: RaCCoonData, action_ratings: str,
               unrated: str):
    get = {c: fields[i] for c, i in index.items()}
    for column in _TEXT_COLUMNS:
        if not get[column].strip():
            raise _fail(path, n, f"column {column!r}: empty")
    for column in _TICK_COLUMNS:
        if get[column] not in ("0", "1"):
            raise _fail(path, n, f"column {column!r}: {get[column][:40]!r} is not 0 or 1")
    match = _SOURCE.match(get["source"])
    if match is None:
        raise _fail(
            path, n, f"column 'source': {get['source'][:40]!r} is not Meta/True/Subjective/Story/Action + a number"
        )
    coherence = _SOURCE_PREFIX[match.group(1)]
    data.rows += 1
    data.classes[coherence] += 1
    if get["cbBrokenImg"] == "1":
        data.broken += 1
        data.broken_by_class[coherence] += 1
        return None
    scale = coherence
    if coherence == "Action":
        if action_ratings == "skip":
            data.skipped["action"] += 1
            return None
        scale = "Visible"
    ticked = [value for column, value in RATING_COLUMNS[scale] if get[column] == "1"]
    if not ticked and unrated == "zero":
        ticked = [0.0]
    if len(ticked) != 1:
        data.skipped["unrated" if not ticked else "conflicting"] += 1
        return None
    return {
        "id_annotation": get["id_annotation"],
        "annotator": get["id_annotator"],
        "caption": get["caption"],
        "url": get["url"],
        "coherence": coherence,
        "source": get["source"],
        "rating": ticked[0],
        "image": None,
    }
