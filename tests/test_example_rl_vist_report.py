"""examples/rl_vist over seeds: report.py's figures and conclusions against
plain computations on made-up results, the README block's shape against
what report.py writes, and run.sh's order of steps, seeds, resumption and
failure handling with every step replaced by a stub (the real steps are
tests/test_example_rl_vist.py's)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl_vist"
sys.path.insert(0, str(EXAMPLE))

import report  # noqa: E402

IDS = [str(100 + k) for k in range(40)]


def _policy(rng, dhm_shift=0.0, rep_shift=0.0, sentences=5.0, kl=1.0, recall=0.05, noise=0.004, base=None):
    """A made-up evaluate.py entry; ``base``: the start's per-sequence values to shift."""
    base = base or {"coh": {k: 0.09 + 0.01 * rng.random() for k in IDS},
                    "rep": {k: 0.05 + 0.01 * rng.random() for k in IDS},
                    "score": {k: 0.90 + 0.01 * rng.random() for k in IDS}}
    coh = {k: v + dhm_shift + rng.gauss(0, noise) for k, v in base["coh"].items()}
    rep = {k: v + dhm_shift + rng.gauss(0, noise) for k, v in base["rep"].items()}
    per_sequence = {k: (coh[k] + rep[k]) / 2 for k in IDS}
    mean = sum(per_sequence.values()) / len(IDS)
    return {"dhm": mean, "dhm_coherence": sum(coh.values()) / len(IDS), "dhm_repetition": sum(rep.values()) / len(IDS),
            "per_sequence": per_sequence, "per_sequence_dims": {"coherence": coh, "repetition": rep},
            "per_sequence_scores": {"coherence": dict(base["score"]),
                                    "repetition": {k: v + rep_shift + rng.gauss(0, noise) for k, v in base["score"].items()}},
            "per_sequence_sentences": {k: sentences + rng.gauss(0, 0.1) for k in IDS},
            "sentences": sentences, "distinct_2": 0.3, "noun_recall": recall, "kl": kl, "training": None,
            "coherence": 0.9, "repetition": 0.9 + rep_shift, "distinct_1": 0.07, "one_sentence": 0.0, "n": 80}, base


def made_up_results() -> dict:
    rng = random.Random(7)
    start, base = _policy(rng, kl=0.0, recall=0.06)
    policies = {"start": start}
    for seed in (0, 1, 2):
        policies[f"ppo_dhm@{seed}"] = _policy(rng, -0.02, kl=6.0 + seed, recall=0.04, base=base)[0]
    for seed in (0, 1, 2):
        policies[f"grpo_dhm@{seed}"] = _policy(rng, -0.015, kl=1.0 + 0.1 * seed, recall=0.07 if seed == 2 else 0.05,
                                               base=base)[0]
    # seed 1 of the repetition run learns nothing (its interval spans 0) and stays at the human repetition level
    policies["ppo_repetition@0"] = _policy(rng, -0.012, rep_shift=0.03, kl=9.0, base=base)[0]
    policies["ppo_repetition@1"] = _policy(rng, 0.0, rep_shift=0.0, kl=9.5, base=base)[0]
    for seed in (0, 1, 2):  # as good as ppo_dhm, one sentence longer
        policies[f"dpo_dhm@{seed}"] = _policy(rng, -0.02, sentences=6.0, kl=5.0, base=base)[0]
    human = {"coherence": 0.9, "repetition": 0.9, "distinct_1": 0.17, "distinct_2": 0.6, "sentences": 5.0,
             "one_sentence": 0.0, "coherence_shuffled": 0.85,
             "per_sequence_scores": {"coherence": dict(base["score"]), "repetition": dict(base["score"])}}
    for entry in policies.values():
        entry["delta"] = {"delta": 0.0, "low": 0.0, "high": 0.0}
    return {"label": "held-out", "heldout": "h.jsonl", "n_sequences": len(IDS), "samples": 2, "temperature": 0.7,
            "max_new_tokens": 96, "seed": 0, "start": "start", "human": human, "policies": policies, "times": {}}


def _bootstrap(after: dict, before: dict, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval, written out: numpy's generator draws the same indices as report's."""
    import numpy as np

    keys = sorted(set(after) & set(before))
    diff = [after[k] - before[k] for k in keys]
    rng = np.random.default_rng(seed)
    means = sorted(sum(diff[i] for i in row) / len(diff) for row in rng.integers(0, len(diff), size=(2000, len(diff))))
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def test_summary_figures_are_the_seeds_mean_sd_and_range():
    results = made_up_results()
    rows = {r["run"]: r for r in report.summary_rows(results)}
    assert list(rows) == ["ppo_dhm", "grpo_dhm", "ppo_repetition", "dpo_dhm"]  # results order
    values = [results["policies"][f"ppo_dhm@{s}"]["dhm"] for s in (0, 1, 2)]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)  # sample sd, n - 1
    r = rows["ppo_dhm"]
    assert r["seeds"] == [0, 1, 2] and r["dhm_mean"] == pytest.approx(mean) and r["dhm_sd"] == pytest.approx(sd)
    assert (r["dhm_min"], r["dhm_max"]) == (min(values), max(values))
    assert r["kl"] == pytest.approx(7.0) and rows["ppo_repetition"]["seeds"] == [0, 1]
    low, high = _bootstrap(results["policies"]["ppo_dhm@1"]["per_sequence"], results["policies"]["start"]["per_sequence"])
    assert (r["deltas"][1]["low"], r["deltas"][1]["high"]) == (pytest.approx(low), pytest.approx(high))
    assert r["deltas"][1]["delta"] == pytest.approx(values[1] - results["policies"]["start"]["dhm"])


def test_conclusions_hold_only_where_every_seed_agrees():
    results = made_up_results()
    got = {c.text: c for c in report.claims(results)}
    expect = {
        "ppo_dhm lowers held-out d_HM": (3, 3), "grpo_dhm lowers held-out d_HM": (3, 3),
        "ppo_repetition lowers held-out d_HM": (1, 2), "dpo_dhm lowers held-out d_HM": (3, 3),
        "ppo_dhm lowers the coherence distance": (3, 3), "ppo_dhm lowers the repetition distance": (3, 3),
        "ppo_repetition lowers the coherence distance": (1, 2),
        "ppo_repetition overshoots the human repetition score": (1, 2),
        "ppo: d_HM is the better target than raw repetition": (6, 6),
        "dpo_dhm lengthens the stories": (3, 3),
        "against d_HM, GRPO drifts less from the start than PPO": (9, 9),
        "grpo_dhm uses fewer of the prompt's nouns than start": (2, 3),
        "ppo_dhm uses fewer of the prompt's nouns than start": (3, 3),
    }
    for text, (ok, n) in expect.items():
        c = got[text]
        assert (sum(o for _, o in c.outcomes), len(c.outcomes)) == (ok, n), text
        assert c.holds == (ok == n), text
    assert dict(got["ppo_repetition lowers held-out d_HM"].outcomes) == {"ppo_repetition@0": True,
                                                                        "ppo_repetition@1": False}
    # one dimension moved, the other not: each claim reads its own dimension
    results["policies"]["grpo_dhm@0"]["per_sequence_dims"]["coherence"] = dict(
        results["policies"]["start"]["per_sequence_dims"]["coherence"])
    moved = {c.text: dict(c.outcomes) for c in report.claims(results)}
    assert moved["grpo_dhm lowers the coherence distance"] == {"grpo_dhm@0": False, "grpo_dhm@1": True,
                                                               "grpo_dhm@2": True}
    assert all(moved["grpo_dhm lowers the repetition distance"].values())
    drift = got["against d_HM, GRPO drifts less from the start than PPO"].outcomes
    assert [label for label, _ in drift] == [f"grpo_dhm@{a} vs ppo_dhm@{b}" for a in range(3) for b in range(3)]
    better = dict(got["ppo: d_HM is the better target than raw repetition"].outcomes)
    assert list(better) == [f"ppo_dhm@{a} vs ppo_repetition@{b}" for a in range(3) for b in range(2)]
    # "matches": every pair of seeds' interval contains 0, checked here by hand
    for other in ("ppo_dhm", "grpo_dhm"):
        c = got[f"dpo_dhm matches {other} on held-out d_HM"]
        assert len(c.outcomes) == 9
        for label, ok in c.outcomes:
            a, b = re.match(rf"dpo_dhm@(\d) vs {other}@(\d)", label).groups()
            low, high = _bootstrap(results["policies"][f"dpo_dhm@{a}"]["per_sequence"],
                                   results["policies"][f"{other}@{b}"]["per_sequence"])
            assert ok == (low <= 0 <= high), label
        assert c.holds == all(ok for _, ok in c.outcomes)
    assert 0 < sum(ok for _, ok in got["dpo_dhm matches ppo_dhm on held-out d_HM"].outcomes) < 9  # both cases met
    # no repetition run of grpo: no "better target" row for it; no rloo anywhere
    assert not any(t.startswith(("grpo:", "rloo")) or "rloo" in t for t in got)


def test_conclusions_at_their_boundaries():
    results = made_up_results()
    start = results["policies"]["start"]
    # one DPO seed a little longer on average, its interval across 0: not "lengthens" for that seed
    wobble = {k: v + (0.03 if i % 2 else -0.028) for i, (k, v) in enumerate(start["per_sequence_sentences"].items())}
    results["policies"]["dpo_dhm@1"]["per_sequence_sentences"] = wobble
    low, high = _bootstrap(wobble, start["per_sequence_sentences"])
    assert low < 0 < high and sum(wobble.values()) > sum(start["per_sequence_sentences"].values())
    # a seed whose noun recall equals the start's does not use fewer nouns
    results["policies"]["ppo_dhm@0"]["noun_recall"] = start["noun_recall"]
    got = {c.text: dict(c.outcomes) for c in report.claims(results)}
    assert got["dpo_dhm lengthens the stories"] == {"dpo_dhm@0": True, "dpo_dhm@1": False, "dpo_dhm@2": True}
    assert got["ppo_dhm uses fewer of the prompt's nouns than start"]["ppo_dhm@0"] is False


def test_one_seed_and_a_seed_without_d_hm():
    results = made_up_results()
    results["policies"] = {n: e for n, e in results["policies"].items() if "@" not in n or n.endswith("@0")}
    rows = {r["run"]: r for r in report.summary_rows(results)}
    assert rows["ppo_dhm"]["seeds"] == [0] and math.isnan(rows["ppo_dhm"]["dhm_sd"])  # RL_VIST_SEEDS=0
    block = report.render_block(results, {})
    assert "| ppo_dhm | 1 | " in block and next(r for r in block.splitlines() if r.startswith("| ppo_dhm | 1 |")
                                                 ).split("|")[4].strip() == "–"
    results = made_up_results()
    results["policies"]["ppo_dhm@1"]["dhm"] = math.nan  # every story of that seed unscorable
    row = next(r for r in report.summary_rows(results) if r["run"] == "ppo_dhm")
    finite = [results["policies"][f"ppo_dhm@{s}"]["dhm"] for s in (0, 2)]
    assert row["dhm_mean"] == pytest.approx(sum(finite) / 2) and row["dhm_max"] == max(finite)


def test_a_conclusion_that_fails_for_one_seed_names_it_in_the_block():
    block = report.render_block(made_up_results(), {"commit": "abc"})
    row = next(line for line in block.splitlines() if line.startswith("| ppo_repetition lowers held-out d_HM |"))
    assert row.endswith("| 1 of 2 | does not hold: ppo_repetition@1 |")
    row = next(line for line in block.splitlines() if line.startswith("| ppo_dhm lowers held-out d_HM |"))
    assert row.endswith("| 3 of 3 | holds for every seed |")


def _tables(block: str) -> list[list[str]]:
    tables, current = [], []
    for line in block.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _shape(block: str) -> list[str]:
    """Headings and table header rows: what report.py writes whatever the numbers."""
    return [line for line in block.splitlines() if line.startswith("### ")] + [t[0] for t in _tables(block)]


def test_block_tables_are_whole_and_the_summary_row_is_the_seeds():
    results = made_up_results()
    block = report.render_block(results, {"commit": "abc", "load": "1"},
                                "# Pair accuracy\n\n| metric | acc |\n|---|---:|\n| a | 0.5 |\n")
    assert "# Pair accuracy" not in block  # meta-eval's own heading would be a page title in the README
    for table in _tables(block):
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table}
        assert len(widths) == 1, table
    summary = next(t for t in _tables(block) if t[0].startswith("| policy | seeds | d_HM mean |"))
    row = next(r for r in summary if r.startswith("| ppo_dhm |")).split("|")
    values = [results["policies"][f"ppo_dhm@{s}"]["dhm"] for s in (0, 1, 2)]
    assert row[2].strip() == "3" and row[3].strip() == f"{sum(values) / 3:.4f}"
    assert row[5].strip() == f"{min(values):.4f} – {max(values):.4f}" and row[6].count("<br>") == 2
    assert "### Story reward model: pair accuracy on the validation pairs" in block and "| a | 0.5 |" in block
    assert "- commit: abc" in block and "- load: 1" in block
    per_seed = next(t for t in _tables(block) if t[0].startswith("| policy | d_HM | delta d_HM"))
    assert [r.split("|")[1].strip() for r in per_seed[3:]] == list(results["policies"])


def test_readme_block_has_the_shape_report_writes():
    """The README cannot be re-run here: its block must be report.py's, for >= 3 seeds of every policy."""
    readme = EXAMPLE / "README.md"
    block = report.read_block(readme)
    names = [row.split("|")[1].strip() for t in _tables(block) if t[0].startswith("| policy | d_HM | delta d_HM")
             for row in t[3:]]
    assert names and names[0] == "start", "the README's block is not report.py's output (no per-seed table)"
    seeds: dict[str, list[int]] = {}
    for name in names[1:]:
        run, seed = report.split_name(name)
        seeds.setdefault(run, []).append(seed)
    assert set(seeds) == {"ppo_dhm", "grpo_dhm", "rloo_dhm", "ppo_repetition", "grpo_repetition", "rloo_repetition",
                          "dpo_dhm"}
    assert all(len(s) >= 3 for s in seeds.values()), seeds
    # the same headings and table headers as report.py writes for these policies
    results = made_up_results()
    template = next(iter(results["policies"].values()))
    results["policies"] = {n: {**template, "training": {"steps": 80} if "@" in n else None} for n in names}
    meta_eval = block.split("### Story reward model: pair accuracy on the validation pairs", 1)[1]  # meta-eval's input
    expected = report.render_block(results, {}, meta_eval)
    assert _shape(block) == _shape(expected)
    for table in _tables(block):
        assert len({len(re.split(r"(?<!\\)\|", row)) for row in table}) == 1, table[0]
    provenance = dict(re.findall(r"^- (commit|packages|machine|load|steps|tables): (.+)$", block, re.M))
    assert set(provenance) == {"commit", "packages", "machine", "load", "steps", "tables"}
    assert re.fullmatch(r"[0-9a-f]{40}", provenance["commit"]), provenance["commit"]
    assert re.fullmatch(r"written by report.py at commit [0-9a-f]{40}", provenance["tables"]), provenance["tables"]
    for package in ("storyrl", "torch", "transformers", "trl"):
        assert re.search(rf"\b{package} \d", provenance["packages"]), package


@pytest.mark.parametrize("text", ["no markers\n", f"{report.BEGIN}\nx\n", f"{report.END}\n{report.BEGIN}\n",
                                  f"{report.BEGIN}\n{report.BEGIN}\n{report.END}\n"])
def test_readme_without_its_markers_is_refused_and_left_alone(tmp_path, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(SystemExit, match="README.md: needs the markers"):
        report.replace_block(readme, "new\n")
    assert readme.read_text() == text


def test_bad_inputs_are_one_line(tmp_path):
    times = tmp_path / "times.tsv"
    times.write_text("data\t1\tabc\t0.1\t0.2\npolicy\t3\n")
    with pytest.raises(SystemExit, match=r"times.tsv: line 2: expected 5 tab-separated fields, got 2"):
        report.read_steps(times)
    times.write_text("data\t1\tabc\t0.1\t0.2\t9\n")
    with pytest.raises(SystemExit, match=r"times.tsv: line 1: expected 5 tab-separated fields, got 6"):
        report.read_steps(times)
    with pytest.raises(SystemExit, match="policy 'ppo@x'"):
        report.split_name("ppo@x")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({**made_up_results(), "policies": {"start": made_up_results()["policies"]["start"]}}))
    with pytest.raises(SystemExit, match="no trained policy"):
        report.report(results, tmp_path)


def test_provenance_names_commits_load_and_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # the steps at once are run.sh's, not the machine's cores
    times = tmp_path / "times.tsv"
    times.write_text("data\t1\tc1\t0.5\t0.7\nppo_dhm@0\t80\tc1\t1.9\t2.4\n")
    p = report.provenance(report.read_steps(times), 2)
    assert p["commit"] == "c1" and p["load"].startswith("1-minute load average 0.5 – 2.4")
    assert p["steps"] == "2, 81 s of step time in all: data 1, ppo_dhm@0 80" and "2 steps at a time" in p["machine"]
    times.write_text("data\t1\tc1\t0.5\t0.7\nppo_dhm@0\t80\tc2\t1.9\t2.4\n")
    assert "different commits" in report.provenance(report.read_steps(times), 1)["commit"]
    # wall time: from the earliest start (marker time - seconds) to the latest end (marker time)
    done = tmp_path / "done"
    done.mkdir()
    steps = report.read_steps(times)
    for name, end in (("data", 1000.0), ("ppo_dhm@0", 1050.0)):
        (done / name).write_text("x")
        os.utime(done / name, (end, end))
    assert report.wall_seconds(done, steps) == pytest.approx(1050.0 - (1050.0 - 80))  # ppo started first: 970
    os.utime(done / "data", (900.0, 900.0))
    assert report.wall_seconds(done, steps) == pytest.approx(1050.0 - 899.0)
    assert "151 s of wall time" in report.provenance(steps, 1, report.wall_seconds(done, steps))["steps"]
    (done / "data").unlink()
    assert report.wall_seconds(done, steps) is None and report.wall_seconds(None, steps) is None
    assert "wall time" not in report.provenance(steps, 1, None)["steps"]


def test_plot_has_a_point_per_seed_and_legends_outside(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from test_plots_layout import inside_figure, overlaps

    results = made_up_results()
    for name, entry in results["policies"].items():
        if "@" in name:
            run, seed = report.split_name(name)
            if run == "dpo_dhm":
                entry["training"] = {"curve": [-0.1, -0.11, -0.12], "curve_steps": [10, 20, 30]}
            else:
                entry["training"] = {"curve": [0.01 * k + seed for k in range(30)]}
    fig = report.figure(results)
    try:
        ax = fig.axes[0]
        points = [len(line.get_xdata()) for line in ax.lines]
        assert points == [1, 3, 3, 2, 3]  # start, then one point per seed of each run
        assert [round(float(p.get_height()), 6) for p in ax.patches] == [
            round(sum(results["policies"][n]["dhm"] for n in results["policies"] if n.startswith(f"{r}@"))
                  / len([n for n in results["policies"] if n.startswith(f"{r}@")]), 6)
            if r != "start" else round(results["policies"]["start"]["dhm"], 6)
            for r in ("start", "ppo_dhm", "grpo_dhm", "ppo_repetition", "dpo_dhm")]
        # improvement vs drift: one error bar per seed
        assert len(fig.axes[2].containers) == 11
        # training: a thin line per seed and a bold mean per run
        assert sum(1 for line in fig.axes[1].lines if line.get_linewidth() == 2) == 4
        assert overlaps(fig) == [] and inside_figure(fig)
    finally:
        plt.close(fig)
    report.plot(results, tmp_path / "results.png")
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG" and not list(tmp_path.glob("*.tmp*"))


# -- run.sh with every step a stub ---------------------------------------------------------------

STUB = r'''
import json, os, sys, time
from pathlib import Path

log = Path(os.environ["STUB_LOG"])
argv = sys.argv[1:]
tool = Path(sys.argv[0]).name
line = " ".join([tool, *argv])
with log.open("a") as f:
    f.write(line + "\n")
if os.environ.get("STUB_FAIL") and os.environ["STUB_FAIL"] in line:
    sys.exit(3)

def arg(name):
    return argv[argv.index(name) + 1]

def need(*paths):
    for p in paths:
        if not Path(p).exists():
            print(f"stub: {line}: needs {p}", file=sys.stderr)
            sys.exit(4)

out = Path("out/rl_vist")
script = Path(argv[0]).name if tool == "python" else None
if script == "report.py":
    os.execv(os.environ["REAL_PYTHON"], [os.environ["REAL_PYTHON"], *argv])
with log.with_suffix(".spans").open("a") as f:
    f.write(f"start {time.time()}\n")
def pause(seconds=0.2):  # between checking a step's inputs and writing its outputs: a step started too early
    time.sleep(seconds)  # finds them missing
if script == "prepare_data.py":
    pause()
    Path(argv[1]).mkdir(parents=True)
    for split in ("train", "val", "heldout"):
        (Path(argv[1]) / f"{split}.jsonl").write_text("{}\n")
elif script in ("make_albert.py", "make_policy.py"):
    need(argv[1])
    pause()
    Path(argv[2]).mkdir(parents=True)
elif script == "train_rl.py" or (script == "storyrl_nouns.py" and argv[1:3] == ["train", "dpo"]):
    need(out / "policy", out / "coherence" / "best")
    if script == "storyrl_nouns.py":
        need(out / "pairs" / "train_dhm.spaced.jsonl")
    run = Path(arg("--output-dir"))
    assert not run.exists(), run
    pause(1.0 if "dpo" in script + " ".join(argv) else 0.2)  # DPO outlasts the evaluations submitted after it
    (run / "final").mkdir(parents=True)
    (run / "seed").write_text(arg("--seed"))
elif script == "storyrl_nouns.py" and argv[1] == "pairs":
    need(out / "policy", out / "coherence" / "best")
    pause()
    Path(arg("-o")).write_text("{}\n")
elif script == "space_pairs.py":
    need(argv[1])
    pause()
    Path(argv[2]).write_text("{}\n")
    Path(arg("--scores")).write_text("story_id,labels\n")
elif script == "evaluate.py":
    names = [p.split("=", 1) for i, p in enumerate(argv) if i and argv[i - 1] == "--policy"]
    need(arg("--coherence-model"), *(d for _, d in names))
    pause()
    policies = Path(arg("--out")) / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    if "--no-report" in argv:
        name = names[-1][0]
        (policies / f"{name}.json").write_text("{}")
    else:
        sys.path.insert(0, os.environ["TESTS"])
        from test_example_rl_vist_report import made_up_results
        results = made_up_results()
        template = results["policies"]["ppo_dhm@0"]
        results["policies"] = {n: (results["policies"]["start"] if n == "start" else template) for n, _ in names}
        (Path(arg("--out")) / "results.json").write_text(json.dumps(results))
elif tool == "storyrl" and argv[:2] == ["train", "coherence"]:
    need(out / "albert_base")
    pause()
    (out / "coherence" / "best").mkdir(parents=True)
elif tool == "storyrl" and argv[:2] == ["train", "reward_model"]:
    need(out / "pairs" / "train_dhm.spaced.jsonl")
    pause()
    (out / "reward_model" / "final").mkdir(parents=True)
elif tool == "storyrl" and argv[:2] == ["meta-eval", "pairs"]:
    need(out / "reward_model" / "final", out / "pairs" / "val_dhm.spaced.jsonl")
    pause()
    o = Path(arg("-o"))
    o.parent.mkdir(parents=True)
    o.with_suffix(".md").write_text("| metric | pair accuracy (n = 3) |\n|---|---:|\n| reward_model | 0.5 |\n")
else:
    print(f"stub: unexpected command {line}", file=sys.stderr)
    sys.exit(5)
with log.with_suffix(".spans").open("a") as f:
    f.write(f"end {time.time()}\n")
'''


@pytest.fixture
def checkout(tmp_path):
    """A scratch checkout with the example, its data stand-ins and stub `python`/`storyrl` first on PATH."""
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "rl_vist", ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python", "storyrl"):
        (bin_dir / tool).write_text(f"#!{sys.executable}\n{STUB}")
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "stories.json").write_text("{}")
    (tmp_path / "ratings.csv").write_text("Word;Conc.M\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "examples"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=tmp_path, check=True)
    return tmp_path


def _run_sh(checkout, **env):
    log = checkout / "stub.log"
    log.unlink(missing_ok=True)
    log.with_suffix(".spans").unlink(missing_ok=True)
    full = {**os.environ, "PATH": f"{checkout / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": "set",
            "STUB_LOG": str(log), "REAL_PYTHON": sys.executable, "TESTS": str(ROOT / "tests"),
            "PYTHONPATH": str(ROOT), "STORYRL_VIST_STORIES": str(checkout / "stories.json"),
            "STORYRL_CONCRETENESS": str(checkout / "ratings.csv"), **env}
    result = subprocess.run(["bash", "examples/rl_vist/run.sh"], cwd=checkout, env=full, capture_output=True,
                            text=True, timeout=300)
    commands = log.read_text().splitlines() if log.exists() else []
    return result, commands


RUNS = ["ppo_dhm", "grpo_dhm", "rloo_dhm", "ppo_repetition", "grpo_repetition", "rloo_repetition", "dpo_dhm"]


def _most_at_once(checkout) -> int:
    """The most stub steps that ran at the same time (from their start and end times)."""
    events = sorted((float(t), 1 if kind == "start" else -1) for kind, t in
                    (line.split() for line in (checkout / "stub.spans").read_text().splitlines()))
    running = most = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        running += change
        most = max(most, running)
    return most


def _trained(commands) -> dict[str, str]:
    """{output dir name: seed} of the training commands."""
    out = {}
    for c in commands:
        if "--output-dir" in c:
            words = c.split()
            out[Path(words[words.index("--output-dir") + 1]).name] = words[words.index("--seed") + 1]
    return out


def test_run_sh_trains_every_policy_per_seed_in_order_and_writes_the_readme_block(checkout):
    result, commands = _run_sh(checkout, RL_VIST_SEEDS="0 3", RL_VIST_JOBS="8")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _most_at_once(checkout) == 8  # as many steps at once as asked, never more (12 RL runs are ready together)
    runs = RUNS
    assert _trained(commands) == {f"{r}@{s}": s for r in runs for s in ("0", "3")}
    for r in runs:
        config = "dpo_dhm" if r == "dpo_dhm" else r
        assert any(f"--config examples/rl_vist/{config}.yaml --seed 3 --output-dir out/rl_vist/runs/{r}@3" in c
                   for c in commands), r
    # shared steps once, with seed 0; each policy evaluated once on its own, then all together
    assert sum("make_policy.py" in c for c in commands) == 1 and sum("storyrl_nouns.py pairs " in c for c in commands) == 2
    assert all("--seed 0" in c for c in commands if "make_policy.py" in c or "prepare_data.py" in c
               or "storyrl_nouns.py pairs " in c)
    evaluated = [c for c in commands if "evaluate.py" in c and "--no-report" in c]
    assert len(evaluated) == 1 + 14
    final = [c for c in commands if "evaluate.py" in c and "--no-report" not in c]
    assert len(final) == 1 and final[0].count("--policy") == 15 and "--times" in final[0]
    block = report.read_block(checkout / "examples" / "rl_vist" / "README.md")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    assert f"- commit: {head}\n" in block and "| reward_model | 0.5 |" in block
    assert f"- tables: written by report.py at commit {head}\n" in block  # the README it writes is not a change
    assert "training seeds 0, 3;" in block
    assert "8 steps at a time" in block and re.search(r"- steps: \d+, \d+ s of step time in all, \d+ s of wall time", block)
    times = (checkout / "out" / "rl_vist" / "times.tsv").read_text().splitlines()
    assert len(times) == len(list((checkout / "out" / "rl_vist" / "done").iterdir()))
    assert all(len(t.split("\t")) == 5 and t.split("\t")[2] == head for t in times)

    # a policy retrained (its marker removed) is evaluated again, not read from the cache; the step's commit
    # is the clean HEAD although report.py rewrote the README
    out = checkout / "out" / "rl_vist"
    (out / "done" / "ppo_dhm@0").unlink()
    (out / "eval" / "policies" / "ppo_dhm@0.json").write_text("stale")
    result, again = _run_sh(checkout, RL_VIST_SEEDS="0 3", RL_VIST_JOBS="2")
    assert result.returncode == 0 and _trained(again) == {"ppo_dhm@0": "0"}
    assert not (out / "eval" / "policies" / "ppo_dhm@0.json").is_file() or \
        (out / "eval" / "policies" / "ppo_dhm@0.json").read_text() != "stale"
    assert (out / "done" / "ppo_dhm@0").read_text().split("\t")[2] == head

    # a rerun resumes: nothing is trained or evaluated again, the tables are written again, and say
    # that the code they were written with differs from the commit
    with (checkout / "examples" / "rl_vist" / "common.py").open("a") as f:
        f.write("# changed\n")
    result, again = _run_sh(checkout, RL_VIST_SEEDS="0 3")
    assert result.returncode == 0 and "finished before, skipped" in result.stdout
    assert _trained(again) == {} and [c for c in again if "--no-report" in c] == []
    assert sum("report.py" in c for c in again) == 1
    block = report.read_block(checkout / "examples" / "rl_vist" / "README.md")
    assert f"- commit: {head}\n" in block and f"- tables: written by report.py at commit {head}+uncommitted\n" in block


def test_run_sh_stops_on_a_failed_step_and_a_rerun_redoes_only_what_is_missing(checkout):
    readme = (checkout / "examples" / "rl_vist" / "README.md").read_text()
    result, commands = _run_sh(checkout, RL_VIST_JOBS="2", STUB_FAIL="rloo_dhm@1")  # the default seeds: 0 1 2
    assert result.returncode == 1
    assert "rl_vist: failed: rloo_dhm@1" in result.stderr and "run again to resume" in result.stderr
    done = checkout / "out" / "rl_vist" / "done"
    assert not (done / "rloo_dhm@1").exists() and (done / "policy").exists()
    assert not any("dpo" in c for c in commands) and not any("report.py" in c for c in commands)
    finished = set(_trained(commands)) - {"rloo_dhm@1"}
    finished = {n for n in finished if (done / n).exists()}
    result, again = _run_sh(checkout, RL_VIST_JOBS="1", RL_VIST_README="none")
    assert result.returncode == 0, result.stderr[-2000:]
    retrained = set(_trained(again))
    assert "rloo_dhm@1" in retrained and not retrained & finished
    assert set(_trained(commands)) | retrained == {f"{r}@{s}" for r in RUNS for s in "012"}
    assert not any("make_policy.py" in c or "prepare_data.py" in c for c in again)
    assert _most_at_once(checkout) == 1
    assert (checkout / "examples" / "rl_vist" / "README.md").read_text() == readme  # RL_VIST_README=none
    assert (checkout / "out" / "rl_vist" / "eval" / "seeds.md").is_file()


@pytest.mark.parametrize("fail, name", [("prepare_data.py", "data"), ("--policy dpo_dhm@1=", "eval_dpo_dhm@1"),
                                        ("meta-eval pairs", "reward_model_eval")])
def test_run_sh_stops_at_a_failed_step_in_any_phase(checkout, fail, name):
    result, commands = _run_sh(checkout, RL_VIST_SEEDS="0 1", RL_VIST_JOBS="2", STUB_FAIL=fail)
    assert result.returncode == 1 and f"rl_vist: step {name} failed; its log: out/rl_vist/logs/{name}.log" in \
        result.stderr, result.stderr[-2000:]
    assert name == "data" or f"rl_vist: failed: {name} " in result.stderr  # a background step: the pool stops
    assert not any("report.py" in c for c in commands) and "Traceback" not in result.stderr
    if name == "data":  # the first step: nothing after it runs
        assert len(commands) == 1


@pytest.mark.parametrize("env, message", [
    ({"RL_VIST_SEEDS": "0 x"}, "RL_VIST_SEEDS: 'x' is not a seed"),
    ({"RL_VIST_SEEDS": " "}, "RL_VIST_SEEDS is empty"),
    ({"RL_VIST_JOBS": "0"}, "RL_VIST_JOBS: '0' is not a positive whole number"),
    ({"RL_VIST_JOBS": "two"}, "RL_VIST_JOBS: 'two' is not a positive whole number"),
])
def test_run_sh_refuses_bad_settings_before_running_anything(checkout, env, message):
    result, commands = _run_sh(checkout, **env)
    assert result.returncode == 1 and commands == [] and not (checkout / "out").exists()
    assert result.stderr.strip() == f"rl_vist: {message}" or message in result.stderr.strip().splitlines()[-1]
