"""Preference pairs for preference training (``storyrl pairs``), in TRL's
preference format: one JSON object per line with ``prompt``, ``chosen``,
``rejected`` and ``images`` (image paths, possibly empty), plus storyrl's
``story_id``, ``source``, ``chosen_score``, ``rejected_score`` and ``margin``.

Two routes need no policy sampling:

* From people (:func:`human_pair_rows`): VHED's ranked pairs and VIST-Edit's
  edit-over-machine pairs, as :mod:`storyrl.judgements.pairs` and
  :mod:`storyrl.judgements.vist_edit` read them. The scores are null (people
  ranked, they did not score); ``margin`` is the human gap when the source has
  one (VHED's |rank gap|), else null.
* From a reward over existing stories (:func:`metric_pairs`): several story
  sets for the same records (matched by ``story_id``) are scored with one
  reward, and each record's best story is paired with each other story
  ("best vs each worse", not all pairs: every pair then teaches the preference
  for the story the reward likes most, and a record of k stories gives k-1
  pairs, not k(k-1)/2 pairs of ever smaller margins). A pair is kept when its
  margin (best score - other score) is above ``min_margin``; among equal best
  scores the story of the earlier set is the best. Dropped, with counted
  reasons: unscorable stories (NaN), records with fewer than two scored
  stories, ties (margin 0) and pairs at or below ``min_margin``.

The prompt is one text for every pair (``prompt``); the images carry the
sequence.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from storyrl.data import StoryRecord
from storyrl.eval.scoring import score_context
from storyrl.judgements.pairs import PreferencePair

__all__ = ["DEFAULT_PROMPT", "DROP_REASONS", "human_pair_rows", "metric_pairs", "pair_row"]

DEFAULT_PROMPT = "Write a story about this sequence of images."

#: Why a story, record or pair gave no kept pair (the summary's keys).
UNSCORABLE = "unscorable_stories"
SINGLE = "records_with_fewer_than_2_scored_stories"
TIE = "tied_pairs"
SMALL = "pairs_at_or_below_min_margin"
DROP_REASONS = (UNSCORABLE, SINGLE, TIE, SMALL)


def pair_row(*, prompt: str, chosen: str, rejected: str, images: Sequence[str] = (), story_id: str | None = None,
             source: str = "", chosen_score: float | None = None, rejected_score: float | None = None,
             margin: float | None = None) -> dict[str, Any]:
    """One output line (module docstring)."""
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "images": list(images),
            "story_id": story_id, "source": source, "chosen_score": chosen_score,
            "rejected_score": rejected_score, "margin": margin}


def human_pair_rows(pairs: Sequence[PreferencePair], prompt: str = DEFAULT_PROMPT) -> list[dict[str, Any]]:
    """Rows of human preference pairs: better = chosen, worse = rejected."""
    return [pair_row(prompt=prompt, chosen=p.better, rejected=p.worse, images=p.images or (), story_id=p.story_id,
                     source=p.source, margin=p.gap) for p in pairs]


def _scores(reward: Any, records: Sequence[StoryRecord], batch_size: int) -> list[float]:
    scores: list[float] = []
    for start in range(0, len(records), batch_size):
        batch = list(records[start:start + batch_size])
        values = reward.score([r.story for r in batch], **score_context(batch))
        scores += [float(v) for v in values]
    return scores


def metric_pairs(
    story_sets: Sequence[tuple[str, Sequence[StoryRecord]]],
    reward: Any,
    *,
    min_margin: float = 0.0,
    prompt: str = DEFAULT_PROMPT,
    batch_size: int = 64,
) -> tuple[list[dict[str, Any]], Counter]:
    """Best-vs-each-worse pairs of ``story_sets`` ((name, records) each) by
    ``reward`` (module docstring). Returns the rows, records in order of
    first appearance, and the dropped counts by reason (every reason
    present, 0 when none)."""
    if isinstance(min_margin, bool) or not isinstance(min_margin, (int, float)) or not (
            math.isfinite(min_margin) and min_margin >= 0):
        raise ValueError(f"min_margin must be a finite number >= 0, got {min_margin!r}")
    if len(story_sets) < 2:
        raise ValueError(f"pairs from a metric need at least 2 story sets, got {len(story_sets)}")
    dropped = Counter({reason: 0 for reason in DROP_REASONS})
    candidates: dict[str, list[tuple[str, StoryRecord, float]]] = {}
    for name, records in story_sets:
        for record, score in zip(records, _scores(reward, records, batch_size)):
            found = candidates.setdefault(record.story_id, [])
            if math.isnan(score):
                dropped[UNSCORABLE] += 1
            else:
                found.append((name, record, score))
    rows = []
    for story_id, found in candidates.items():
        if len(found) < 2:
            dropped[SINGLE] += 1
            continue
        best_name, best, best_score = max(found, key=lambda c: c[2])  # max keeps the first of equal scores
        for name, other, score in found:
            if other is best:
                continue
            margin = best_score - score
            if margin == 0:
                dropped[TIE] += 1
            elif margin <= min_margin:
                dropped[SMALL] += 1
            else:
                rows.append(pair_row(prompt=prompt, chosen=best.story, rejected=other.story,
                                     images=best.images or (), story_id=story_id,
                                     source=f"{reward.name}: {best_name} > {name}",
                                     chosen_score=best_score, rejected_score=score, margin=margin))
    return rows, dropped
