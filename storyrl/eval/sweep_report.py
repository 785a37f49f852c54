"""The d_HM tables and chart of a prompting sweep (:mod:`storyrl.eval.sweep`):
``dhm.csv`` (every cell and every mean-over-prompts row), ``dhm.md`` (the
same as Markdown, means first) and ``dhm.png`` (grouped bars per model ×
setting: the distance per dimension and d_HM, like the paper's Figure 1).

The table and bar helpers (:func:`csv_text`, :func:`markdown_table`,
:func:`grouped_bars`) are shared with the reward ablation's report
(:mod:`storyrl.eval.ablation_report`)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["csv_text", "grouped_bars", "markdown_table", "markdown_tables", "plot_dhm", "write_report"]

_COUNTS = ["records", "stories", "failures", "unscorable", "n"]


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def csv_text(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A CSV table; NaN (no value) is an empty cell."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(headers)
    for row in rows:
        writer.writerow(["" if _nan(v) else v for v in row])
    return buffer.getvalue()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table, numbers to 4 decimals, NaN shown as "–"."""
    from tabulate import tabulate

    body = [[None if _nan(v) else v for v in row] for row in rows]
    return tabulate(body, headers=list(headers), tablefmt="github", floatfmt=".4f", missingval="–")


def grouped_bars(ax: Any, labels: Sequence[str], series: dict[str, Sequence[float]]) -> None:
    """One group of bars per label, one bar per series (NaN: no bar)."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))], list(values), width, label=name)
    ax.set_xticks(range(len(labels)), list(labels), fontsize=8)
    ax.legend(fontsize=8)


def _row(result: Any, dims: list[str]) -> list:
    return [result.model, result.setting, result.prompt, *(getattr(result, k) for k in _COUNTS),
            *(result.distances.get(d, math.nan) for d in dims), result.d_hm]


def _csv(sweep: Any, dims: list[str]) -> str:
    return csv_text(["model", "setting", "prompt", *_COUNTS, *dims, "d_hm"],
                    [_row(result, dims) for result in [*sweep.cells, *sweep.means]])


def markdown_tables(sweep: Any, dims: list[str]) -> str:
    """The mean-over-prompts table (the paper's numbers) and the per-cell table."""

    def table(rows: list, first: list[str]) -> str:
        return markdown_table([*first, *dims, "d_HM"], rows)

    means = table([[m.model, m.setting, m.prompts, m.n, m.failures, m.unscorable,
                    *(m.distances.get(d, math.nan) for d in dims), m.d_hm] for m in sweep.means],
                  ["model", "setting", "prompts", "n", "failures", "unscorable"])
    cells = table([[c.model, c.setting, c.prompt, c.n, c.failures, c.unscorable,
                    *(c.distances.get(d, math.nan) for d in dims), c.d_hm] for c in sweep.cells],
                  ["model", "setting", "prompt", "n", "failures", "unscorable"])
    note = ("n: stories counted (every score finite for model and human); failures: generations that failed; "
            "unscorable: generated stories left out for a missing or NaN score. Lower is better.")
    return (f"## d_HM, mean over prompts\n\n{means}\n\n## d_HM per cell\n\n{cells}\n\n{note}\n")


def plot_dhm(sweep: Any, dims: list[str], path: Path) -> None:
    """Grouped bars per model × setting (mean over prompts): each dimension's
    distance and d_HM. Rows without a d_HM are left out."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [m for m in sweep.means if math.isfinite(m.d_hm)]
    several = len({m.setting for m in rows}) > 1
    labels = [f"{m.model}\n{m.setting}" if several else m.model for m in rows]
    series = {name: [m.d_hm if name == "d_HM" else m.distances.get(name, math.nan) for m in rows]
              for name in [*dims, "d_HM"]}
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    grouped_bars(ax, labels, series)
    ax.set_ylabel("distance to human stories")
    ax.set_title("d_HM (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_report(sweep: Any, out: Path, dims: list[str]) -> tuple[dict[str, Path], str]:
    """Write ``dhm.csv``, ``dhm.md`` and ``dhm.png`` in ``out``; returns their
    paths and the Markdown."""
    from storyrl.output_files import replace_file

    paths = {"csv": out / "dhm.csv", "markdown": out / "dhm.md", "plot": out / "dhm.png"}
    markdown = markdown_tables(sweep, dims)
    replace_file(paths["csv"], _csv(sweep, dims), overwrite=True)
    replace_file(paths["markdown"], markdown, overwrite=True)
    plot_dhm(sweep, dims, paths["plot"])
    return paths, markdown
