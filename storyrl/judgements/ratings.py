"""Per-rater story ratings in VIST-Edit's ``Human_eval`` layout::

    team,story_id,album_id,workerId,focused,coherent,share,human,grounded,detailed,,,,,,

(one row per rater and story, aspect values 1–5, ``team`` the system, e.g.
``auto-gen``). Columns with an empty name (the file's trailing commas) are
ignored, whatever they hold. The story id, rater and aspect columns are
configurable; ``where`` keeps only rows whose column equals a value (e.g.
``team=auto-gen``); ``system_column`` (default none) names the system of
each story for system-level correlation (COSMiC's protocol).

Every kept row is validated: a missing or empty story id, an aspect value
that is not a number or lies outside ``scale`` (default 1..5; empty cells
included), and a story given two different systems raise a one-line
:class:`~storyrl.judgements.JudgementDataError` (``file: row n: fault``,
rows are 1-based data rows).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storyrl.input_text import csv_problem, open_text
from storyrl.judgements import JudgementDataError

__all__ = ["DEFAULT_ASPECTS", "Ratings", "load_ratings", "parse_where"]

DEFAULT_ASPECTS = ("focused", "coherent", "share", "human", "grounded", "detailed")


@dataclass
class Ratings:
    path: Path
    aspects: list[str]
    #: story id -> aspect -> the ratings of its raters (file order)
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    #: story id -> system (only with a system column)
    systems: dict[str, str] = field(default_factory=dict)
    raters: dict[str, list[str]] = field(default_factory=dict)
    rows: int = 0  # data rows read
    kept: int = 0  # rows kept by the filters

    @property
    def story_ids(self) -> list[str]:
        return list(self.values)

    def story_means(self, aspect: str) -> dict[str, float]:
        """Each story's mean rating over its raters."""
        return {sid: sum(v[aspect]) / len(v[aspect]) for sid, v in self.values.items()}


def parse_where(items: Sequence[str]) -> dict[str, str]:
    """``["team=auto-gen", ...]`` → ``{"team": "auto-gen"}`` (ValueError on a bad item)."""
    out: dict[str, str] = {}
    for item in items:
        column, sep, value = item.partition("=")
        if not sep or not column.strip():
            raise ValueError(f"--where {item!r}: expected COLUMN=VALUE")
        out[column.strip()] = value.strip()
    return out


def load_ratings(
    path: str | os.PathLike,
    *,
    story_column: str = "story_id",
    rater_column: str = "workerId",
    aspects: Sequence[str] = DEFAULT_ASPECTS,
    system_column: str | None = None,
    where: Mapping[str, str] | None = None,
    scale: tuple[float, float] = (1.0, 5.0),
) -> Ratings:
    """Read and validate a ratings CSV (module docstring)."""
    path = Path(path)
    where = dict(where or {})
    aspects = list(aspects)
    if not aspects:
        raise ValueError("at least one aspect column is needed")
    low, high = scale
    try:
        with open_text(path) as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if not header:
                raise JudgementDataError(f"{path}: empty file (no header)")
            header = [h.strip() for h in header]
            named = [h for h in header if h]
            duplicated = sorted({h for h in named if named.count(h) > 1})
            if duplicated:
                raise JudgementDataError(f"{path}: header: column(s) {', '.join(duplicated)} given twice")
            needed = [story_column, rater_column, *aspects, *([system_column] if system_column else []), *where]
            missing = [c for c in dict.fromkeys(needed) if c not in named]
            if missing:
                raise JudgementDataError(f"{path}: header: missing column(s) {', '.join(missing)} "
                                         f"(it has {', '.join(named)})")
            index = {h: k for k, h in enumerate(header) if h}
            ratings = Ratings(path=path, aspects=aspects)
            for n, cells in enumerate(reader, start=1):
                ratings.rows = n
                if not any(c.strip() for c in cells):
                    continue  # blank line
                if len(cells) < len(header):  # short rows: trailing empty columns may be cut
                    cells = cells + [""] * (len(header) - len(cells))
                elif len(cells) > len(header) and any(c.strip() for c in cells[len(header):]):
                    raise JudgementDataError(f"{path}: row {n}: {len(cells)} cells for {len(header)} columns")
                cell = {h: cells[k].strip() for h, k in index.items()}
                if any(cell[c] != v for c, v in where.items()):
                    continue
                _add_row(ratings, cell, path, n, story_column, rater_column, system_column, low, high)
    except (OSError, UnicodeDecodeError) as exc:
        raise JudgementDataError(f"{path}: cannot read: {exc}") from None
    except csv.Error as exc:
        raise JudgementDataError(f"{path}: line {reader.line_num}: malformed CSV: {csv_problem(exc)}") from None
    if not ratings.values:
        filters = f" matching {', '.join(f'{c}={v}' for c, v in where.items())}" if where else ""
        raise JudgementDataError(f"{path}: no rating rows{filters}")
    return ratings


def _add_row(ratings: Ratings, cell: dict[str, str], path: Path, n: int, story_column: str,
             rater_column: str, system_column: str | None, low: float, high: float) -> None:
    sid = cell[story_column]
    if not sid:
        raise JudgementDataError(f"{path}: row {n}: column {story_column!r} is empty")
    values = {}
    for aspect in ratings.aspects:
        text = cell[aspect]
        try:
            value = float(text)
        except ValueError:
            raise JudgementDataError(f"{path}: row {n}: column {aspect!r}: {text!r} is not a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise JudgementDataError(f"{path}: row {n}: column {aspect!r}: {text!r} is outside {low:g}..{high:g}")
        values[aspect] = value
    if system_column:
        system = cell[system_column]
        if not system:
            raise JudgementDataError(f"{path}: row {n}: column {system_column!r} is empty")
        if ratings.systems.setdefault(sid, system) != system:
            raise JudgementDataError(f"{path}: row {n}: story {sid!r} is rated as system {system!r} here "
                                     f"and {ratings.systems[sid]!r} before")
    story = ratings.values.setdefault(sid, {a: [] for a in ratings.aspects})
    for aspect, value in values.items():
        story[aspect].append(value)
    ratings.raters.setdefault(sid, []).append(cell[rater_column])
    ratings.kept += 1
