"""ROUGE-L of a story against its references, computed by Google's
``rouge-score`` (the longest common subsequence over the whole story, not
the summary-level ROUGE-Lsum).

Several references: rouge-score's ``score_multi``, which keeps the best
reference, so the reference-absent rule only adds the dropping of
identical references (:mod:`storyrl.rewards.reference_based`).
"""

from __future__ import annotations

from dataclasses import dataclass

from storyrl.config import option
from storyrl.rewards.reference_based import ReferenceConfig, ReferenceReward

__all__ = ["RougeL", "RougeLConfig"]


@dataclass
class RougeLConfig(ReferenceConfig):
    measure: str = option("fmeasure", "Which ROUGE-L figure: fmeasure, precision or recall.",
                          choices=("fmeasure", "precision", "recall"))
    use_stemmer: bool = option(False, "Porter-stem words first (rouge-score's use_stemmer).")


class RougeL(ReferenceReward):
    """ROUGE-L (rouge-score) of the story against its best reference, in [0, 1]."""

    name = "rouge_l"
    config_class = RougeLConfig

    def _setup(self) -> None:
        if getattr(self, "_scorer", None) is None:
            from rouge_score.rouge_scorer import RougeScorer

            self._scorer = RougeScorer(["rougeL"], use_stemmer=self.args.use_stemmer)

    def _multi(self, story: str, references: list[str]) -> float:
        # score_multi picks the reference by F-measure, whatever is reported.
        return float(getattr(self._scorer.score_multi(references, story)["rougeL"], self.args.measure))

    def _single(self, story: str, reference: str) -> float:
        return float(getattr(self._scorer.score(reference, story)["rougeL"], self.args.measure))
