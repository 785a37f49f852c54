"""Vrank (Hsu et al., 2022): a learned, reference-free judge of story PAIRS,
trained on VHED's human rankings (``storyrl train vrank``; model in
:mod:`storyrl.models.vrank`).

The model reads ``(story1, story2)`` and predicts the rank gap
``avg_rank(story1) - avg_rank(story2)`` (lower rank = better). storyrl turns
it around so that every method here says POSITIVE = the first story is better:

- :meth:`Vrank.compare` ``(first, second)``: ``-predicted_gap`` per pair. The
  paper reads one order only (``symmetric=False``, default); with
  ``symmetric=True`` both orders are read and averaged,
  ``(g(second, first) - g(first, second)) / 2``, which makes
  ``compare(a, b) == -compare(b, a)`` exactly, at twice the cost (the model
  is trained on both orders but is not antisymmetric by construction).
- :meth:`Vrank.score` (the reward): ``compare(stories, reference)``, the
  candidate against its sample's reference story (context ``reference``, one
  string per story). A story without a reference (no column, None, empty
  text) is unscorable: NaN, None through TRL.
- :meth:`Vrank.rank`: a group of candidates of one sequence ordered best
  first. Every ordered pair (i, j), i != j, is compared (batched, n(n-1)
  pairs); a candidate's preference is the mean over the others of
  ``(compare(i, j) - compare(j, i)) / 2`` (both orders, whatever
  ``symmetric`` says), and candidates are sorted by it, descending, ties by
  index; an unscorable candidate (not text, empty) goes last.

Values are in rank-gap units (VHED's ``label`` spans about [-1, 1], or the
``rank_norm`` scale when the model was trained on it); the sign is what the
paper evaluates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.models.runtime import ModelFailure
from storyrl.rewards.base import ModelConfig, Reward, as_list, clean_text


@dataclass
class VrankConfig(ModelConfig):
    model: str | None = option(None, "A storyrl Vrank directory (storyrl train vrank) or a hub repository holding "
                               "one.")
    tokenizer: str | None = option(None, "Tokenizer when the model directory has none (name or path).")
    max_length: int = option(512, "Token limit of a story pair (both stories cut fairly: longest_first).", min=8)
    batch_size: int = option(32, "Story pairs per forward pass (sorted by length to limit padding).", min=1)
    symmetric: bool = option(False, "Average both orders of each pair (the paper reads one order).")


def _valid(text: Any) -> bool:
    return isinstance(text, str) and bool(text.strip())


class Vrank(Reward):
    """Vrank as a reward: the candidate against its reference story, positive
    = candidate better. Options: :class:`VrankConfig`."""

    name = "vrank"
    higher_is_better = True
    config_class = VrankConfig

    def _loaded(self):
        """(model, tokenizer, device, dtype), loaded once per process."""
        from storyrl.models.runtime import (autocast_forward, check_runs, resolve_device, resolve_dtype,
                                            resolve_precision, shared_model)
        from storyrl.models.vrank import encode_story_pairs, load_vrank_model

        if self.model is None:
            raise ValueError("vrank needs a trained model: model=<storyrl Vrank directory> (storyrl train vrank)")
        device = resolve_device(self.device)
        precision = resolve_precision(self.precision, device)
        dtype = resolve_dtype(precision, device)

        def load():
            net, tokenizer = load_vrank_model(self.model, self.tokenizer)
            # Weights in the precision's dtype, autocast on top (as coherence).
            net = net.to(device, dtype).eval()
            check_runs(lambda: autocast_forward(net, encode_story_pairs(tokenizer, ["a b."], ["c d."]), device, dtype),
                       f"vrank model {self.model}", precision, device)
            return net, tokenizer

        net, tokenizer = shared_model(("vrank", self.model, self.tokenizer, str(device), precision), load)
        return net, tokenizer, device, dtype

    def _setup(self) -> None:
        self._loaded()

    # -- the model, batched ----------------------------------------------------------
    def predicted_gaps(self, firsts: Sequence[str], seconds: Sequence[str]) -> np.ndarray:
        """The model's raw output (avg_rank(first) - avg_rank(second)) for
        valid text pairs; pairs sorted by length into batches of ``batch_size``."""
        from storyrl.models.runtime import autocast_forward, check_finite, resolve_precision
        from storyrl.models.vrank import encode_story_pairs

        net, tokenizer, device, dtype = self._loaded()
        out = np.empty(len(firsts))
        order = sorted(range(len(firsts)), key=lambda k: len(firsts[k]) + len(seconds[k]))
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            batch = encode_story_pairs(
                tokenizer, [firsts[k] for k in index], [seconds[k] for k in index], self.max_length
            )
            gaps = autocast_forward(net, batch, device, dtype)
            check_finite(gaps, f"vrank model {self.model}", resolve_precision(self.precision, device))
            out[index] = gaps.cpu().numpy()
        return out

    def _preferences(self, firsts: list[str], seconds: list[str]) -> np.ndarray:
        """-gap (positive = first better), averaged with the other order when
        ``symmetric``; inputs are valid texts."""
        if not firsts:
            return np.empty(0)
        if not self.symmetric:
            return -self.predicted_gaps(firsts, seconds)
        gaps = self.predicted_gaps(firsts + seconds, seconds + firsts)
        n = len(firsts)
        return (gaps[n:] - gaps[:n]) / 2.0

    # -- public API ------------------------------------------------------------------
    def compare(self, first: Sequence[Any], second: Sequence[Any], **context: Any) -> np.ndarray:
        """One float per pair, POSITIVE = ``first[i]`` is the better story;
        NaN (counted in ``stats["reasons"]``) when either is not text or empty.
        ``context`` is accepted for the pairwise-metric interface and unused
        (Vrank reads no images)."""
        first = as_list(first, "first", self.name)
        second = as_list(second, "second", self.name)
        if len(first) != len(second):
            raise ValueError(f"{self.name}: {len(first)} first stories for {len(second)} second stories")
        out = np.full(len(first), np.nan)
        keep = []
        for i, (a, b) in enumerate(zip(first, second)):
            if _valid(a) and _valid(b):
                keep.append(i)
            else:
                self._unscorable("pair story missing or empty", f"pair {i}")
        if keep:
            self._setup()
            try:
                out[keep] = self._preferences([clean_text(first[i]) for i in keep],
                                              [clean_text(second[i]) for i in keep])
            except ModelFailure as exc:
                raise self._model_failed(exc) from exc
        return out

    def _score_batch(self, stories: list[str], reference: Sequence[Any] | None = None, **_: Any) -> np.ndarray:
        out = np.full(len(stories), np.nan)
        if reference is None:
            for _story in stories:
                self._unscorable("no reference story (context 'reference')")
            return out
        keep = []
        for i, (story, ref) in enumerate(zip(stories, reference)):
            if not _valid(ref):
                self._unscorable("reference missing or empty")
            elif not story.strip():
                self._unscorable("empty story")
            else:
                keep.append(i)
        if keep:
            out[keep] = self._preferences([stories[i] for i in keep], [clean_text(reference[i]) for i in keep])
        return out

    def preference_scores(self, stories: Sequence[Any]) -> np.ndarray:
        """Each candidate's mean preference over the others (module docs);
        NaN for a candidate that is not text or empty, which is left out of
        the others' means."""
        stories = as_list(stories, "stories", self.name)
        valid = [i for i, s in enumerate(stories) if _valid(s)]
        out = np.full(len(stories), np.nan)
        for i in range(len(stories)):
            if i not in valid:
                self._unscorable("candidate missing or empty", f"candidate {i}")
        if len(valid) == 1:
            out[valid[0]] = 0.0
        if len(valid) < 2:
            return out
        self._setup()
        texts = {i: clean_text(stories[i]) for i in valid}
        pairs = [(i, j) for i in valid for j in valid if i != j]
        try:
            gaps = self.predicted_gaps([texts[i] for i, _ in pairs], [texts[j] for _, j in pairs])
        except ModelFailure as exc:
            raise self._model_failed(exc) from exc
        prefer = {pair: -gap for pair, gap in zip(pairs, gaps)}  # positive = i better than j
        for i in valid:
            out[i] = float(np.mean([(prefer[(i, j)] - prefer[(j, i)]) / 2.0 for j in valid if j != i]))
        return out

    def rank(self, stories: Sequence[Any]) -> list[int]:
        """Indices of ``stories`` (candidates of one sequence), best first
        (module docs: mean preference from all ordered pairs; ties by index;
        unscorable candidates last)."""
        prefs = self.preference_scores(stories)
        return sorted(range(len(prefs)), key=lambda i: (math.isnan(prefs[i]), -prefs[i] if not math.isnan(prefs[i]) else 0.0, i))
