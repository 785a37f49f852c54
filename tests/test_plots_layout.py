"""The report charts (ablation, meta-eval, sweep): legends never cover a bar
(or any data: :func:`overlaps`, which tests/test_example_rl_vist.py uses
for the example's plot too), a value without a number (NaN) is marked,
never silently dropped, and neither is a bar of 0."""

import math

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from storyrl.eval.ablation_report import AblationResult, VariantResult, ablation_figure, plot_ablation
from storyrl.eval.meta_eval_report import figure as meta_eval_figure
from storyrl.eval.meta_eval_report import write_report as write_meta_eval_report
from storyrl.eval.sweep import CellResult, SweepResult
from storyrl.eval.sweep_report import dhm_figure, grouped_bars, plot_dhm


def _bars(fig, renderer):
    return [(p, p.get_window_extent(renderer)) for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and math.isfinite(p.get_height()) and p.get_height() != 0]


def _hits_line(box, line) -> bool:
    """Whether a plotted line (its points, and its segments when drawn) meets ``box``."""
    path = line.get_transform().transform_path(line.get_path())
    points = path.vertices[np.isfinite(path.vertices).all(axis=1)]
    # half a marker (points to pixels) around each point
    x0, y0, x1, y1 = box.padded(line.get_markersize() * line.figure.dpi / 144).extents
    if ((points[:, 0] >= x0) & (points[:, 0] <= x1) & (points[:, 1] >= y0) & (points[:, 1] <= y1)).any():
        return True
    return line.get_linestyle() not in ("None", "", " ") and path.intersects_bbox(box, filled=False)


def _hits_collection(box, collection) -> bool:
    """Error bars and the like: any of their segments meets ``box``."""
    transform = collection.get_transform()
    return any(transform.transform_path(p).intersects_bbox(box, filled=False) for p in collection.get_paths())


def overlaps(fig) -> list[str]:
    """Legends that cover a data artist, over every axes: a bar, a plotted
    line or point, an error bar, or a label written on the data (n/a, 0, n=)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars = _bars(fig, renderer)
    assert bars or any(ax.lines for ax in fig.axes), "nothing drawn"
    hits = []
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        hits += [f"{ax.get_title()}: bar at {b.x0:.0f},{b.y0:.0f}" for _, b in bars if box.overlaps(b)]
        for other in fig.axes:
            hits += [f"{ax.get_title()}: line {line.get_label()} of {other.get_title()}" for line in other.lines
                     if line.get_visible() and _hits_line(box, line)]
            hits += [f"{ax.get_title()}: error bars of {other.get_title()}" for c in other.collections
                     if c.get_visible() and _hits_collection(box, c)]
            hits += [f"{ax.get_title()}: label {t.get_text()!r} of {other.get_title()}" for t in other.texts
                     if t.get_visible() and box.overlaps(t.get_window_extent(renderer))]
    return hits


def inside_figure(fig) -> bool:
    """Every legend within the figure (nothing cut off when saved)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bounds = fig.bbox.padded(1)
    return all(bounds.contains(*b.min) and bounds.contains(*b.max)
               for b in (ax.get_legend().get_window_extent(renderer) for ax in fig.axes))


# Every bar as tall as the tallest: there is no empty corner inside the axes,
# so a legend inside them must cover some bar.
FULL = {"a": [0.9, 0.9, 0.9], "b": [0.9, 0.9, 0.9], "c": [0.9, 0.9, 0.9]}


def test_the_check_catches_a_legend_inside_the_axes():
    fig, ax = plt.subplots(figsize=(4, 3))
    grouped_bars(ax, ["x", "y", "z"], FULL)
    ax.legend(fontsize=8)  # what the charts did before: loc="best", over the bars when none is free
    try:
        assert overlaps(fig)
    finally:
        plt.close(fig)


def test_grouped_bars_legend_outside_the_bars_and_inside_the_figure():
    fig, ax = plt.subplots(figsize=(4, 3))
    grouped_bars(ax, ["x", "y", "z"], FULL)
    fig.tight_layout()
    try:
        assert overlaps(fig) == []
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= ax.get_window_extent(renderer).x1  # right of the axes
        assert legend.x1 <= fig.bbox.x1 + 1  # tight_layout made room for it
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "c"]
    finally:
        plt.close(fig)


def test_grouped_bars_marks_each_missing_value_at_its_bar():
    fig, ax = plt.subplots()
    grouped_bars(ax, ["x", "y"], {"a": [1.0, math.nan], "b": [math.nan, math.nan]})
    try:
        marks = sorted((round(t.get_position()[0], 3), t.get_text()) for t in ax.texts)
        # width 0.4: series a at i - 0.2, b at i + 0.2
        assert marks == [(0.2, "n/a"), (0.8, "n/a"), (1.2, "n/a")]
    finally:
        plt.close(fig)


def _variant(name, value, d_hm=0.5):
    return VariantResult(name, 6, 6, 0, 0, 6, {"repetition": value, "groovist": value, "clipscore": value},
                         {"grounding": d_hm, "coherence": d_hm, "repetition": d_hm}, d_hm)


def test_ablation_png_legends_cover_no_bar(tmp_path):
    variants = [_variant(f"variant-{i}", 0.95) for i in range(4)]
    result = AblationResult(variants, _variant("human", 0.95, math.nan), ["repetition", "groovist", "clipscore"],
                            ["grounding", "coherence", "repetition"])
    fig = ablation_figure(result)
    try:
        assert overlaps(fig) == []
    finally:
        plt.close(fig)
    plot_ablation(result, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kind, rows", [
    ("pairs", [[subset, metric, 10, 0.95] for subset in ("s1", "s2", "s3") for metric in ("m1", "m2", "m3")]),
    ("ratings", [["story", metric, aspect, 10, 0.9] for aspect in ("a1", "a2") for metric in ("m1", "m2", "m3")]),
])
def test_meta_eval_png_legend_covers_no_bar(tmp_path, kind, rows):
    fig = meta_eval_figure(kind, rows, "title")
    try:
        assert overlaps(fig) == []
    finally:
        plt.close(fig)
    paths, _ = write_meta_eval_report(kind, tmp_path / "t.csv", ["h"] * len(rows[0]), rows, title="t")
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def _cell(model, setting, prompt, d_hm, prompts=1):
    distances = {d: (math.nan if math.isnan(d_hm) else d_hm) for d in ("grounding", "coherence", "repetition")}
    return CellResult(model, setting, prompt, 6, 6, 0, 0 if math.isfinite(d_hm) else 6,
                      6 if math.isfinite(d_hm) else 0, distances, d_hm, prompts)


@pytest.fixture
def sweep():
    nan = math.nan
    cells = [_cell("m1", "s", "P1", 0.9), _cell("m1", "s", "P2", nan),  # one prompt lost
             _cell("m2", "s", "P1", nan), _cell("m2", "s", "P2", nan),  # the whole model lost
             _cell("m3", "s", "P1", 0.9), _cell("m3", "s", "P2", 0.9)]
    means = [_cell("m1", "s", "mean", 0.9, 1), _cell("m2", "s", "mean", nan, 0), _cell("m3", "s", "mean", 0.9, 2)]
    return SweepResult(cells, means)


DIMS = ["grounding", "coherence", "repetition"]


def test_sweep_png_keeps_a_model_without_d_hm_and_names_what_is_missing(sweep, tmp_path):
    fig = dhm_figure(sweep, DIMS)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == ["m1\n(1 of 2 prompts)", "m2\n(0 of 2 prompts)", "m3"]
        # m2 (group 1) has no value at all: its 4 bars (3 dimensions + d_HM) are marked
        marks = [t.get_position()[0] for t in ax.texts if t.get_text() == "n/a"]
        assert len(marks) == 4 and all(0.5 < x < 1.5 for x in marks)
        notes = [t.get_text() for t in fig.texts]
        assert len(notes) == 1
        note = " ".join(notes[0].split())
        assert note == "No d_HM (left out of the means): m1 / s (P2); m2 / s (all prompts)"
        assert overlaps(fig) == []
    finally:
        plt.close(fig)
    plot_dhm(sweep, DIMS, tmp_path / "dhm.png")
    assert (tmp_path / "dhm.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_png_without_missing_cells_has_no_note(sweep):
    complete = SweepResult([c for c in sweep.cells if c.model == "m3"], [m for m in sweep.means if m.model == "m3"])
    fig = dhm_figure(complete, DIMS)
    try:
        assert len(fig.texts) == 0 and len(fig.axes[0].texts) == 0
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["m3"]
    finally:
        plt.close(fig)


def test_sweep_note_names_missing_cells_per_setting():
    nan = math.nan
    # m1 lost P2 in setting s1 only; m2 lost every prompt in s1 and none in s2
    cells = [_cell("m1", "s1", "P1", 0.9), _cell("m1", "s1", "P2", nan),
             _cell("m1", "s2", "P1", 0.9), _cell("m1", "s2", "P2", 0.9),
             _cell("m2", "s1", "P1", nan), _cell("m2", "s1", "P2", nan),
             _cell("m2", "s2", "P1", 0.9), _cell("m2", "s2", "P2", 0.9)]
    means = [_cell("m1", "s1", "mean", 0.9, 1), _cell("m1", "s2", "mean", 0.9, 2),
             _cell("m2", "s1", "mean", nan, 0), _cell("m2", "s2", "mean", 0.9, 2)]
    fig = dhm_figure(SweepResult(cells, means), DIMS)
    try:
        notes = [" ".join(t.get_text().split()) for t in fig.texts]
        assert notes == ["No d_HM (left out of the means): m1 / s1 (P2); m2 / s1 (all prompts)"]
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert labels == ["m1\ns1\n(1 of 2 prompts)", "m1\ns2", "m2\ns1\n(0 of 2 prompts)", "m2\ns2"]
    finally:
        plt.close(fig)


def test_ablation_metric_chart_marks_a_missing_mean_not_a_zero_bar():
    metrics = ["repetition", "groovist", "clipscore"]
    lost = _variant("variant-1", 0.5)
    del lost.means["groovist"]  # no story scored on it: no mean at all
    human = _variant("human", 0.5, math.nan)
    human.means["clipscore"] = math.nan  # a mean that is NaN
    result = AblationResult([_variant("variant-0", 0.5), lost], human, metrics, ["grounding", "coherence", "repetition"])
    fig = ablation_figure(result)
    try:
        left = fig.axes[0]
        assert left.get_title() == "Metrics per variant"
        width = 0.8 / 3  # 3 metrics: groovist is the middle series, clipscore the last
        marks = sorted((round(t.get_position()[0], 3), t.get_text()) for t in left.texts)
        assert marks == [(1.0, "n/a"), (round(2 + width, 3), "n/a")]
        heights = {round(p.get_x() + p.get_width() / 2, 3): p.get_height()
                   for p in left.patches if isinstance(p, Rectangle)}
        assert len(heights) == 9
        missing = {1.0, round(2 + width, 3)}
        assert all(math.isnan(h) for x, h in heights.items() if x in missing)  # no bar drawn there
        assert all(h == 0.5 for x, h in heights.items() if x not in missing)
    finally:
        plt.close(fig)


def test_pair_accuracy_chart_shows_zero_bars_and_n_per_bar():
    # subset s1: m1 at 0.0 (an empty bar but for its mark), m2 at 1.0 (the top); s2: m2, the last bar, has no pairs
    rows = [["s1", "m1", 12, 0.0], ["s1", "m2", 12, 1.0], ["s2", "m1", 7, 0.5], ["s2", "m2", 0, math.nan]]
    fig = meta_eval_figure("pairs", rows, "pair accuracy")
    try:
        ax = fig.axes[0]
        marks = sorted((round(t.get_position()[0], 2), round(t.get_position()[1], 2), t.get_text()) for t in ax.texts)
        # width 0.4: m1 at i - 0.2, m2 at i + 0.2; each label from its bar's top (0 for no bar)
        assert marks == [(-0.2, 0.0, "0  n=12"), (0.2, 1.0, "n=12"), (0.8, 0.5, "n=7"), (1.2, 0.0, "n/a  n=0")]
        # the 0.0 bar also gets a short line at 0 in m1's colour, across its bar's width
        m1 = next(p for p in ax.patches if isinstance(p, Rectangle)).get_facecolor()
        zero = [line for line in ax.lines if list(line.get_ydata()) == [0, 0]]
        assert len(zero) == 1 and np.allclose(zero[0].get_xdata(), [-0.4, 0.0])
        assert zero[0].get_color() == m1 or np.allclose(matplotlib.colors.to_rgba(zero[0].get_color()), m1)
        assert ax.get_ylim()[1] > 1.0  # the n over a bar of 1.0 stays inside the axes
        renderer = fig.canvas.get_renderer()
        inside = ax.get_window_extent(renderer).padded(1)  # every label, the n/a of the last bar too, within the axes
        assert all(inside.contains(*t.get_window_extent(renderer).min) and inside.contains(*t.get_window_extent(
            renderer).max) for t in ax.texts)
        assert overlaps(fig) == [] and inside_figure(fig)
    finally:
        plt.close(fig)
