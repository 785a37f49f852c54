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

__all__ = ["csv_text", "dhm_figure", "grouped_bars", "markdown_table", "markdown_tables", "plot_dhm", "write_report"]

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


def grouped_bars(ax: Any, labels: Sequence[str], series: dict[str, Sequence[float]],
                 counts: dict[str, Sequence[int]] | None = None) -> None:
    """One group of bars per label, one bar per series; a NaN (no value) is
    marked "n/a" where its bar would be, and a 0 (a bar of no height) "0"
    over a short line in its series' colour. ``counts``: per series, the n
    of each bar, written over it. The legend sits right of the axes, where
    it cannot cover a bar (save with ``bbox_inches="tight"``)."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        color = ax.bar(xs, list(values), width, label=name).patches[0].get_facecolor() if xs else None
        ns = (counts or {}).get(name)
        for i, (x, value) in enumerate(zip(xs, values)):
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            mark = "n/a" if not finite else "0" if value == 0 else ""
            if mark == "0":
                ax.plot([x - width / 2, x + width / 2], [0, 0], color=color, linewidth=3, solid_capstyle="butt",
                        clip_on=False, zorder=3)
            if ns is not None:
                mark = f"{mark}  n={ns[i]}" if mark else f"n={ns[i]}"
            if mark:  # over a positive bar's top, else from the axis up
                ax.text(x, value if finite and value > 0 else 0, mark, rotation=90, ha="center", va="bottom",
                        fontsize=6 if ns is not None else 7, color="dimgrey")
    ax.set_xticks(range(len(labels)), list(labels), fontsize=8)
    ax.set_xlim(-0.5, len(labels) - 0.5)  # a NaN bar has no extent: its n/a mark would fall off the edge
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _missing(sweep: Any) -> list[str]:
    """The model / setting / prompt cells without a d_HM (none of their
    stories scored on every metric on both sides), one entry each."""
    missing = []
    for mean in sweep.means:
        cells = [c for c in sweep.cells if (c.model, c.setting) == (mean.model, mean.setting)]
        lost = [c.prompt for c in cells if not math.isfinite(c.d_hm)]
        if lost:
            where = " / ".join(x for x in (mean.model, mean.setting) if x)
            which = "all prompts" if len(lost) == len(cells) else ", ".join(lost)
            missing.append(f"{where} ({which})")
    return missing


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


def dhm_figure(sweep: Any, dims: list[str]):
    """The figure of :func:`plot_dhm` (a matplotlib Figure, Agg)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = list(sweep.means)
    several = len({m.setting for m in rows}) > 1
    prompts = {(c.model, c.setting): 0 for c in sweep.cells}
    for c in sweep.cells:
        prompts[c.model, c.setting] += 1

    def label(m: Any) -> str:
        text = f"{m.model}\n{m.setting}" if several else m.model
        total = prompts.get((m.model, m.setting), m.prompts)
        return f"{text}\n({m.prompts} of {total} prompts)" if m.prompts < total else text

    series = {name: [m.d_hm if name == "d_HM" else m.distances.get(name, math.nan) for m in rows]
              for name in [*dims, "d_HM"]}
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    grouped_bars(ax, [label(m) for m in rows], series)
    ax.set_ylabel("distance to human stories")
    ax.set_title("d_HM (lower is better)")
    missing = _missing(sweep)
    if missing:
        import textwrap

        note = "No d_HM (left out of the means): " + "; ".join(missing)
        fig.text(0.01, 0.0, textwrap.fill(note, 110), ha="left", va="top", fontsize=7)
    fig.tight_layout()
    return fig


def plot_dhm(sweep: Any, dims: list[str], path: Path) -> None:
    """Grouped bars per model × setting (mean over prompts): each dimension's
    distance and d_HM. A model × setting without a d_HM keeps its place,
    marked "n/a"; a mean over fewer prompts than the cell count says so; a
    note under the chart lists every cell without a d_HM."""
    import matplotlib.pyplot as plt

    fig = dhm_figure(sweep, dims)
    fig.savefig(path, dpi=150, bbox_inches="tight")  # the legend and the note are outside the axes
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
