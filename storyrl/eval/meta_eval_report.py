"""The files of ``storyrl meta-eval``: the long-form CSV table, the same
table as Markdown beside it (``TABLE.md``, with the notes: unscorable counts,
failed metrics, data quirks) and a bar chart (``TABLE.png``): accuracy per
subset (pairs), story-level Kendall τ-b per aspect (ratings) or mean Δ
(original vs random), one bar per metric (pairs: with its n). Written atomically
(:func:`storyrl.output_files.replace_file`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from storyrl.eval.sweep_report import csv_text, grouped_bars, markdown_table

__all__ = ["report_paths", "write_report"]


def report_paths(out: Path) -> dict[str, Path]:
    """The CSV, Markdown and plot paths for ``--out TABLE.csv``."""
    return {"csv": out, "markdown": out.with_suffix(".md"), "plot": out.with_suffix(".png")}


def _series(kind: str, rows: Sequence[Sequence[Any]]) -> tuple[list[str], dict[str, list[float]], str,
                                                                 dict[str, list[int]] | None]:
    """Bar labels, one series per metric, the y label, and (pairs) the number
    of pairs behind each bar."""
    if kind == "pairs":
        labels = list(dict.fromkeys(r[0] for r in rows))
        values = {(r[0], r[1]): (r[3], r[2]) for r in rows}
        metrics = list(dict.fromkeys(r[1] for r in rows))
        series = {m: [values.get((s, m), (math.nan, 0))[0] for s in labels] for m in metrics}
        counts = {m: [values.get((s, m), (math.nan, 0))[1] for s in labels] for m in metrics}
        return labels, series, "pair accuracy", counts
    if kind == "ratings":
        story = [r for r in rows if r[0] == "story"]
        labels = list(dict.fromkeys(r[2] for r in story))
        values = {(r[2], r[1]): r[4] for r in story}
        metrics = list(dict.fromkeys(r[1] for r in story))
        return (labels, {m: [values.get((a, m), math.nan) for a in labels] for m in metrics},
                "story-level Kendall τ-b", None)
    labels = [r[0] for r in rows]
    return labels, {"mean Δ (original − best random)": [r[4] for r in rows]}, "mean Δ", None


def figure(kind: str, rows: Sequence[Sequence[Any]], title: str):
    """The bar chart of ``kind`` (a matplotlib Figure, Agg)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels, series, ylabel, counts = _series(kind, rows)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(labels) * max(1, len(series)) ** 0.5 + 2), 3.5))
    grouped_bars(ax, labels, series, counts)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if kind == "pairs":
        ax.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")  # chance
        ax.set_ylim(0, 1.2)  # room above a bar of 1.0 for its n
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    fig.tight_layout()  # room for the legend right of the axes
    return fig


def _plot(kind: str, rows: Sequence[Sequence[Any]], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(kind, rows, title)
    # savefig to a temporary name then rename: a kill never leaves half a PNG
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def write_report(kind: str, out: Path, headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 notes: Sequence[str] = (), title: str = "", overwrite: bool = False) -> tuple[dict[str, Path], str]:
    """Write the CSV, Markdown and PNG for ``kind`` (``pairs``, ``ratings``
    or ``original-vs-random``); returns their paths and the Markdown."""
    from storyrl.output_files import replace_file

    paths = report_paths(out)
    markdown = (f"# {title}\n\n" if title else "") + markdown_table(headers, rows) + "\n"
    if notes:
        markdown += "\n" + "".join(f"- {note}\n" for note in notes)
    replace_file(paths["csv"], csv_text(headers, rows), overwrite=overwrite)
    replace_file(paths["markdown"], markdown, overwrite=overwrite)
    _plot(kind, rows, paths["plot"], title)
    return paths, markdown
