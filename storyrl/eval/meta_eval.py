"""``storyrl meta-eval``: how well metrics agree with human judgements.

* :func:`pairs_table` — pair accuracy per subset (VHED, VIST-Edit, JSONL
  pairs; :mod:`storyrl.judgements.pairs`). A metric with
  ``compare(first, second, **context)`` (Vrank) judges each pair directly
  (positive = the first story is better), reading each pair in its
  source's order (VHED: story1 first, as Vrank trained; VIST-Edit and
  JSONL pairs: a coin flip fixed by the two texts, since always putting
  the better story first would reward a judge biased to the first
  story). Any other metric scores stories:
  every distinct (story text, context) is scored ONCE per metric, in
  batches, with the context the data has (``story_id``, ``images``,
  ``image_ids``, ``references``; a pair with exactly one human story, such
  as a ``storyrl pairs`` row's ``reference``, passes it as ``reference``,
  which ``dhm`` compares with), and the pair is correct iff the preferred
  story scores strictly higher. A metric whose options have
  ``reference_absent: true`` gets, for each story of a pair, the pair's
  references minus BOTH stories of the pair (VHED Eq. 3 removes r_j when any
  candidate of the pair equals it; case and whitespace are ignored, as in
  :mod:`storyrl.rewards.reference_based`); other metrics get every reference.
* :func:`ratings_table` — story-level and system-level correlations with
  ratings (:mod:`storyrl.judgements.ratings`); figures in
  :mod:`storyrl.eval.meta_eval_stats`.
* :func:`original_vs_random_table` — GROOViST's criterion 1
  (:func:`storyrl.eval.grounding.original_vs_random`) for several metrics.

Precomputed scores (:class:`Metric` with ``scores``) are keyed by story id:
the ratings' story ids, or a JSONL pair's ``better_id`` / ``worse_id``.
A metric that raises is reported as failed and the others go on; callers
exit non-zero when every metric failed.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from storyrl.eval.meta_eval_stats import (
    bootstrap_ci,
    correlations,
    pair_accuracy,
    pair_correct,
    system_means,
    system_tau,
)
from storyrl.judgements.pairs import ALL, PreferencePair, subset_order

__all__ = [
    "OVR_COLUMNS",
    "PAIR_COLUMNS",
    "RATING_COLUMNS",
    "MetaEvalResult",
    "Metric",
    "original_vs_random_table",
    "pairs_table",
    "ratings_table",
]

PAIR_COLUMNS = ("subset", "metric", "n", "accuracy")
RATING_COLUMNS = ("subset", "metric", "aspect", "n", "kendall", "spearman", "pearson", "ci_low", "ci_high")
OVR_COLUMNS = ("metric", "n", "k", "n_excluded", "delta_mean", "delta_std", "frac_original_higher",
               "original_mean", "random_max_mean")
_PAIR_CONTEXT = ("story_id", "images", "image_ids")


@dataclass
class Metric:
    """A reward (``score``, maybe ``compare``) or precomputed ``scores``
    {story_id: score}."""

    name: str
    reward: Any = None
    scores: Mapping[str, float] | None = None

    @property
    def reference_absent(self) -> bool:
        return getattr(getattr(self.reward, "args", None), "reference_absent", False) is True


@dataclass
class MetaEvalResult:
    rows: list[list]
    failed: dict[str, str] = field(default_factory=dict)  # metric -> one-line reason
    #: metric -> how many pairs / stories got no score (NaN)
    unscorable: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    #: metrics that produced figures
    succeeded: list[str] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        return not self.succeeded


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _describe(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="story", disable=not progress, file=sys.stderr)


def _score_units(reward: Any, units: list[tuple], keys: Sequence[str], batch_size: int, desc: str,
                 progress: bool) -> np.ndarray:
    """Score (text, *context) tuples in batches; a context column is passed
    when any unit has a value for it."""
    out = np.empty(len(units))
    with _bar(len(units), desc, progress) as bar:
        for start in range(0, len(units), batch_size):
            chunk = units[start:start + batch_size]
            context = {}
            for k, key in enumerate(keys, start=1):
                column = [None if u[k] is None else list(u[k]) if isinstance(u[k], tuple) else u[k] for u in chunk]
                if any(v is not None for v in column):
                    context[key] = column
            out[start:start + len(chunk)] = reward.score([u[0] for u in chunk], **context)
            bar.update(len(chunk))
    return out


def _pair_refs(pair: PreferencePair, absent: bool) -> tuple[str, ...] | None:
    if pair.references is None:
        return None
    if not absent:
        return pair.references
    drop = {_norm(pair.better), _norm(pair.worse)}
    return tuple(r for r in pair.references if _norm(r) not in drop)


def _correct_by_scores(pairs: Sequence[PreferencePair], metric: Metric, batch_size: int,
                       progress: bool) -> tuple[np.ndarray, int]:
    """Per pair whether the metric prefers ``better``, and how many pairs got NaN."""
    if metric.scores is not None:
        missing = [p.source for p in pairs if p.better_id is None or p.worse_id is None]
        if missing:
            raise ValueError(f"precomputed scores need 'better_id' and 'worse_id' on every pair ({missing[0]})")
        unknown = sorted({i for p in pairs for i in (p.better_id, p.worse_id) if i not in metric.scores})
        if unknown:
            raise ValueError(f"no score for story {unknown[0]!r} ({len(unknown)} ids missing)")
        better = np.array([metric.scores[p.better_id] for p in pairs], dtype=np.float64)
        worse = np.array([metric.scores[p.worse_id] for p in pairs], dtype=np.float64)
        return pair_correct(better, worse), int((~(np.isfinite(better) & np.isfinite(worse))).sum())
    reward = metric.reward
    if hasattr(reward, "compare"):
        values = np.empty(len(pairs))
        with _bar(len(pairs), f"{metric.name} (pairs)", progress) as bar:
            for start in range(0, len(pairs), batch_size):
                chunk = pairs[start:start + batch_size]
                context = {}
                for key in _PAIR_CONTEXT:
                    column = [None if getattr(p, key) is None else _list(getattr(p, key)) for p in chunk]
                    if any(v is not None for v in column):
                        context[key] = column
                first = [_better_first(p) for p in chunk]
                judged = reward.compare([p.better if f else p.worse for p, f in zip(chunk, first)],
                                        [p.worse if f else p.better for p, f in zip(chunk, first)], **context)
                # Positive = the first story is better: flip where the worse one came first.
                values[start:start + len(chunk)] = np.where(first, 1.0, -1.0) * judged
                bar.update(len(chunk))
        return pair_correct(values), int((~np.isfinite(values)).sum())
    # one unit per distinct (text, context): a story shared by pairs is scored once
    index: dict[tuple, int] = {}
    sides = []
    for p in pairs:
        refs = _pair_refs(p, metric.reference_absent)
        # One human story (a `storyrl pairs` row's `reference`) goes as `reference`, the context rewards
        # comparing with the human story read (dhm); reference-based metrics read either.
        one = refs[0] if refs is not None and len(refs) == 1 else None
        many = None if one is not None else refs
        for text in (p.better, p.worse):
            unit = (text, p.story_id, p.images, p.image_ids, one, many)
            sides.append(index.setdefault(unit, len(index)))
    scores = _score_units(reward, list(index), (*_PAIR_CONTEXT, "reference", "references"), batch_size, metric.name,
                          progress)
    sides = np.asarray(sides).reshape(-1, 2)
    better, worse = scores[sides[:, 0]], scores[sides[:, 1]]
    return pair_correct(better, worse), int((~(np.isfinite(better) & np.isfinite(worse))).sum())


def _better_first(pair: PreferencePair) -> bool:
    """The order a pairwise judge reads a pair in: the source's (VHED's story1
    first), else a coin flip fixed by the two texts. Always putting the better
    story first would reward a judge that simply prefers the first story."""
    if pair.better_first is not None:
        return pair.better_first
    digest = hashlib.sha1(f"{pair.better}\0{pair.worse}".encode("utf-8", "surrogatepass")).digest()
    return digest[0] % 2 == 0


def _list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def pairs_table(pairs: Sequence[PreferencePair], metrics: Sequence[Metric], *, batch_size: int = 64,
                progress: bool = True, gap_edges: Sequence[float] = (0.1, 0.2, 0.3)) -> MetaEvalResult:
    """Rows ``subset, metric, n, accuracy`` (every subset that has pairs)."""
    pairs = list(pairs)
    members: dict[str, list[int]] = {ALL: list(range(len(pairs)))}
    for i, p in enumerate(pairs):
        for s in p.subsets:
            members.setdefault(s, []).append(i)
    order = subset_order(members, gap_edges)
    result = MetaEvalResult(rows=[])
    correct: dict[str, np.ndarray] = {}
    for metric in metrics:
        try:
            if hasattr(metric.reward, "setup"):
                metric.reward.setup()
            correct[metric.name], nan = _correct_by_scores(pairs, metric, batch_size, progress)
        except Exception as exc:  # noqa: BLE001 - one metric's failure must not end the others
            result.failed[metric.name] = _describe(exc)
            continue
        result.unscorable[metric.name] = nan
        if nan == len(pairs):
            result.failed[metric.name] = f"no pair could be scored ({nan} pairs)"
            del correct[metric.name]
        else:
            result.succeeded.append(metric.name)
    for subset in order:
        idx = members[subset]
        for metric in metrics:
            if metric.name in correct:
                result.rows.append([subset, metric.name, len(idx), pair_accuracy(correct[metric.name][idx])])
    return result


#: Fewer systems than this make a system-level correlation a warning: with n
#: systems Kendall's τ takes only n(n-1)/2 + 1 values (±1 with 2 systems), and
#: n = 5 is the smallest count at which even a perfect ranking (τ = 1, exact
#: two-sided p = 2/5! ≈ 0.017) is significant at 0.05; with 4 it is 2/4! ≈ 0.083.
MIN_SYSTEMS = 5


def ratings_table(ratings: Any, records: Mapping[str, Any], metrics: Sequence[Metric], *, n_boot: int = 1000,
                  seed: int = 0, level: float = 0.95, batch_size: int = 64, progress: bool = True) -> MetaEvalResult:
    """Rows ``subset, metric, aspect, n, kendall, spearman, pearson, ci_low,
    ci_high``: subset ``story`` (each rated story's mean rating over its
    raters against its score; the CI is Kendall τ-b's) and, when the ratings
    have systems, ``system`` (means per system over the stories with a
    score; no CI). Stories whose score is NaN are dropped (n counts the rest;
    :attr:`MetaEvalResult.unscorable` the dropped). A system-level row over
    fewer than :data:`MIN_SYSTEMS` systems adds a warning to
    :attr:`MetaEvalResult.notes`."""
    from storyrl.eval.scoring import score_context

    ids = ratings.story_ids
    missing = [sid for sid in ids if sid not in records]
    if missing:
        raise ValueError(f"the stories file has no story {missing[0]!r} ({len(missing)} rated stories missing)")
    result = MetaEvalResult(rows=[])
    for metric in metrics:
        try:
            if metric.scores is not None:
                absent = [sid for sid in ids if sid not in metric.scores]
                if absent:
                    raise ValueError(f"no score for story {absent[0]!r} ({len(absent)} rated stories missing)")
                scores = np.array([metric.scores[sid] for sid in ids], dtype=np.float64)
            else:
                if hasattr(metric.reward, "setup"):
                    metric.reward.setup()
                scores = np.empty(len(ids))
                with _bar(len(ids), metric.name, progress) as bar:
                    for start in range(0, len(ids), batch_size):
                        batch = [records[sid] for sid in ids[start:start + batch_size]]
                        scores[start:start + len(batch)] = metric.reward.score([r.story for r in batch],
                                                                               **score_context(batch))
                        bar.update(len(batch))
        except Exception as exc:  # noqa: BLE001
            result.failed[metric.name] = _describe(exc)
            continue
        keep = np.isfinite(scores)
        result.unscorable[metric.name] = int((~keep).sum())
        if not keep.any():
            result.failed[metric.name] = f"no rated story could be scored ({len(ids)} stories)"
            continue
        result.succeeded.append(metric.name)
        kept_ids = [sid for sid, k in zip(ids, keep) if k]
        n_systems = len({ratings.systems[sid] for sid in kept_ids}) if ratings.systems else None
        if n_systems is not None and n_systems < MIN_SYSTEMS:
            result.notes.append(f"warning: {metric.name}: the system-level correlations rest on {n_systems} "
                                f"system{'s' * (n_systems != 1)} (fewer than {MIN_SYSTEMS}): "
                                "not evidence of agreement; read the story-level rows")
        for aspect in ratings.aspects:
            means = ratings.story_means(aspect)
            human = np.array([means[sid] for sid in kept_ids])
            figures = correlations(human, scores[keep])
            low, high = bootstrap_ci(human, scores[keep], n_boot=n_boot, seed=seed, level=level)
            result.rows.append(["story", metric.name, aspect, len(kept_ids), figures["kendall"],
                                figures["spearman"], figures["pearson"], low, high])
            if ratings.systems:
                systems = [ratings.systems[sid] for sid in kept_ids]
                by_human = system_means(systems, human)
                by_metric = system_means(systems, scores[keep])
                sys_fig = system_tau(by_human, by_metric)
                result.rows.append(["system", metric.name, aspect, len(by_human), sys_fig["kendall"],
                                    sys_fig["spearman"], sys_fig["pearson"], math.nan, math.nan])
    return result


def original_vs_random_table(records: Sequence[Any], metrics: Sequence[Metric], *, k: int = 5, seed: int = 0,
                             batch_size: int = 64) -> MetaEvalResult:
    """GROOViST criterion 1 per metric: rows of :data:`OVR_COLUMNS`."""
    from storyrl.eval.grounding import original_vs_random
    from storyrl.eval.scoring import score_context

    context = score_context(records)
    context.pop("story_id", None)  # a story scored against another sequence is not that sequence's story
    result = MetaEvalResult(rows=[])
    for metric in metrics:
        try:
            if metric.reward is None:
                raise ValueError("precomputed scores cannot score a story against other images")
            if hasattr(metric.reward, "setup"):
                metric.reward.setup()
            summary = original_vs_random(metric.reward, [r.story for r in records], k=k, seed=seed,
                                         batch_size=batch_size, **context).summary()
        except Exception as exc:  # noqa: BLE001
            result.failed[metric.name] = _describe(exc)
            continue
        result.unscorable[metric.name] = summary["n_excluded"]
        if not summary["n"]:
            result.failed[metric.name] = f"no sequence has a finite difference ({summary['n_excluded']} excluded)"
            continue
        result.rows.append([metric.name, *(summary[c] for c in OVR_COLUMNS[1:])])
        result.succeeded.append(metric.name)
    return result
