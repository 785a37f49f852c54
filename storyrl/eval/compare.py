"""Storytellers side by side on the same image sequences (``storyrl compare``).

For each system (a story file and its score tables) against the human
stories' scores (:func:`compare_systems`):

* d_HM and each dimension's distance (:func:`storyrl.eval.dhm`, over the
  stories every selected score is finite for);
* the paired difference to a baseline system, for d_HM and for each
  dimension: per story id scored in both systems, system - baseline, the
  mean and a percentile bootstrap interval over the story ids
  (:func:`paired_difference`; the ids are resampled, so the interval is
  over sequences, not over training seeds; each system draws with its own
  seed, :func:`system_seed`);
* each metric's mean score, and the mean of any other column of the
  system's tables (``kl``: ``storyrl kl``'s KL to the start policy);
* story statistics (:func:`story_statistics`): sentences and words per
  story, distinct-1/2 over all the system's stories, the share of stories
  of at most one sentence (d_HM cannot score those) and of empty ones.

:func:`comparison_markdown` renders the result as the Markdown tables the
command writes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from storyrl.data import ScoreTable
from storyrl.eval.dhm import DHM_DIMENSIONS, DhmResult, dhm

__all__ = ["Comparison", "SystemResult", "compare_systems", "comparison_markdown", "paired_difference",
           "story_statistics", "system_seed"]


def paired_difference(after: Mapping[str, float], before: Mapping[str, float], *, resamples: int = 2000,
                      seed: int = 0, level: float = 0.95) -> dict[str, float | int]:
    """Mean of ``after[k] - before[k]`` over the keys both have, and its
    percentile bootstrap interval at ``level`` (``resamples`` draws of the
    keys with replacement, seeded). NaN everywhere when no key is shared."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    shared = sorted(set(after) & set(before))
    if not shared:
        return {"delta": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    diff = np.array([after[k] - before[k] for k in shared], dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return {"delta": float(diff.mean()), "low": float(np.percentile(means, tail)),
            "high": float(np.percentile(means, 100 - tail)), "n": len(shared)}


def system_seed(seed: int, name: str) -> int:
    """The bootstrap seed of system ``name``: its own, so that adding or
    reordering systems leaves every other system's interval as it was."""
    import zlib

    return (seed + zlib.crc32(name.encode("utf-8"))) % 2**32


def story_statistics(stories: Sequence[str]) -> dict[str, float]:
    """Length and variety of a set of stories (module docs); words are
    storyrl.text's NLTK-style tokens, lower-cased for distinct-n."""
    from storyrl.text import tokenize_story
    from storyrl.training.storyteller.rl.monitor import distinct_n

    words, sentences = [], []
    for story in stories:
        split = tokenize_story(story) if story.strip() else []
        sentences.append(len(split))
        words.append([w.lower() for s in split for w in s])
    n = len(stories)
    if not n:
        return {key: math.nan for key in ("sentences", "words", "distinct_1", "distinct_2", "one_sentence", "empty")}
    return {"sentences": sum(sentences) / n, "words": sum(map(len, words)) / n,
            "distinct_1": distinct_n(words, 1), "distinct_2": distinct_n(words, 2),
            "one_sentence": sum(1 for s in sentences if s <= 1) / n, "empty": sum(1 for s in sentences if s == 0) / n}


@dataclass
class SystemResult:
    name: str
    stories: int
    #: stories d_HM counts (every selected score finite here and for the human story)
    n: int
    d_hm: float
    #: each dimension's mean distance (grounding, coherence, repetition)
    distances: dict[str, float]
    #: "d_hm" and each dimension -> paired_difference against the baseline (empty for the baseline)
    deltas: dict[str, dict] = field(default_factory=dict)
    #: mean of each score column over the system's finite scores (metrics, kl, ...)
    means: dict[str, float] = field(default_factory=dict)
    statistics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "stories": self.stories, "n": self.n, "d_hm": self.d_hm,
                "distances": self.distances, "deltas": self.deltas, "means": self.means,
                "statistics": self.statistics}


@dataclass
class Comparison:
    metrics: list[str]
    baseline: str | None
    human: dict
    systems: list[SystemResult]
    resamples: int
    seed: int
    level: float

    def to_json(self) -> dict:
        return {"metrics": self.metrics, "baseline": self.baseline, "human": self.human,
                "systems": [s.to_json() for s in self.systems], "resamples": self.resamples, "seed": self.seed,
                "level": self.level}


def _column_means(table: ScoreTable) -> dict[str, float]:
    out = {}
    for metric in table.metrics:
        values = np.array([v for v in table.scores[metric].values()], dtype=np.float64)
        values = values[np.isfinite(values)]
        out[metric] = float(values.mean()) if len(values) else math.nan
    return out


def _per_story(result: DhmResult) -> dict[str, dict[str, float]]:
    """"d_hm" and each dimension -> {story id: distance} of a d_HM result."""
    out = {dim: dict(zip(result.story_ids, map(float, values))) for dim, values in result.per_story.items()}
    if result.story_ids:
        overall = np.mean(np.stack(list(result.per_story.values())), axis=0)
        out["d_hm"] = dict(zip(result.story_ids, map(float, overall)))
    else:
        out["d_hm"] = {}
    return out


def compare_systems(human: ScoreTable, human_stories: Sequence[str],
                    systems: Mapping[str, tuple[ScoreTable, Mapping[str, str]]], *, baseline: str | None = None,
                    metrics: Sequence[str] | None = None, resamples: int = 2000, seed: int = 0,
                    level: float = 0.95) -> Comparison:
    """The comparison of the module docs. ``systems``: name -> (its score
    table, with any extra columns such as ``kl``; its stories
    ``{story_id: story}``), in table order. ``baseline`` names one of them
    (None: no paired differences). ``metrics``: the d_HM dimensions' score
    columns (default: those every table has)."""
    if not systems:
        raise ValueError("no system to compare")
    if baseline is not None and baseline not in systems:
        raise ValueError(f"baseline {baseline!r} is not one of the systems ({', '.join(systems)})")
    if metrics is None:
        metrics = [m for m in DHM_DIMENSIONS if m in human.scores and all(m in t.scores for t, _ in systems.values())]
        if not metrics:
            raise ValueError(f"no d_HM score column ({', '.join(DHM_DIMENSIONS)}) in the human table and every "
                             "system's table")
    results = {name: dhm(human, table, list(metrics)) for name, (table, _) in systems.items()}
    base = _per_story(results[baseline]) if baseline is not None else None
    out = []
    for name, (table, stories) in systems.items():
        result = results[name]
        deltas = {}
        if base is not None and name != baseline:
            mine = _per_story(result)
            deltas = {key: paired_difference(mine[key], base[key], resamples=resamples,
                                             seed=system_seed(seed, name), level=level)
                      for key in ("d_hm", *result.distances)}
        out.append(SystemResult(name, len(stories), result.n, result.d_hm, dict(result.distances), deltas,
                                _column_means(table), story_statistics(list(stories.values()))))
    human_summary = {"stories": len(human_stories), "means": _column_means(human),
                     "statistics": story_statistics(list(human_stories))}
    return Comparison(list(metrics), baseline, human_summary, out, resamples, seed, level)


def _f(value, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _delta(d: dict | None) -> str:
    if not d:
        return ""
    if not d["n"]:
        return "–"
    return f"{d['delta']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def comparison_markdown(comparison: Comparison) -> str:
    """Two Markdown tables: per system d_HM, its paired difference to the
    baseline, the distances, scores, KL and story statistics; then each
    dimension's paired difference."""
    dims = [DHM_DIMENSIONS[m][0] for m in comparison.metrics]
    extra = sorted({c for s in comparison.systems for c in s.means} - set(comparison.metrics))
    pct = f"{comparison.level * 100:g}%"
    head = (["system", "stories", "n", "d_HM", f"Δ d_HM vs {comparison.baseline} [{pct} CI]" if comparison.baseline
             else "Δ d_HM"] + [f"d {d}" for d in dims] + list(comparison.metrics) + extra
            + ["sentences", "words", "distinct-1", "distinct-2", "≤1 sentence"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    h = comparison.human
    stats = h["statistics"]
    lines.append("| " + " | ".join(["human", str(h["stories"]), "", "0", ""] + ["0"] * len(dims)
                                   + [_f(h["means"].get(m)) for m in comparison.metrics] + [""] * len(extra)
                                   + [_f(stats["sentences"], 2), _f(stats["words"], 1), _f(stats["distinct_1"]),
                                      _f(stats["distinct_2"]), _f(stats["one_sentence"])]) + " |")
    for s in comparison.systems:
        st = s.statistics
        lines.append("| " + " | ".join(
            [s.name, str(s.stories), str(s.n), _f(s.d_hm, 4), _delta(s.deltas.get("d_hm"))]
            + [_f(s.distances.get(d), 4) for d in dims] + [_f(s.means.get(m)) for m in comparison.metrics]
            + [_f(s.means.get(c)) for c in extra]
            + [_f(st["sentences"], 2), _f(st["words"], 1), _f(st["distinct_1"]), _f(st["distinct_2"]),
               _f(st["one_sentence"])]) + " |")
    text = ["d_HM: lower is better; n: stories whose every selected score is finite for the story and its human "
            f"story. Δ: the paired difference to {comparison.baseline} over the story ids both count, with a "
            f"{pct} percentile bootstrap interval ({comparison.resamples} resamples of the ids, seed "
            f"{comparison.seed})." if comparison.baseline else "d_HM: lower is better.", "", *lines]
    if comparison.baseline:
        head = ["system"] + [f"Δ d {d} [{pct} CI]" for d in dims]
        text += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in comparison.systems:
            if s.deltas:
                text.append("| " + " | ".join([s.name] + [_delta(s.deltas.get(d)) for d in dims]) + " |")
    return "\n".join(text) + "\n"
