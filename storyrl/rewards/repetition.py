"""RoViST-NR non-redundancy ("repetition"), exactly as the d_HM authors computed it.

Per sentence, the word tokens minus the last one (meant to drop the period).
Inter-sentence: every sentence against every earlier one; intra-sentence:
consecutive 4-token chunks against the chunk right after them. Each comparison is
``pairs / |set(a) ∪ set(b)|`` where ``pairs`` counts equal token *pairs*
(Σ_t c_a(t)·c_b(t)), not the set intersection, as the authors' loops do, so a
comparison can exceed 1 and the score can be negative for degenerate text.
Score = 1 − mean(mean(inter), mean(intra) or 0); 1 = no repetition.

A comparison whose token union is empty (two sentences with no token left,
e.g. two sentences that are just "!") is skipped and not counted in the mean,
as the authors' loops do (``if union == 0: continue``; in the intra-sentence
loop chunks are never empty, so it never applies there).

Unscorable (NaN) when no inter-sentence comparison is left: a story with fewer
than two sentences, or one whose sentences all have no token left. The reward
records which (``stats["reasons"]``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from operator import mul

import numpy as np

from storyrl.config import option
from storyrl.rewards.base import Reward, RewardConfig
from storyrl.text import tokenize_story

__all__ = ["Repetition", "repetition_from_tokens", "repetition_score"]


def repetition_from_tokens(sentences: Sequence[Sequence[str]], chunk_size: int = 4) -> float:
    """RoViST-NR of a story given the word tokens of each sentence; NaN when
    no inter-sentence comparison is left (see module docs)."""
    if len(sentences) < 2:
        return math.nan  # no inter-sentence comparison at all
    words = [list(s[:-1]) for s in sentences]
    # Equal-pair counts come from token counts (Σ_t c_a(t)·c_b(t)), identical to
    # the authors' pair loops; a sentence without repeated tokens counts 1 each.
    sets = [set(w) for w in words]
    counts = [Counter(w) if len(s) != len(w) else None for s, w in zip(sets, words)]
    inter_sum = 0.0
    n_inter = 0
    for i in range(1, len(words)):
        si, ci = sets[i], counts[i]
        for j in range(i):
            sj, cj = sets[j], counts[j]
            common = si & sj
            union = len(si) + len(sj) - len(common)
            if not union:
                continue  # both token-less: the authors skip it, uncounted
            n_inter += 1
            if not common:
                continue
            if ci is None and cj is None:
                pairs = len(common)
            else:
                ci_get = ci.__getitem__ if ci is not None else _one
                cj_get = cj.__getitem__ if cj is not None else _one
                pairs = sum(map(mul, map(ci_get, common), map(cj_get, common)))
            inter_sum += pairs / union
    intra_sum = 0.0
    n_intra = 0
    for toks, distinct in zip(words, sets):
        if len(toks) <= chunk_size:
            continue
        n_intra += (len(toks) - 1) // chunk_size
        if len(distinct) == len(toks):
            continue  # no token repeats: every chunk comparison is 0
        chunks = [toks[k : k + chunk_size] for k in range(0, len(toks), chunk_size)]
        chunk_sets = [set(c) for c in chunks]
        for k in range(1, len(chunks)):
            if not chunk_sets[k - 1].isdisjoint(chunk_sets[k]):
                intra_sum += sum(map(chunks[k].count, chunks[k - 1])) / len(chunk_sets[k - 1] | chunk_sets[k])
    if not n_inter:  # every sentence token-less: all comparisons skipped
        return math.nan
    inter = inter_sum / n_inter
    intra = intra_sum / n_intra if n_intra else 0.0
    return 1.0 - (inter + intra) / 2.0


def _one(_token: str) -> int:
    return 1


def repetition_score(story: str, chunk_size: int = 4) -> float:
    """RoViST-NR of a story text (NLTK-compatible sentence and word splitting)."""
    return repetition_from_tokens(tokenize_story(story), chunk_size)


@dataclass
class RepetitionConfig(RewardConfig):
    chunk_size: int = option(4, "Intra-sentence n-gram length (4 in the paper and the authors' tool).", min=1)


class Repetition(Reward):
    """RoViST-NR non-redundancy as a reward (higher = less repetitive).

    Finite scores are at most 1; they are usually in [0, 1] but can be negative
    for degenerate text (see module docs). ``chunk_size`` is the intra-sentence
    n-gram length (4 in the paper and the authors' tool).
    """

    name = "repetition"
    higher_is_better = True
    value_range = (-math.inf, 1.0)
    config_class = RepetitionConfig

    def _score_batch(self, stories: list[str], **context) -> np.ndarray:
        out = np.empty(len(stories))
        unscorable = []
        for i, story in enumerate(stories):
            sentences = tokenize_story(story)  # once: the reason is read from it too
            value = repetition_from_tokens(sentences, self.chunk_size)
            if math.isnan(value):
                unscorable.append((i, len(sentences)))
            out[i] = value
        # Reasons are recorded only once the whole batch has scored, so a batch
        # retried story by story after an exception is not counted twice.
        for i, n_sentences in unscorable:
            # NaN only when no inter-sentence comparison is left.
            start = repr(stories[i][:60])
            if n_sentences < 2:
                out[i] = self._unscorable("fewer than 2 sentences", f"{n_sentences} sentence(s) in {start}")
            else:
                out[i] = self._unscorable("no inter-sentence comparison", f"no sentence keeps a token in {start}")
        return out
