"""Sentence BLEU of a story against its references, computed by sacreBLEU
(Post, 2018) and scaled to [0, 1] (sacreBLEU reports 0-100).

The whole story is one "sentence". Defaults are sacreBLEU's own for
sentence BLEU: 13a tokenisation, case-sensitive, 4-gram, exponential
smoothing, effective order. The VHED paper's BLEU-4 gave about 80% of the
stories 0, which only happens without smoothing; ``configs/rewards/
bleu_vhed.yaml`` sets ``smooth_method: none`` and ``reference_absent:
true`` for its protocol. References and the reference-absent rule:
:mod:`storyrl.rewards.reference_based`.
"""

from __future__ import annotations

from dataclasses import dataclass

from storyrl.config import option
from storyrl.rewards.reference_based import ReferenceConfig, ReferenceReward

__all__ = ["BLEU", "BLEUConfig"]


@dataclass
class BLEUConfig(ReferenceConfig):
    max_ngram_order: int = option(4, "Longest n-gram counted (BLEU-4).", min=1)
    smooth_method: str = option("exp", "sacreBLEU smoothing: exp, floor, add-k or none.",
                                choices=("exp", "floor", "add-k", "none"))
    smooth_value: float | None = option(None, "Smoothing value for floor/add-k (sacreBLEU's default when null).")
    tokenize: str = option("13a", "sacreBLEU tokenizer (13a, intl, char, none, ...).")
    lowercase: bool = option(False, "Lowercase story and references first.")
    effective_order: bool = option(True, "Ignore n-gram orders the story is too short for (sentence BLEU).")


class BLEU(ReferenceReward):
    """sacreBLEU sentence BLEU of the story against its references, in [0, 1]."""

    name = "bleu"
    config_class = BLEUConfig

    def _setup(self) -> None:
        if getattr(self, "_bleu", None) is None:
            from sacrebleu.metrics import BLEU as SacreBLEU

            a = self.args
            self._bleu = SacreBLEU(
                lowercase=a.lowercase, tokenize=a.tokenize, smooth_method=a.smooth_method,
                smooth_value=a.smooth_value, max_ngram_order=a.max_ngram_order,
                effective_order=a.effective_order,
            )

    def _multi(self, story: str, references: list[str]) -> float:
        return self._bleu.sentence_score(story, references).score / 100.0

    def _single(self, story: str, reference: str) -> float:
        return self._multi(story, [reference])
