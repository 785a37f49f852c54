"""``storyrl compare`` and storyrl.eval.compare: d_HM per system with paired
bootstrap intervals against a baseline, score means, story statistics;
checked against plainly written computations."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.data import ScoreTable
from storyrl.eval.compare import (compare_systems, comparison_markdown, paired_difference, story_statistics,
                                  system_seed)

HUMAN = {"groovist": {"a": 0.5, "b": -0.2, "c": 1.5, "d": 0.1},
         "coherence": {"a": 0.9, "b": 0.8, "c": 0.85, "d": 0.7},
         "repetition": {"a": 0.95, "b": 0.9, "c": 0.92, "d": 0.99}}
ZERO = {"groovist": {"a": 0.1, "b": 0.3, "c": 0.2, "d": 0.4},
        "coherence": {"a": 0.7, "b": math.nan, "c": 0.8, "d": 0.6},
        "repetition": {"a": 0.8, "b": 0.7, "c": 0.9, "d": 0.85}}
TUNED = {"groovist": {"a": 0.45, "b": -0.1, "c": 1.0, "d": 0.2},
         "coherence": {"a": 0.88, "b": 0.79, "c": 0.8, "d": 0.75},
         "repetition": {"a": 0.93, "b": 0.91, "c": 0.9, "d": 0.97},
         "kl": {"a": 1.5, "b": 2.5, "c": math.nan, "d": 0.5}}
STORIES = {"a": "A dog ran. A dog sat.", "b": "", "c": "One.", "d": "We went home. It rained. We slept."}
#: a system d_HM can count no story of (no finite coherence): NaN d_HM, no shared id with a baseline
NONE = {**ZERO, "coherence": {k: math.nan for k in "abcd"}}


def table(columns: dict) -> ScoreTable:
    ids = list(next(iter(columns.values())))
    return ScoreTable(ids, {m: dict(v) for m, v in columns.items()})


def percentile(values: list[float], q: float) -> float:
    """numpy's default ('linear') percentile, written out."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def test_paired_difference_is_the_mean_difference_and_its_bootstrap_percentiles():
    after = {"a": 1.0, "b": 2.0, "c": 4.0, "x": 9.0}
    before = {"a": 0.5, "b": 2.5, "c": 1.0, "y": 7.0}
    got = paired_difference(after, before, resamples=50, seed=3, level=0.9)
    diffs = [after[k] - before[k] for k in ("a", "b", "c")]  # shared keys, sorted
    draws = np.random.default_rng(3).integers(0, 3, size=(50, 3))  # the draws, as documented: ids resampled
    means = [sum(diffs[i] for i in row) / 3 for row in draws.tolist()]
    assert got["n"] == 3 and got["delta"] == pytest.approx(sum(diffs) / 3)
    assert got["low"] == pytest.approx(percentile(means, 5)) and got["high"] == pytest.approx(percentile(means, 95))
    wider = paired_difference(after, before, resamples=50, seed=3, level=0.99)
    assert wider["low"] <= got["low"] and wider["high"] >= got["high"] and wider != got
    assert paired_difference(after, before, resamples=50, seed=4, level=0.9) != got
    assert paired_difference({"a": 1.0}, {"b": 1.0})["n"] == 0
    for bad, match in (({"resamples": 0}, "resamples"), ({"level": 1.0}, "level")):
        with pytest.raises(ValueError, match=match):
            paired_difference(after, before, **bad)


def test_story_statistics_by_hand():
    got = story_statistics(list(STORIES.values()))
    # sentences 2, 0, 1, 3; words 8 ("a dog ran . a dog sat ."), 0, 2, 10
    assert got["sentences"] == pytest.approx(6 / 4) and got["words"] == pytest.approx(20 / 4)
    unigrams = "a dog ran . a dog sat . one . we went home . it rained . we slept .".split()
    assert got["distinct_1"] == pytest.approx(len(set(unigrams)) / len(unigrams))
    bigrams = [("a", "dog"), ("dog", "ran"), ("ran", "."), (".", "a"), ("a", "dog"), ("dog", "sat"), ("sat", "."),
               ("one", "."), ("we", "went"), ("went", "home"), ("home", "."), (".", "it"), ("it", "rained"),
               ("rained", "."), (".", "we"), ("we", "slept"), ("slept", ".")]
    assert got["distinct_2"] == pytest.approx(len(set(bigrams)) / len(bigrams))
    assert got["one_sentence"] == pytest.approx(2 / 4) and got["empty"] == pytest.approx(1 / 4)
    assert all(math.isnan(v) for v in story_statistics([]).values())
    # distinct-n is over lower-cased words: "The" and "the" are one word (the dog ran . the dog sat .)
    cased = story_statistics(["The dog ran. the dog sat."])
    assert cased["distinct_1"] == pytest.approx(5 / 8) and cased["distinct_2"] == pytest.approx(6 / 7)


def per_story_dhm(human: dict, model: dict, ids, metrics) -> dict[str, dict[str, float]]:
    """|human - model| per story and dimension (grounding: tanh of GROOViST), and their mean, for the
    stories whose every score is finite on both sides."""
    out = {"d_hm": {}}
    for sid in ids:
        values = [(human[m][sid], model[m][sid]) for m in metrics]
        if not all(math.isfinite(h) and math.isfinite(g) for h, g in values):
            continue
        dists = {}
        for m, (h, g) in zip(metrics, values):
            name = "grounding" if m == "groovist" else m
            dists[name] = abs(math.tanh(h) - math.tanh(g)) if m == "groovist" else abs(h - g)
            out.setdefault(name, {})[sid] = dists[name]
        out["d_hm"][sid] = sum(dists.values()) / len(dists)
    return out


@pytest.mark.parametrize("metrics", [None, ["repetition", "coherence"]])
def test_compare_systems_against_a_plain_computation(metrics):
    systems = {"zero": (table(ZERO), STORIES), "tuned": (table(TUNED), {"a": "x", "b": "y y."})}
    got = compare_systems(table(HUMAN), list(STORIES.values()), systems, baseline="zero", metrics=metrics,
                          resamples=100, seed=7)
    used = metrics or ["groovist", "coherence", "repetition"]
    assert got.metrics == used
    zero, tuned = got.systems
    ref_zero = per_story_dhm(HUMAN, ZERO, "abcd", used)
    ref_tuned = per_story_dhm(HUMAN, TUNED, "abcd", used)
    for result, ref in ((zero, ref_zero), (tuned, ref_tuned)):
        assert result.n == len(ref["d_hm"])
        assert result.d_hm == pytest.approx(sum(ref["d_hm"].values()) / len(ref["d_hm"]))
        for dim, values in ref.items():
            if dim != "d_hm":
                assert result.distances[dim] == pytest.approx(sum(values.values()) / len(values))
    assert zero.deltas == {}
    for key in ("d_hm", *tuned.distances):
        shared = sorted(set(ref_tuned[key]) & set(ref_zero[key]))
        diff = [ref_tuned[key][k] - ref_zero[key][k] for k in shared]
        want = paired_difference(ref_tuned[key], ref_zero[key], resamples=100, seed=system_seed(7, "tuned"))
        assert tuned.deltas[key]["delta"] == pytest.approx(sum(diff) / len(diff))
        assert tuned.deltas[key] == pytest.approx(want)
    assert tuned.means["kl"] == pytest.approx(1.5) and "kl" not in zero.means  # NaN left out
    assert tuned.statistics == story_statistics(["x", "y y."]) and tuned.stories == 2
    assert got.human["statistics"] == story_statistics(list(STORIES.values()))
    assert got.human["means"]["repetition"] == pytest.approx(np.mean(list(HUMAN["repetition"].values())))


def test_default_metrics_are_the_columns_every_table_has():
    """A system without a groovist column: d_HM falls back to the columns all tables share."""
    partial = {m: v for m, v in TUNED.items() if m != "groovist"}
    got = compare_systems(table(HUMAN), [], {"zero": (table(ZERO), STORIES), "tuned": (table(partial), STORIES)},
                          baseline="zero", resamples=20)
    assert got.metrics == ["coherence", "repetition"]
    ref = per_story_dhm(HUMAN, partial, "abcd", got.metrics)["d_hm"]
    assert got.systems[1].d_hm == pytest.approx(sum(ref.values()) / len(ref))


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Each Markdown table of ``text`` as rows {header: cell}; every row has as many cells as the header."""
    tables, header = [], None
    for line in text.splitlines() + [""]:
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip()[1:-1].split("|")]
        if header is None:
            header = cells
            assert len(set(header)) == len(header), f"a column twice: {header}"
            tables.append([])
        elif not set(line) <= set("|-"):
            assert len(cells) == len(header), f"{cells} under {header}"
            tables[-1].append(dict(zip(header, cells)))
    return tables


def interval(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[+-]\d+\.\d+", cell)]


def test_markdown_cells_are_the_comparisons_figures():
    systems = {"zero": (table(ZERO), STORIES), "tuned": (table(TUNED), STORIES), "none": (table(NONE), STORIES)}
    got = compare_systems(table(HUMAN), list(STORIES.values()), systems, baseline="zero", resamples=50)
    text = comparison_markdown(got)
    tables = markdown_tables(text)
    assert len(tables) == 2  # per system, then each dimension's paired difference
    main, dims = ({row["system"]: row for row in t} for t in tables)
    assert list(main) == ["human", "zero", "tuned", "none"] and list(dims) == ["tuned", "none"]  # no baseline row
    delta = "Δ d_HM vs zero [95% CI]"
    zero, tuned, none = got.systems
    assert main["zero"][delta] == "" and interval(main["tuned"][delta]) == pytest.approx(
        [tuned.deltas["d_hm"][k] for k in ("delta", "low", "high")], abs=5e-5)
    for dim in ("grounding", "coherence", "repetition"):
        assert float(main["tuned"][f"d {dim}"]) == pytest.approx(tuned.distances[dim], abs=5e-5)
        assert interval(dims["tuned"][f"Δ d {dim} [95% CI]"]) == pytest.approx(
            [tuned.deltas[dim][k] for k in ("delta", "low", "high")], abs=5e-5)
        assert dims["none"][f"Δ d {dim} [95% CI]"] == "–"
    assert float(main["tuned"]["kl"]) == pytest.approx(1.5) and float(main["human"]["coherence"]) == pytest.approx(
        np.mean(list(HUMAN["coherence"].values())), abs=5e-4)
    # what is not a number is a dash, never nan: no countable story, no shared id with the baseline
    assert math.isnan(none.d_hm) and none.deltas["d_hm"]["n"] == 0
    assert main["none"]["d_HM"] == "–" and main["none"][delta] == "–" and main["none"]["d grounding"] == "–"
    assert not [c for t in tables for row in t for c in row.values() if "nan" in c.lower()]


def test_no_baseline_no_differences_and_bad_names():
    systems = {"zero": (table(ZERO), STORIES)}
    assert compare_systems(table(HUMAN), [], systems).systems[0].deltas == {}
    with pytest.raises(ValueError, match="baseline 'other' is not one of the systems"):
        compare_systems(table(HUMAN), [], systems, baseline="other")
    with pytest.raises(ValueError, match="no system"):
        compare_systems(table(HUMAN), [], {})
    with pytest.raises(ValueError, match="no d_HM score column"):
        compare_systems(table({"kl": {"a": 1.0}}), [], systems)


@pytest.fixture
def files(tmp_path):
    def csv(name, columns):
        ids = list(next(iter(columns.values())))
        lines = ["story_id," + ",".join(columns)]
        lines += [sid + "," + ",".join("" if math.isnan(columns[m][sid]) else repr(columns[m][sid]) for m in columns)
                  for sid in ids]
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    human_stories = tmp_path / "human.jsonl"
    human_stories.write_text("".join(json.dumps({"story_id": k, "story": v}) + "\n" for k, v in STORIES.items()))
    zero_stories = tmp_path / "zero.json"
    zero_stories.write_text(json.dumps(STORIES))
    kl = {"kl": TUNED["kl"]}
    tuned = {k: v for k, v in TUNED.items() if k != "kl"}
    return {"dir": tmp_path, "human": [str(human_stories), csv("human.csv", HUMAN)],
            "none": ["none", str(zero_stories), csv("none.csv", NONE)],
            "zero": ["zero", str(zero_stories), csv("zero.csv", ZERO)],
            "tuned": ["tuned", str(zero_stories), csv("tuned.csv", tuned)], "kl": ["tuned", csv("kl.csv", kl)]}


def invoke(*args):
    return CliRunner().invoke(main, ["compare", *map(str, args)])


def test_the_command_writes_the_tables_and_json(files):
    out, js = files["dir"] / "r.md", files["dir"] / "r.json"
    result = invoke("--human", *files["human"], "--system", *files["zero"], "--system", *files["tuned"],
                    "--scores", *files["kl"], "--resamples", 100, "-o", out, "--json", js)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    data = json.loads(js.read_text())
    assert summary["baseline"] == "zero" == data["baseline"]
    want = compare_systems(table(HUMAN), list(STORIES.values()),
                           {"zero": (table(ZERO), STORIES), "tuned": (table(TUNED), STORIES)}, baseline="zero",
                           resamples=100)
    assert [s["d_hm"] for s in data["systems"]] == pytest.approx([s.d_hm for s in want.systems])
    assert data["systems"][1]["means"]["kl"] == pytest.approx(1.5)
    text = out.read_text()
    assert text.count("\n| ") >= 4 and "| human | 4 |" in text and "Δ d_HM vs zero [95% CI]" in text
    again = invoke("--human", *files["human"], "--system", *files["zero"], "-o", out)
    assert again.exit_code != 0 and "exists: use --overwrite" in again.output
    replaced = invoke("--human", *files["human"], "--system", *files["zero"], "-o", out, "--overwrite",
                      "--baseline", "zero", "--level", 0.5)
    assert replaced.exit_code == 0 and "50% CI" in out.read_text()


@pytest.mark.parametrize("extra, message", [
    (["--system", "zero", "x", "y"], "File 'x' does not exist"),
    (["--baseline", "nope"], "--baseline nope: no --system of that name"),
    (["--scores", "nope", "@kl"], "--scores nope: no --system of that name"),
    (["--system", "@zero"], "--system zero: given twice"),
    (["--metrics", "bleu"], "unknown d_HM metric 'bleu'"),
])
def test_bad_options_are_one_line(files, extra, message):
    extra = [files["kl"][1] if e == "@kl" else e for e in extra]
    if "@zero" in extra:
        extra = ["--system", *files["zero"]]
    result = invoke("--human", *files["human"], "--system", *files["zero"], *extra, "-o", files["dir"] / "r.md")
    assert result.exit_code != 0 and message in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1


@pytest.mark.parametrize("args, message", [
    (["-o", "r.txt"], "--out r.txt: the tables are Markdown; name it *.md"),
    (["-o", "r.md", "--json", "r.txt"], "--json r.txt: name it *.json"),
    (["--system", "a|b", "@stories", "@scores", "-o", "r.md"], "a name must be non-empty text without '|'"),
])
def test_output_suffixes_and_system_names_are_checked(files, args, message):
    args = [files["zero"][1] if a == "@stories" else files["zero"][2] if a == "@scores" else a for a in args]
    args = [files["dir"] / a if a.startswith("r.") else a for a in args]
    result = invoke("--human", *files["human"], "--system", *files["zero"], *args)
    assert result.exit_code == 2 and message in result.output.replace(str(files["dir"]) + "/", "")
    assert not list(files["dir"].glob("r.*"))


@pytest.mark.parametrize("clash", ["out is a --scores file", "json is a story file", "json exists"])
def test_no_output_replaces_an_input_or_an_existing_file(files, clash):
    """--out and --json are checked against every input (--scores included) and, without --overwrite, against
    existing files, before anything is written."""
    scores_md = files["dir"] / "kl.md"  # read_scores takes any name but .json as CSV
    scores_md.write_text((files["dir"] / "kl.csv").read_text())
    out, js = files["dir"] / "r.md", files["dir"] / "r.json"
    flags = ["--overwrite"]
    if clash == "out is a --scores file":
        out = scores_md
    elif clash == "json is a story file":
        js = files["dir"] / "zero.json"
    else:
        js.write_text("{}\n")
        flags = []
    before = {p: p.read_text() for p in files["dir"].iterdir()}
    result = invoke("--human", *files["human"], "--system", *files["zero"], "--system", *files["tuned"],
                    "--scores", "tuned", scores_md, "-o", out, "--json", js, *flags)
    assert result.exit_code != 0
    assert ("is also an input file" if flags else "exists: use --overwrite") in result.output
    assert {p: p.read_text() for p in files["dir"].iterdir()} == before  # nothing written, nothing replaced


def strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_has_no_nan_and_a_run_nothing_counts_in_fails(files):
    out, js = files["dir"] / "r.md", files["dir"] / "r.json"
    result = invoke("--human", *files["human"], "--system", *files["zero"], "--system", *files["none"],
                    "--resamples", 20, "-o", out, "--json", js)
    assert result.exit_code == 0, result.output
    data = strict_json(js.read_text())
    none = data["systems"][1]
    assert none["n"] == 0 and none["d_hm"] is None and none["deltas"]["d_hm"]["delta"] is None
    assert strict_json(result.stdout.strip().splitlines()[-1])["none"] is None
    alone = invoke("--human", *files["human"], "--system", *files["none"], "-o", out, "--overwrite")
    assert alone.exit_code != 0 and "no system has a story d_HM can count" in alone.output


def test_a_score_file_that_is_no_score_table_is_named(files):
    bad = files["dir"] / "bad.csv"
    bad.write_text("story_id,coherence\na,high\n")
    result = invoke("--human", *files["human"], "--system", "zero", files["zero"][1], bad, "-o", files["dir"] / "r.md")
    assert result.exit_code != 0 and str(bad) in result.output and "high" in result.output


def test_random_module_untouched():
    """The bootstrap has its own generator: the global random state is not used or changed."""
    state = random.getstate(), np.random.get_state()[1].copy()
    paired_difference({"a": 1.0, "b": 2.0}, {"a": 0.0, "b": 0.0}, resamples=10)
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()


def test_seed_and_resamples_reach_the_intervals(files):
    def interval(*extra):
        js = files["dir"] / "i.json"
        result = invoke("--human", *files["human"], "--system", *files["zero"], "--system", *files["tuned"], "-o",
                        files["dir"] / "i.md", "--json", js, "--overwrite", *extra)
        assert result.exit_code == 0, result.output
        delta = json.loads(js.read_text())["systems"][1]["deltas"]["d_hm"]
        return delta["low"], delta["high"]

    first = interval("--seed", 0, "--resamples", 30)
    assert interval("--seed", 0, "--resamples", 30) == first
    assert interval("--seed", 5, "--resamples", 30) != first
    assert interval("--seed", 0, "--resamples", 31) != first


def test_a_systems_interval_does_not_depend_on_the_others():
    alone = compare_systems(table(HUMAN), [], {"zero": (table(ZERO), STORIES), "tuned": (table(TUNED), STORIES)},
                            baseline="zero", resamples=50)
    more = compare_systems(table(HUMAN), [], {"zero": (table(ZERO), STORIES), "other": (table(HUMAN), STORIES),
                                              "tuned": (table(TUNED), STORIES)}, baseline="zero", resamples=50)
    assert alone.systems[1].deltas == more.systems[2].deltas
    assert system_seed(0, "a") != system_seed(0, "b") and system_seed(2**32 - 1, "a") < 2**32
