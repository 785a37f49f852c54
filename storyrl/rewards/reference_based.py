"""The shared part of the reference-based baselines (``bleu``, ``rouge_l``):
gathering each story's references and the VHED paper's "reference-absent"
rule.

References come from the story context: ``references`` (per story, a list
of strings or one string) and/or ``reference`` (per story, one string, the
column the other rewards use for the human story); both are used when both
are given. Without ``reference_absent`` a story is scored against all of
them at once, as the metric's own multi-reference form does. With it (Hsu
et al., 2022, Eq. 3) references identical to the story are dropped first
and the score is the maximum over the remaining references scored one at a
time; otherwise a human story in the reference set would get a perfect
score by matching itself. "Identical" compares the texts with case and
whitespace normalised. A story with no reference (left) is unscorable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards.base import Reward, RewardConfig

__all__ = ["ReferenceConfig", "ReferenceReward", "same_text", "story_references"]


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


def same_text(a: str, b: str) -> bool:
    """Whether two stories are the same text up to case and whitespace (the
    identity the reference-absent rule tests)."""
    return _normalised(a) == _normalised(b)


def story_references(reference: Any, references: Any) -> list[str] | None:
    """One story's references from its ``reference`` and ``references``
    context entries, in that order; None when an entry is not text."""
    found: list[str] = []
    for value in (reference, references):
        if value is None:
            continue
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(r, str) for r in items):
            return None
        found.extend(r for r in items if r.strip())
    return found


@dataclass
class ReferenceConfig(RewardConfig):
    reference_absent: bool = option(
        False, "Drop references identical to the story and take the max over the others (VHED's Eq. 3)."
    )


class ReferenceReward(Reward):
    """A story's similarity to its references (subclasses give the metric)."""

    value_range = (0.0, 1.0)
    config_class = ReferenceConfig

    def _single(self, story: str, reference: str) -> float:
        """The metric against one reference."""
        raise NotImplementedError

    def _multi(self, story: str, references: list[str]) -> float:
        """The metric's own multi-reference form."""
        raise NotImplementedError

    def _score_batch(self, stories: list[str], reference: Sequence | None = None,
                     references: Sequence | None = None, **_: Any) -> np.ndarray:
        n = len(stories)
        reference = [None] * n if reference is None else reference
        references = [None] * n if references is None else references
        scores = []
        for story, ref, refs in zip(stories, reference, references):
            refs = story_references(ref, refs)
            if refs is None:
                scores.append(self._unscorable("reference is not text"))
                continue
            if self.args.reference_absent:
                refs = [r for r in refs if not same_text(r, story)]
            if not refs:
                scores.append(self._unscorable("no reference"))
            elif self.args.reference_absent:
                scores.append(max(self._single(story, r) for r in refs))
            else:
                scores.append(self._multi(story, refs))
        return np.asarray(scores, dtype=np.float64)
