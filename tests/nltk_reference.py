"""Independent reference for the authors' splitting, built on NLTK 3.8's own
Punkt algorithm and Treebank word tokenizer (no downloaded model data).

Used by tests and benchmarks only: it is the "straightforward implementation"
storyrl's fast splitter and repetition score are checked against.
"""
from __future__ import annotations

import numpy as np
from nltk.tokenize.destructive import NLTKWordTokenizer
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

# Abbreviations NLTK's English Punkt model knows and that occur in story text
# (reference-notes.md).
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "vs", "u.s", "a.m", "t.j", "ok", "ill", "wash"}


class _EnglishLikePunkt(PunktSentenceTokenizer):
    """Untrained Punkt plus the English model's behaviour on an ellipsis:
    an ellipsis followed by a capitalised word ends the sentence."""

    def _second_pass_annotation(self, aug_tok1, aug_tok2):
        if aug_tok2 is not None and aug_tok1.ellipsis and aug_tok2.first_upper:
            aug_tok1.sentbreak = True
            return "ellipsis + capital"
        return super()._second_pass_annotation(aug_tok1, aug_tok2)


_params = PunktParameters()
_params.abbrev_types = set(ABBREVIATIONS)
_punkt = _EnglishLikePunkt(_params)
_treebank = NLTKWordTokenizer()


def sent_tokenize(text: str) -> list[str]:
    return _punkt.tokenize(text)


def word_tokenize(text: str) -> list[str]:
    # nltk.word_tokenize re-splits its input into sentences first.
    return [tok for sent in sent_tokenize(text) for tok in _treebank.tokenize(sent)]


def repetition(story: str, ngram_len: int = 4) -> float:
    """RoViST-NR with the authors' pair loops (see reference-notes.md)."""
    words = [word_tokenize(s)[:-1] for s in sent_tokenize(story)]
    inter = []
    for i in range(1, len(words)):
        for j in range(i):
            union = len(set(words[i] + words[j]))
            if union == 0:  # the authors skip it; it is not counted in the mean
                continue
            inter_count = sum(1 for a in words[i] for b in words[j] if a == b)
            inter.append(inter_count / union)
    intra = []
    for toks in words:
        for i in range(0, len(toks), ngram_len):
            prev, nxt = toks[i : i + ngram_len], toks[i + ngram_len : i + 2 * ngram_len]
            if not nxt:
                continue
            union = len(set(prev + nxt))
            if union == 0:  # as the authors' loop (cannot happen: nxt is non-empty)
                continue
            intra.append(sum(1 for a in prev for b in nxt if a == b) / union)
    if not inter:  # fewer than two sentences, or every comparison skipped
        return float("nan")
    return float(1 - np.mean([np.mean(inter), np.mean(intra) if intra else 0]))
