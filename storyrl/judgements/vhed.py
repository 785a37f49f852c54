"""VHED (Hsu et al. 2022, ``AcademiaSinicaNLPLab/VHED``, MIT): ranked story
pairs re-collected from the human evaluations of KG-Story, PR-VIST and
Stretch-VST.

A row of ``VHED.csv`` is one pair of stories of one image sequence. The
columns read (others, e.g. a pandas index column, are ignored):

``sent1`` / ``sent2``
    the two stories (non-empty).
``label``
    the raw rank gap avg_rank(story1) − avg_rank(story2). Lower rank = better,
    so story1 is the better story iff the gap is negative.
``rank_norm``
    the normalised gap.
``story_id``, ``img_seq``, ``model_base``, ``model_comp``
    identifiers; ``model_*`` name the system that wrote story1 / story2.
``agreement``
    how many of the rankers agree on the order: 2..5. The paper (§3.1) reads 2
    as 3 ("1 person agreeing that A is better than B is equivalent to 4 people
    agreeing that B is better than A"), so a 2 becomes 3 here.
``avg_rank_base`` / ``avg_rank_comp``, ``order``
    the average ranks and the number of rankers.

Zero-gap pairs are dropped by default, as in the paper's quality control
(13,875 pairs remain), and counted in :attr:`VHEDData.zero_gap_dropped`.

Reference (human-written) stories are recognised by their model name, see
:func:`is_reference_model`. The README does not say which name VHED uses for
them, so the default set is deliberately broad and callers can pass their own.

Every row is validated; a fault raises a one-line
:class:`~storyrl.judgements.JudgementDataError` such as
``VHED.csv: row 12: column 'label': 'abc' is not a number`` (rows are
1-based data rows, the header not counted).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from storyrl.input_text import csv_problem, open_text
from storyrl.judgements import JudgementDataError

__all__ = [
    "DEFAULT_REFERENCE_MODELS",
    "VHED_COLUMNS",
    "VHEDData",
    "VHEDPair",
    "is_reference_model",
    "load_vhed",
]

#: Columns every VHED CSV must have.
VHED_COLUMNS = (
    "sent1", "sent2", "label", "story_id", "model_base", "model_comp",
    "agreement", "img_seq", "avg_rank_base", "avg_rank_comp", "order", "rank_norm",
)

#: Model names (compared case-insensitively, ignoring surrounding spaces)
#: that mark a human-written reference story.
DEFAULT_REFERENCE_MODELS = frozenset(
    {"reference", "references", "ref", "human", "gt", "ground_truth", "groundtruth", "ground truth", "gold"}
)


def is_reference_model(name: str, names: Iterable[str] = DEFAULT_REFERENCE_MODELS) -> bool:
    """True when ``name`` is one of ``names`` (case-insensitive, stripped)."""
    wanted = {n.strip().lower() for n in names}
    return name.strip().lower() in wanted


@dataclass(frozen=True)
class VHEDPair:
    story1: str
    story2: str
    #: avg_rank(story1) - avg_rank(story2); story1 is better iff gap < 0.
    gap: float
    rank_norm: float
    story_id: str
    img_seq: str
    model1: str
    model2: str
    #: 3, 4 or 5 (a 2 in the file is read as 3).
    agreement: int
    avg_rank1: float
    avg_rank2: float
    rankers: int
    #: 1-based data-row number in the file.
    row: int

    @property
    def better(self) -> str:
        return self.story1 if self.gap < 0 else self.story2

    @property
    def worse(self) -> str:
        return self.story2 if self.gap < 0 else self.story1


@dataclass
class VHEDData:
    pairs: list[VHEDPair]
    path: Path
    zero_gap_dropped: int = 0
    #: data rows read, zero-gap rows included.
    rows: int = 0


def _number(path: Path, row: int, column: str, value: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise JudgementDataError(f"{path}: row {row}: column {column!r}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise JudgementDataError(f"{path}: row {row}: column {column!r}: {value!r} is not a finite number")
    return number


def _integer(path: Path, row: int, column: str, value: str) -> int:
    number = _number(path, row, column, value)
    if number != int(number):
        raise JudgementDataError(f"{path}: row {row}: column {column!r}: {value!r} is not a whole number")
    return int(number)


def _text(path: Path, row: int, column: str, value: str | None) -> str:
    if value is None or not value.strip():
        raise JudgementDataError(f"{path}: row {row}: column {column!r} is empty")
    return value


def _parse_row(path: Path, n: int, rec: dict) -> VHEDPair:
    agreement = _integer(path, n, "agreement", rec["agreement"])
    if not 2 <= agreement <= 5:
        raise JudgementDataError(f"{path}: row {n}: column 'agreement': {agreement} is outside 2..5")
    rankers = _integer(path, n, "order", rec["order"])
    if rankers < 1:
        raise JudgementDataError(f"{path}: row {n}: column 'order': {rankers} rankers (needs at least 1)")
    return VHEDPair(
        story1=_text(path, n, "sent1", rec["sent1"]),
        story2=_text(path, n, "sent2", rec["sent2"]),
        gap=_number(path, n, "label", rec["label"]),
        rank_norm=_number(path, n, "rank_norm", rec["rank_norm"]),
        story_id=(rec["story_id"] or "").strip(),
        img_seq=(rec["img_seq"] or "").strip(),
        model1=(rec["model_base"] or "").strip(),
        model2=(rec["model_comp"] or "").strip(),
        agreement=max(agreement, 3),  # paper §3.1: agreement 2 == 3
        avg_rank1=_number(path, n, "avg_rank_base", rec["avg_rank_base"]),
        avg_rank2=_number(path, n, "avg_rank_comp", rec["avg_rank_comp"]),
        rankers=rankers,
        row=n,
    )


def load_vhed(path: str | os.PathLike, *, drop_zero_gap: bool = True) -> VHEDData:
    """Read and validate a VHED-format CSV (see the module docstring)."""
    path = Path(path)
    try:
        with open_text(path) as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames
            if not header:
                raise JudgementDataError(f"{path}: empty file (no header)")
            missing = [c for c in VHED_COLUMNS if c not in header]
            if missing:
                raise JudgementDataError(f"{path}: header: missing column(s) {', '.join(missing)}")
            pairs: list[VHEDPair] = []
            dropped = rows = 0
            for n, rec in enumerate(reader, start=1):
                rows = n
                if None in rec:  # more cells than header columns
                    raise JudgementDataError(f"{path}: row {n}: {len(rec[None])} cell(s) beyond the header")
                short = [c for c in VHED_COLUMNS if rec.get(c) is None]
                if short:
                    raise JudgementDataError(f"{path}: row {n}: too few cells (no {short[0]!r})")
                pair = _parse_row(path, n, rec)
                if drop_zero_gap and pair.gap == 0:
                    dropped += 1
                    continue
                pairs.append(pair)
    except (OSError, UnicodeDecodeError) as exc:
        raise JudgementDataError(f"{path}: cannot read: {exc}") from None
    except csv.Error as exc:
        raise JudgementDataError(f"{path}: line {reader.reader.line_num}: malformed CSV: {csv_problem(exc)}") from None
    return VHEDData(pairs=pairs, path=path, zero_gap_dropped=dropped, rows=rows)
