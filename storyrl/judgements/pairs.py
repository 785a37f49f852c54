"""Preference pairs: the one type ``storyrl meta-eval pairs`` scores
(:class:`PreferencePair`), read from generic JSONL files and converted from
VHED (:func:`vhed_pairs`) and VIST-Edit (:func:`storyrl.judgements.vist_edit.vist_edit_pairs`).

JSONL pairs
-----------
One JSON object per line (blank lines skipped):

``better``, ``worse`` (required, non-empty strings)
    the preferred and the other story; or ``chosen``, ``rejected`` (TRL's
    preference format, as ``storyrl pairs`` writes it), read the same way.
``subsets`` (list of strings) or ``subset`` (string)
    the subsets the pair is counted in, besides ``all``.
``gap`` (number)
    the human preference strength (informative; not bucketed for JSONL).
``story_id`` (string)
    the image sequence / task id, passed to metrics as context ``story_id``.
``references`` (list of strings) or ``reference`` (string)
    human stories for reference-based metrics.
``images`` / ``image_ids`` (lists of strings)
    the image sequence, for grounding metrics.
``better_id`` / ``worse_id`` (strings)
    per-story ids, needed only for precomputed score columns.

Other fields are ignored. Faults raise a one-line
:class:`~storyrl.judgements.JudgementDataError` (``file: line n: fault``).

Training rows
-------------
:func:`read_preference_rows` reads the same files as the trainers take them
(``storyrl train dpo`` and ``reward_model``): TRL's preference format as
``storyrl pairs`` writes it, rows kept as dicts. ``chosen`` and ``rejected``
are required non-empty strings; ``prompt``, when given, a string or a
conversation (list of messages); ``images`` a list of paths (default
empty); ``story_id`` a string or null. A pair whose chosen story equals its
rejected one (surrounding whitespace aside) teaches nothing (its loss stays
at ln 2 and its gradient vanishes): a few are named in a warning, a file of
nothing else is refused.

VHED subsets
------------
``Ω3``, ``Ω4``, ``Ω5`` (agreement k, a 2 read as 3), ``Ω{4,5}``, and within
Ω{4,5} (the paper evaluates k ≥ 4 only): ``R&M`` (exactly one story is a
reference, see :func:`~storyrl.judgements.vhed.is_reference_model`) and
``M&M`` (neither is). A reference-vs-reference pair is in neither. Gap
buckets: the paper's Fig. 3 splits VHED into four ranking-gap buckets without
publishing the edges (it only says accuracy reaches ~0.85 "starting with
ranking gaps over 0.3"); the default edges on |gap| are 0.1 / 0.2 / 0.3,
buckets ``|gap|≤0.1``, ``0.1<|gap|≤0.2``, ``0.2<|gap|≤0.3`` and ``|gap|>0.3``
(right-closed: a |gap| equal to an edge falls in the lower bucket). The
buckets are taken over Ω{4,5} by default (``bucket_agreements``), as every
other VHED figure of the paper; the gap is the ``label`` column (the paper's
"ranking gap", avg rank of x1 − avg rank of x2) unless ``gap_column="rank_norm"``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.input_text import json_loads, read_text
from storyrl.judgements import JudgementDataError
from storyrl.judgements.vhed import DEFAULT_REFERENCE_MODELS, VHEDData, is_reference_model

__all__ = ["ALL", "DEFAULT_GAP_EDGES", "PreferencePair", "bucket_names", "gap_bucket", "load_pairs_jsonl",
           "subset_order", "vhed_pairs"]

#: The subset every pair belongs to.
ALL = "all"
DEFAULT_GAP_EDGES = (0.1, 0.2, 0.3)
VHED_SUBSETS = ("Ω3", "Ω4", "Ω5", "Ω{4,5}", "R&M", "M&M")


@dataclass(frozen=True)
class PreferencePair:
    """``better`` is preferred to ``worse`` by people."""

    better: str
    worse: str
    #: subsets besides ``all``
    subsets: tuple[str, ...] = ()
    story_id: str | None = None
    gap: float | None = None
    references: tuple[str, ...] | None = None
    images: tuple[str, ...] | None = None
    image_ids: tuple[str, ...] | None = None
    better_id: str | None = None
    worse_id: str | None = None
    #: whether ``better`` came first in the source (VHED's story1); a
    #: pairwise judge reads the pair in that order. None: no order given.
    better_first: bool | None = None
    #: where the pair comes from, for messages ("file: row n")
    source: str = ""


def _fmt(edge: float) -> str:
    return f"{edge:g}"


def bucket_names(edges: Sequence[float] = DEFAULT_GAP_EDGES) -> list[str]:
    """Names of the len(edges)+1 buckets on |gap|, lowest first."""
    edges = list(edges)
    if not edges or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] <= 0:
        raise ValueError(f"gap bucket edges must be positive and increasing, got {edges}")
    names = [f"|gap|≤{_fmt(edges[0])}"]
    names += [f"{_fmt(a)}<|gap|≤{_fmt(b)}" for a, b in zip(edges, edges[1:])]
    return names + [f"|gap|>{_fmt(edges[-1])}"]


def gap_bucket(gap: float, edges: Sequence[float] = DEFAULT_GAP_EDGES) -> str:
    """The bucket of ``|gap|`` (right-closed intervals)."""
    names = bucket_names(edges)
    size = abs(gap)
    for name, edge in zip(names, edges):
        if size <= edge:
            return name
    return names[-1]


def subset_order(subsets: Iterable[str], edges: Sequence[float] = DEFAULT_GAP_EDGES) -> list[str]:
    """``all``, VHED's subsets and buckets in the paper's order, then the rest by name."""
    known = [ALL, *VHED_SUBSETS, "AREL-edit", "GLAC-edit", *bucket_names(edges)]
    present = set(subsets)
    return [s for s in known if s in present] + sorted(present - set(known))


def _image_ids(img_seq: str) -> tuple[str, ...] | None:
    # VHED's img_seq lists SIND photo ids; accept any separator / list syntax
    ids = re.findall(r"[A-Za-z0-9_.-]+", img_seq)
    return tuple(ids) or None


def vhed_pairs(
    data: VHEDData,
    *,
    references: Mapping[str, Sequence[str]] | None = None,
    reference_models: Iterable[str] = DEFAULT_REFERENCE_MODELS,
    gap_edges: Sequence[float] = DEFAULT_GAP_EDGES,
    bucket_agreements: Iterable[int] = (4, 5),
    gap_column: str = "label",
) -> list[PreferencePair]:
    """VHED pairs as preference pairs with their subsets (module docstring).

    The references of a pair are the reference-model stories of its
    ``img_seq`` anywhere in ``data`` (zero-gap pairs included, when loaded),
    plus ``references[img_seq]`` and ``references[story_id]``. Zero-gap
    pairs are skipped (they have no preferred story)."""
    if gap_column not in ("label", "rank_norm"):
        raise ValueError(f"gap_column must be 'label' or 'rank_norm', got {gap_column!r}")
    reference_models = list(reference_models)
    bucket_agreements = set(bucket_agreements)
    bucket_names(gap_edges)  # validates the edges
    refs: dict[str, list[str]] = {}
    for p in data.pairs:
        for story, model in ((p.story1, p.model1), (p.story2, p.model2)):
            if is_reference_model(model, reference_models):
                found = refs.setdefault(p.img_seq, [])
                if story not in found:
                    found.append(story)
    out = []
    for p in data.pairs:
        if p.gap == 0:
            continue
        subsets = [f"Ω{p.agreement}"]
        if p.agreement >= 4:
            subsets.append("Ω{4,5}")
            n_refs = is_reference_model(p.model1, reference_models) + is_reference_model(p.model2, reference_models)
            if n_refs == 1:
                subsets.append("R&M")
            elif n_refs == 0:
                subsets.append("M&M")
        gap = p.gap if gap_column == "label" else p.rank_norm
        if p.agreement in bucket_agreements:
            subsets.append(gap_bucket(gap, gap_edges))
        pair_refs = list(refs.get(p.img_seq, []))
        for key in (p.img_seq, p.story_id):
            for story in (references or {}).get(key, ()):
                if story not in pair_refs:
                    pair_refs.append(story)
        better, worse = (p.story1, p.story2) if p.gap < 0 else (p.story2, p.story1)
        out.append(PreferencePair(
            better=better, worse=worse, subsets=tuple(subsets), story_id=p.story_id or None,
            gap=abs(gap), references=tuple(pair_refs), image_ids=_image_ids(p.img_seq),
            better_first=p.gap < 0, source=f"{data.path}: row {p.row}",
        ))
    return out


def _strings(value: Any, where: str, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise JudgementDataError(f"{where}: {key!r} must be a list of strings")
    return tuple(value)


def _string(value: Any, where: str, key: str, required: bool = False) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise JudgementDataError(f"{where}: {key!r} must be a non-empty string" if required
                                 else f"{where}: {key!r} must be a string")
    return value


def _pair(obj: Any, where: str) -> PreferencePair:
    if not isinstance(obj, dict):
        raise JudgementDataError(f"{where}: a pair must be a JSON object")
    # TRL preference rows (storyrl pairs): chosen/rejected name better/worse.
    trl = "chosen" in obj or "rejected" in obj
    if trl and ("better" in obj or "worse" in obj):
        raise JudgementDataError(f"{where}: give 'better'/'worse' or 'chosen'/'rejected', not both")
    better_key, worse_key = ("chosen", "rejected") if trl else ("better", "worse")
    for key in (better_key, worse_key):
        if key not in obj:
            raise JudgementDataError(f"{where}: missing field {key!r}")
    if "subsets" in obj and "subset" in obj:
        raise JudgementDataError(f"{where}: give 'subsets' or 'subset', not both")
    subsets = _strings(obj.get("subsets"), where, "subsets")
    if subsets is None and obj.get("subset") is not None:
        subsets = (_string(obj["subset"], where, "subset", required=True),)
    if subsets and ALL in subsets:
        raise JudgementDataError(f"{where}: subset {ALL!r} is implicit (every pair is in it)")
    gap = obj.get("gap")
    if gap is not None and (isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap)):
        raise JudgementDataError(f"{where}: 'gap' must be a finite number, got {gap!r}")
    references = _strings(obj.get("references"), where, "references")
    reference = _string(obj.get("reference"), where, "reference")
    if reference is not None:
        references = (*(references or ()), reference)
    return PreferencePair(
        better=_string(obj[better_key], where, better_key, required=True),
        worse=_string(obj[worse_key], where, worse_key, required=True),
        subsets=tuple(dict.fromkeys(subsets or ())),
        story_id=_string(obj.get("story_id"), where, "story_id"),
        gap=None if gap is None else float(gap),
        references=references,
        images=_strings(obj.get("images"), where, "images"),
        image_ids=_strings(obj.get("image_ids"), where, "image_ids"),
        better_id=_string(obj.get("better_id"), where, "better_id"),
        worse_id=_string(obj.get("worse_id"), where, "worse_id"),
        source=where,
    )


def _json_lines(path: str | os.PathLike):
    """``(line number, "file: line n", object)`` for each non-blank line of a
    JSONL file; an unreadable file or a line that is not JSON is one
    :class:`~storyrl.judgements.JudgementDataError`."""
    try:
        lines = read_text(path).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise JudgementDataError(f"{path}: cannot read: {exc}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}: line {n}"
        try:
            yield n, where, json_loads(line)
        except json.JSONDecodeError as exc:
            raise JudgementDataError(f"{where}: invalid JSON: {exc.msg}") from None


def load_pairs_jsonl(path: str | os.PathLike) -> list[PreferencePair]:
    """Read and validate a JSONL file of preference pairs (module docstring)."""
    path = Path(path)
    pairs = [_pair(obj, where) for _, where, obj in _json_lines(path)]
    if not pairs:
        raise JudgementDataError(f"{path}: no pairs")
    return pairs


def read_preference_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a TRL preference-pairs JSONL (module docstring, "Training
    rows"), each with its line number as ``_line``; a fault is one
    :class:`~storyrl.judgements.JudgementDataError` (a ValueError)
    ``file: line n: fault``."""
    rows = []
    for n, where, row in _json_lines(path):
        if not isinstance(row, dict):
            raise JudgementDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in ("chosen", "rejected"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise JudgementDataError(f"{where}: {key!r} must be a non-empty string (TRL preference format)")
        prompt = row.get("prompt")
        if prompt is not None and not (isinstance(prompt, str) or (
                isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt))):
            raise JudgementDataError(f"{where}: 'prompt' must be a string or a conversation (list of messages)")
        images = row.get("images") or []
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise JudgementDataError(f"{where}: 'images' must be a list of image paths")
        if row.get("story_id") is not None and not isinstance(row["story_id"], str):
            raise JudgementDataError(f"{where}: 'story_id' must be a string")
        rows.append({**row, "images": images, "_line": n})
    if not rows:
        raise JudgementDataError(f"{path}: no preference pairs")
    _check_distinct(rows, path)
    return rows


def _check_distinct(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Refuse a file whose every pair has chosen == rejected; warn about some."""
    same = [row["_line"] for row in rows if row["chosen"].strip() == row["rejected"].strip()]
    if len(same) == len(rows):
        raise JudgementDataError(f"{path}: chosen equals rejected in all {len(rows)} pairs: nothing to learn "
                                 "(the loss stays at ln 2); pair different stories")
    if same:
        shown = ", ".join(map(str, same[:5])) + (", ..." if len(same) > 5 else "")
        logging.getLogger(__name__).warning("%s: chosen equals rejected in %d of %d pairs (line %s); they teach "
                                            "nothing", path, len(same), len(rows), shown)
