"""Story sets and score tables on disk.

Formats
-------
* Story set, JSON object ``{story_id: story}`` (the authors' tools and
  ``shared/data/dhm``).
* Story set, JSONL: one record per line with ``story_id`` and ``story`` and
  optionally ``images`` (paths), ``image_ids``, ``reference`` (human story),
  ``noun_phrases`` (precomputed, for GROOViST) and ``nouns`` (precomputed,
  for RoViST-VG).
* Score table, CSV: ``story_id`` plus one column per metric; an empty cell (or
  ``nan``) means unscorable.
* VIST story-in-sequence annotations and the VWP test split: loaded by
  :mod:`storyrl.datasets` (``load_vist_sis``, ``load_vwp``).

Every malformed input raises :class:`StoryDataError` naming the file, the
record and the problem; nothing is dropped silently.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from storyrl.input_text import csv_problem, json_loads, read_text

__all__ = [
    "StoryDataError",
    "StoryRecord",
    "ScoreTable",
    "ScoreWriter",
    "load_stories",
    "load_id_lists",
    "save_stories",
    "read_scores",
    "write_scores",
    "parse_score_csv",
    "check_story_ids",
    "METRIC_ALIASES",
]


class StoryDataError(ValueError):
    """A malformed story or score file: says which file, which record, what."""

    def __init__(self, path: str | os.PathLike, problem: str, record: Any = None) -> None:
        self.path, self.problem, self.record = str(path), problem, record
        where = f"{self.path}" if record is None else f"{self.path}: record {record}"
        super().__init__(f"{where}: {problem}")


@dataclass
class StoryRecord:
    story_id: str
    story: str
    images: list[str] | None = None
    image_ids: list[str] | None = None
    reference: str | None = None
    references: list[str] | None = None  # several human stories (reference-based metrics)
    noun_phrases: list[str] | None = None  # precomputed (the authors' NP files), skips spaCy
    nouns: list[str] | None = None  # precomputed single nouns (RoViST-VG), skips spaCy

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


# ---------------------------------------------------------------------------
# Story sets
# ---------------------------------------------------------------------------


def _no_duplicate_keys(path: Path):
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise StoryDataError(path, "duplicate story id", record=repr(key))
            seen.add(key)
        return dict(pairs)

    return hook


def _string_list(value: Any, path: Path, record: str, name: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
        raise StoryDataError(path, f"'{name}' must be a list of strings", record)
    return [str(v) for v in value]


def load_stories(path: str | os.PathLike) -> list[StoryRecord]:
    """Read a story set: a ``.jsonl`` file of records, or a JSON object
    ``{story_id: story}`` (any other extension)."""
    path = Path(path)
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise StoryDataError(path, f"cannot read: {exc}") from exc
    if path.suffix == ".jsonl":
        records = _parse_jsonl(text, path)
    else:
        records = _parse_json_object(text, path)
    check_story_ids((r.story_id for r in records), path)
    return records


def _parse_json_object(text: str, path: Path) -> list[StoryRecord]:
    try:
        data = json_loads(text, object_pairs_hook=_no_duplicate_keys(path))
    except json.JSONDecodeError as exc:
        raise StoryDataError(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise StoryDataError(path, f"expected a JSON object {{story_id: story}}, got {type(data).__name__}")
    records = []
    for story_id, story in data.items():
        if not isinstance(story, str):
            raise StoryDataError(path, f"story must be a string, got {type(story).__name__}", repr(story_id))
        records.append(StoryRecord(story_id, story))
    return records


def load_id_lists(path: str | os.PathLike, what: str = "list") -> dict[str, list[str]]:
    """A JSON object ``{story_id: [strings]}``, e.g. a story → image ids map or
    the authors' noun-phrase files. ``what`` names the lists in errors."""
    path = Path(path)
    try:
        data = json_loads(read_text(path), object_pairs_hook=_no_duplicate_keys(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise StoryDataError(path, f"cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise StoryDataError(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise StoryDataError(path, f"expected a JSON object {{story_id: [{what}]}}, got {type(data).__name__}")
    return {str(k): _string_list(v, path, repr(k), what) for k, v in data.items()}


def _parse_jsonl(text: str, path: Path) -> list[StoryRecord]:
    records: list[StoryRecord] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"at line {lineno}"
        try:
            obj = json_loads(line)
        except json.JSONDecodeError as exc:
            raise StoryDataError(path, f"invalid JSON: {exc.msg}", where) from exc
        if not isinstance(obj, dict):
            raise StoryDataError(path, "a record must be a JSON object", where)
        for key in ("story_id", "story"):
            if key not in obj:
                raise StoryDataError(path, f"missing field '{key}'", where)
        story_id = obj["story_id"]
        if not isinstance(story_id, (str, int)) or isinstance(story_id, bool):
            raise StoryDataError(path, "'story_id' must be a string", where)
        story_id = str(story_id)
        where = f"{story_id!r} at line {lineno}"
        if story_id in seen:
            raise StoryDataError(path, f"duplicate story id (first at line {seen[story_id]})", where)
        seen[story_id] = lineno
        if not isinstance(obj["story"], str):
            raise StoryDataError(path, f"story must be a string, got {type(obj['story']).__name__}", where)
        reference = obj.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise StoryDataError(path, "'reference' must be a string", where)
        records.append(
            StoryRecord(
                story_id,
                obj["story"],
                images=_string_list(obj.get("images"), path, where, "images"),
                image_ids=_string_list(obj.get("image_ids"), path, where, "image_ids"),
                noun_phrases=_string_list(obj.get("noun_phrases"), path, where, "noun_phrases"),
                nouns=_string_list(obj.get("nouns"), path, where, "nouns"),
                reference=reference,
                references=_string_list(obj.get("references"), path, where, "references"),
            )
        )
    return records


def save_stories(records: Iterable[StoryRecord], path: str | os.PathLike) -> None:
    """Write records as JSONL, or as ``{story_id: story}`` JSON for other suffixes."""
    path = Path(path)
    records = list(records)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps({r.story_id: r.story for r in records}, indent=1, ensure_ascii=False), encoding="utf-8")


# ---------------------------------------------------------------------------
# Score tables
# ---------------------------------------------------------------------------

#: Column names of the authors' score files, mapped to storyrl metric names.
METRIC_ALIASES = {
    "R_score": "repetition",
    "non_redun_score": "repetition",
    "C_score": "coherence",
    "G_score": "groovist",
}


@dataclass
class ScoreTable:
    """Per-story scores: ``scores[metric][story_id] -> float`` (NaN = unscorable)."""

    ids: list[str] = field(default_factory=list)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def metrics(self) -> list[str]:
        return list(self.scores)

    def merge(self, other: ScoreTable, source: str = "") -> ScoreTable:
        """Add the columns of ``other`` (a metric may come from one table only)."""
        for metric in other.scores:
            if metric in self.scores:
                raise ValueError(f"{source or 'score table'}: metric {metric!r} given twice")
        known = set(self.ids)
        self.ids.extend(i for i in other.ids if i not in known)
        self.scores.update(other.scores)
        return self

    def restricted(self, ids: Sequence[str]) -> ScoreTable:
        """A table of the rows of ``ids`` only, in that order (ids it lacks
        are left out): a file may hold rows of a run with a larger limit."""
        present = set(self.ids)
        keep = [sid for sid in ids if sid in present]
        return ScoreTable(keep, {m: {sid: col[sid] for sid in keep if sid in col} for m, col in self.scores.items()})


def _parse_score(value: str, path: Path, record: str, metric: str) -> float:
    value = value.strip()
    if value == "" or value.lower() in ("nan", "none", "null"):
        return math.nan
    try:
        return float(value)
    except ValueError:
        raise StoryDataError(path, f"{metric}: not a number: {value!r}", record) from None


def read_scores(path: str | os.PathLike, metric: str | None = None, require: Sequence[str] = ()) -> ScoreTable:
    """Read a score table; ``require``: metric columns it must have
    (ValueError naming the file and the missing columns). Formats: see
    :func:`_read_score_file`."""
    table = _read_score_file(path, metric)
    missing = [m for m in require if m not in table.scores]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} column (it has {table.metrics})")
    return table


def _read_score_file(path: str | os.PathLike, metric: str | None = None) -> ScoreTable:
    """Read a score table.

    * CSV with ``story_id`` and metric columns (the authors' ``R_score`` /
      ``C_score`` / ``non_redun_score`` are renamed, see ``METRIC_ALIASES``).
      With ``metric``, a single-score CSV's column is renamed to it.
    * JSON object ``{story_id: score}`` (the authors' GROOViST output): needs
      ``metric``; ``null`` means unscorable.
    """
    path = Path(path)
    if path.suffix == ".json":
        if metric is None:
            raise StoryDataError(path, "a {story_id: score} JSON file needs a metric name (METRIC=PATH)")
        try:
            data = json_loads(read_text(path), object_pairs_hook=_no_duplicate_keys(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoryDataError(path, f"cannot read: {exc}") from exc
        if not isinstance(data, dict):
            raise StoryDataError(path, "expected a JSON object {story_id: score}")
        column = {}
        for sid, value in data.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise StoryDataError(path, f"score must be a number or null, got {value!r}", repr(sid))
            column[sid] = math.nan if value is None else float(value)
        return ScoreTable(list(column), {metric: column})
    try:
        text = read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise StoryDataError(path, f"cannot read: {exc}") from exc
    return parse_score_csv(text, path, metric)


def parse_score_csv(
    text: str, path: str | os.PathLike, metric: str | None = None, header: Sequence[str] | None = None
) -> ScoreTable:
    """Parse and validate a score CSV's text: the header (equal to ``header``
    when given), the cell count of every row, every score cell (a number,
    empty or ``nan``) and unique story ids. Errors name the file and line."""
    path = Path(path)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        rows = list(reader)
    except csv.Error as exc:
        raise StoryDataError(path, f"malformed CSV: {csv_problem(exc)}", f"at line {reader.line_num}") from None
    if header is not None and rows and rows[0] != list(header):
        raise StoryDataError(path, f"header {rows[0]} differs from {list(header)}", "at line 1")
    if not rows or "story_id" not in rows[0]:
        raise StoryDataError(path, "a score CSV needs a header with a 'story_id' column")
    columns = rows[0]
    id_col = columns.index("story_id")
    value_cols = [(k, METRIC_ALIASES.get(name, name)) for k, name in enumerate(columns) if k != id_col]
    if metric is not None:
        if len(value_cols) != 1:
            raise StoryDataError(path, f"METRIC={path} needs a CSV with exactly one score column")
        value_cols = [(value_cols[0][0], metric)]
    table = ScoreTable(scores={name: {} for _, name in value_cols})
    seen: set[str] = set()
    for lineno, row in enumerate(rows[1:], 2):
        if not row:
            continue
        if len(row) != len(columns):
            raise StoryDataError(path, f"expected {len(columns)} cells, got {len(row)}", f"at line {lineno}")
        sid = row[id_col]
        where = f"{sid!r} at line {lineno}"
        if sid in seen:
            raise StoryDataError(path, "duplicate story id", where)
        seen.add(sid)
        table.ids.append(sid)
        for k, name in value_cols:
            table.scores[name][sid] = _parse_score(row[k], path, where, name)
    return table


def _format_score(value: float) -> str:
    return "" if value is None or math.isnan(value) else repr(float(value))


def _csv_text(rows: Iterable[Sequence[str]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue()


def _score_rows(ids: Sequence[str], columns: Mapping[str, Sequence[float]], metrics: Sequence[str]):
    return ([sid, *(_format_score(columns[m][k]) for m in metrics)] for k, sid in enumerate(ids))


#: The csv module refuses to read a cell longer than this (its default limit).
MAX_CELL_CHARS = csv.field_size_limit()


def check_story_ids(ids: Iterable[str], source: str | os.PathLike) -> None:
    """Story ids must survive a score table: valid Unicode text (no lone
    surrogates, which UTF-8 cannot encode) no longer than the csv module reads
    back. StoryDataError naming ``source`` and the story otherwise."""
    for sid in ids:
        try:
            sid.encode("utf-8")
        except UnicodeEncodeError:
            raise StoryDataError(
                source, "story id contains a lone surrogate (not valid Unicode text)", repr(sid)[:80]
            ) from None
        if len(sid) > MAX_CELL_CHARS:
            raise StoryDataError(
                source, f"story id is {len(sid)} characters long; score tables hold ids of at most {MAX_CELL_CHARS}",
                repr(sid[:40]) + "...",
            )


class ScoreWriter:
    """Append rows to a score CSV as they are computed, each flushed at once,
    so that a killed run keeps everything scored so far.

    The file is locked for the writer's lifetime (a second writer fails at
    once). With ``resume`` an existing file is validated first (header equal
    to ``story_id`` + ``metrics``, cell counts, numeric cells; an error names
    the line), then a row cut by a kill is dropped by an atomic rewrite; the
    ids already there are in :attr:`done`. ``overwrite`` empties an existing
    file; with neither, an existing non-empty file is an error.
    """

    def __init__(
        self, path: str | os.PathLike, metrics: Sequence[str], resume: bool = False, overwrite: bool = False
    ) -> None:
        from storyrl.output_files import LockedOutput

        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        self.path = Path(path)
        self.metrics = list(metrics)
        self.header = ["story_id", *self.metrics]
        #: story ids already in the file (when resuming)
        self.done: set[str] = set()
        self._out = LockedOutput(self.path, "keep" if resume else "truncate" if overwrite else "refuse")
        try:
            complete, partial = self._out.read()
            if complete:
                try:
                    self.done = set(parse_score_csv(complete, self.path, header=self.header).ids)
                except StoryDataError as exc:
                    raise StoryDataError(self.path, f"cannot resume: {exc.problem}", exc.record) from None
            if partial:
                self._out.replace(complete)  # after validation: never drops a row of a refused file
            #: this writer started the file: a run that fails before its
            #: first row removes it again (a header-only file would block a rerun)
            self._started = not complete
            if self._started:
                self._out.write(_csv_text([self.header]))
        except BaseException:
            self._out.close()
            raise
        #: rows written by this writer
        self.rows_written = 0

    def write(self, ids: Sequence[str], columns: Mapping[str, Sequence[float]]) -> None:
        """Append one row per story id (flushed before returning)."""
        self._out.write(_csv_text(_score_rows(ids, columns, self.metrics)))
        self.rows_written += len(ids)

    def close(self, failed: bool = False) -> None:
        if failed and self._started and not self.rows_written:
            self._out.discard()
        else:
            self._out.close()

    def __enter__(self) -> ScoreWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def write_scores(
    path: str | os.PathLike, ids: Sequence[str], columns: Mapping[str, Sequence[float]], overwrite: bool = False
) -> None:
    """Write a whole score table as CSV, atomically and under the file's lock;
    an existing non-empty file is replaced only with ``overwrite``."""
    from storyrl.output_files import replace_file

    metrics = list(columns)
    text = _csv_text([["story_id", *metrics], *_score_rows(ids, columns, metrics)])
    replace_file(path, text, overwrite=overwrite)
