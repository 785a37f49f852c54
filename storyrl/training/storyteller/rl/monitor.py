"""Signs of reward hacking, logged at every RL step by every algorithm.

Users optimising a story metric watch for the policy gaming it: stories that
shrink to one sentence (unscorable) or grow without bound, a vocabulary that
collapses (low distinct-n), a KL to the reference that runs away. This module
computes the text-side figures from a step's completions; the trainers add
KL and the rewards add their own unscorable fractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from storyrl.text import tokenize_story

__all__ = ["distinct_n", "finite_or_none", "last_reward", "sample_stories", "story_stats"]


def distinct_n(token_lists: Sequence[Sequence[str]], n: int) -> float:
    """Distinct-n over a batch (Li et al., 2016): distinct n-grams / n-grams,
    pooled over all stories; NaN when the batch has no n-gram."""
    seen, total = set(), 0
    for tokens in token_lists:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        seen.update(grams)
        total += len(grams)
    return len(seen) / total if total else math.nan


def story_stats(texts: Sequence[str | None], token_lengths: Sequence[int] | None = None) -> dict[str, float]:
    """Per-step story statistics: mean length in sentences and in words (and
    in policy tokens when ``token_lengths`` is given), distinct-1/2/3 over the
    batch, and the fraction of empty stories. Keys are ``story/...``."""
    words_per_story, sentences = [], []
    for text in texts:
        split = tokenize_story(text) if isinstance(text, str) and text.strip() else []
        sentences.append(len(split))
        words_per_story.append([w.lower() for s in split for w in s])
    n = max(len(texts), 1)
    stats = {
        "story/sentences_mean": sum(sentences) / n,
        "story/words_mean": sum(len(w) for w in words_per_story) / n,
        "story/empty_frac": sum(1 for s in sentences if s == 0) / n,
        "story/one_sentence_frac": sum(1 for s in sentences if s == 1) / n,
    }
    for k in (1, 2, 3):
        stats[f"story/distinct_{k}"] = distinct_n(words_per_story, k)
    if token_lengths is not None:
        stats["story/tokens_mean"] = sum(token_lengths) / max(len(token_lengths), 1)
    return stats


def sample_stories(texts: Sequence[str | None], rewards: Sequence[float | None], k: int = 3) -> list[dict]:
    """The first ``k`` stories of a step with their rewards, for the logs."""
    return [
        {"story": text if isinstance(text, str) else "", "reward": None if r is None or math.isnan(r) else float(r)}
        for text, r in list(zip(texts, rewards))[:k]
    ]


def last_reward(history: Sequence[dict]) -> float | None:
    """The reward of the last logged step that has one (a run's summary);
    None when it was not finite or no step logged one."""
    rewards = [e["reward"] for e in history if isinstance(e.get("reward"), (int, float))]
    return rewards[-1] if rewards and math.isfinite(rewards[-1]) else None


def finite_or_none(value: Any) -> Any:
    """None for a NaN or infinite float (JSON has neither), else ``value``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
