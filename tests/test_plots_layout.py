"""The report charts (ablation, meta-eval, sweep): legends never cover a bar,
and a value without a number (NaN) is marked, never silently dropped."""

import math

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from storyrl.eval.ablation_report import AblationResult, VariantResult, ablation_figure, plot_ablation
from storyrl.eval.meta_eval_report import figure as meta_eval_figure
from storyrl.eval.meta_eval_report import write_report as write_meta_eval_report
from storyrl.eval.sweep import CellResult, SweepResult
from storyrl.eval.sweep_report import dhm_figure, grouped_bars, plot_dhm


def _bars(fig, renderer):
    return [(p, p.get_window_extent(renderer)) for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and math.isfinite(p.get_height()) and p.get_height() != 0]


def overlaps(fig) -> list[str]:
    """(legend, bar) pairs whose drawn boxes intersect, over every axes."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars = _bars(fig, renderer)
    assert bars, "no bars drawn"
    hits = []
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        hits += [f"{ax.get_title()}: bar at {b.x0:.0f},{b.y0:.0f}" for _, b in bars if box.overlaps(b)]
    return hits


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
