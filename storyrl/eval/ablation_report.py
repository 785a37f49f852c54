"""The results of a reward ablation (:mod:`storyrl.eval.ablation`):
``ablation.csv`` and ``ablation.md`` (one row per variant, plus the human
stories' own means for reference) and ``ablation.png`` (the metric means per
variant beside the d_HM distances per variant). The table and bar helpers
are the prompting sweep's (:mod:`storyrl.eval.sweep_report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.eval.ablation_config import HUMAN
from storyrl.eval.sweep_report import csv_text, grouped_bars, markdown_table

__all__ = ["HUMAN", "SHORT", "AblationResult", "VariantResult", "ablation_figure", "plot_ablation",
           "write_ablation_report"]

#: The d_HM dimensions' column names: grounding → d_G, ...
SHORT = {"grounding": "d_G", "coherence": "d_C", "repetition": "d_R"}
_COUNTS = ["records", "stories", "failures", "unscorable", "n"]


@dataclass
class VariantResult:
    """One row of the ablation table."""

    variant: str
    #: held-out sequences evaluated
    records: int
    #: stories generated (or found in the variant's story file)
    stories: int
    #: sequences without a story (generation failed, or missing from the story file)
    failures: int
    #: stories left out of d_HM because a d_HM score (theirs or the human's) is missing or NaN
    unscorable: int
    #: stories counted in d_HM
    n: int
    #: mean of each metric over the stories it could score
    means: dict[str, float]
    #: d_HM distance per dimension (grounding, coherence, repetition)
    distances: dict[str, float] = field(default_factory=dict)
    d_hm: float = math.nan


@dataclass
class AblationResult:
    variants: list[VariantResult]
    #: the human stories' means (counts: records, stories = human stories scored)
    human: VariantResult
    metrics: list[str]
    #: d_HM dimensions, as ``DhmResult.distances`` names them
    dimensions: list[str]
    paths: dict[str, Path] = field(default_factory=dict)
    markdown: str = ""

    def row(self, variant: str) -> VariantResult:
        return next(v for v in [*self.variants, self.human] if v.variant == variant)


def _headers(result: AblationResult) -> list[str]:
    return ["variant", *_COUNTS, *result.metrics, *(SHORT[d] for d in result.dimensions), "d_HM"]


def _rows(result: AblationResult) -> list[list[Any]]:
    return [[v.variant, *(getattr(v, k) for k in _COUNTS), *(v.means.get(m, math.nan) for m in result.metrics),
             *(v.distances.get(d, math.nan) for d in result.dimensions), v.d_hm]
            for v in [*result.variants, result.human]]


def markdown_report(result: AblationResult) -> str:
    table = markdown_table(_headers(result), _rows(result))
    dims = ", ".join(f"{SHORT[d]} = {d}" for d in result.dimensions)
    note = (f"Metric columns: the mean score of the stories each metric could score. {dims}: mean |human − model| "
            "over the n stories whose d_HM scores are all finite on both sides (grounding as tanh of GROOViST); "
            "d_HM is their mean (lower is closer to the human stories). failures: sequences without a story; "
            f"unscorable: stories left out of d_HM. The {HUMAN!r} row holds the human stories' own means.")
    return f"## Reward ablation\n\n{table}\n\n{note}\n"


def ablation_figure(result: AblationResult):
    """The figure of :func:`plot_ablation` (a matplotlib Figure, Agg)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [*result.variants, result.human]
    width = max(4.0, 0.9 * len(rows) + 2)
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 * width, 3.5))
    grouped_bars(left, [v.variant for v in rows], {m: [v.means.get(m, math.nan) for v in rows] for m in result.metrics})
    left.set_ylabel("mean score")
    left.set_title("Metrics per variant")
    series = {SHORT[d]: [v.distances.get(d, math.nan) for v in result.variants] for d in result.dimensions}
    grouped_bars(right, [v.variant for v in result.variants], {**series, "d_HM": [v.d_hm for v in result.variants]})
    right.set_ylabel("distance to human stories")
    right.set_title("d_HM (lower is better)")
    fig.tight_layout()  # room for the legends right of each axes
    return fig


def plot_ablation(result: AblationResult, path: Path) -> None:
    """Left: each metric's mean per variant (the human stories last); right:
    the d_HM distances per variant."""
    import matplotlib.pyplot as plt

    fig = ablation_figure(result)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def write_ablation_report(result: AblationResult, out: Path) -> None:
    """Write ``ablation.csv``, ``ablation.md`` and ``ablation.png`` in
    ``out``; sets ``result.paths`` and ``result.markdown``."""
    from storyrl.output_files import replace_file

    result.paths = {"csv": out / "ablation.csv", "markdown": out / "ablation.md", "plot": out / "ablation.png"}
    result.markdown = markdown_report(result)
    replace_file(result.paths["csv"], csv_text(_headers(result), _rows(result)), overwrite=True)
    replace_file(result.paths["markdown"], result.markdown, overwrite=True)
    plot_ablation(result, result.paths["plot"])
