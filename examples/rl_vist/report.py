"""The rl_vist tables over training seeds, the conclusions checked seed by
seed, the plot, and the block of README.md that shows them.

    python examples/rl_vist/report.py --results out/rl_vist/eval/results.json \\
        [--times out/rl_vist/times.tsv] [--done out/rl_vist/done] [--jobs 2] [--out out/rl_vist/eval] \\
        [--reward-model-table out/rl_vist/reward_model_eval/val_pairs.md] [--readme examples/rl_vist/README.md]

``results.json`` is evaluate.py's, with one policy per run and training
seed, named ``RUN@SEED`` (``ppo_dhm@0``, ``ppo_dhm@1``, ...) and the start
policy without a seed. Writes ``seeds.md`` (the block), ``seeds.json`` and
``results.png`` to ``--out``; with ``--readme``, replaces the README's text
between the ``rl_vist:results`` markers by the block (nothing else of the
README is touched; the markers must be there once each).

Every conclusion of the README is a row of the block's "Conclusions" table,
checked for every seed (or every pair of seeds when it compares two runs),
with the test written out; a conclusion holds only if it holds for all of
them. The 95% intervals are evaluate.py's paired bootstrap over the held-out
sequences (2000 resamples, the same resamples for every policy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- rl_vist:results begin: written by run.sh (report.py); edits here are overwritten -->"
END = "<!-- rl_vist:results end -->"
VERSIONS = ("storyrl", "torch", "transformers", "trl", "peft", "accelerate", "tokenizers", "numpy")
ALGORITHMS = ("ppo", "grpo", "rloo")


# -- grouping ---------------------------------------------------------------------------------


def split_name(name: str) -> tuple[str, int | None]:
    """``ppo_dhm@2`` -> (``ppo_dhm``, 2); a name without ``@`` -> (name, None)."""
    run, sep, seed = name.rpartition("@")
    if not sep:
        return name, None
    if not seed.isdigit():
        raise SystemExit(f"report.py: policy {name!r}: the part after '@' must be a seed (an integer)")
    return run, int(seed)


def group(results: dict) -> dict[str, dict[int, dict]]:
    """{run: {seed: policy entry}} for the trained policies, in results order."""
    out: dict[str, dict[int, dict]] = {}
    for name, entry in results["policies"].items():
        run, seed = split_name(name)
        if seed is not None:
            out.setdefault(run, {})[seed] = entry
    return out


# -- the checks -------------------------------------------------------------------------------


def _delta(after: dict, before: dict, seed: int) -> dict:
    from storyrl.eval.compare import paired_difference

    return paired_difference(after, before, seed=seed)


@dataclass
class Claim:
    """A conclusion and its outcome for every seed (or seed pair) it was checked on."""

    text: str
    test: str
    outcomes: list[tuple[str, bool]]

    @property
    def holds(self) -> bool:
        return bool(self.outcomes) and all(ok for _, ok in self.outcomes)


def claims(results: dict) -> list[Claim]:
    runs = group(results)
    start = results["policies"][results["start"]]
    human = results["human"]
    seed = results["seed"]
    out: list[Claim] = []

    def delta(after: dict, before: dict) -> dict:  # one bootstrap seed for every comparison
        return _delta(after, before, seed)

    def per_seed(run: str, check: Callable[[dict], bool]) -> list[tuple[str, bool]]:
        return [(f"{run}@{s}", bool(check(e))) for s, e in sorted(runs.get(run, {}).items())]

    def below_zero(after: dict, before: dict) -> bool:
        return delta(after, before)["high"] < 0

    for run in runs:
        out.append(Claim(f"{run} lowers held-out d_HM", "95% CI of the paired difference to start below 0",
                         per_seed(run, lambda e: below_zero(e["per_sequence"], start["per_sequence"]))))
    for dimension in ("coherence", "repetition"):  # which of d_HM's dimensions moved towards the human stories
        for run in runs:
            out.append(Claim(f"{run} lowers the {dimension} distance", f"95% CI of the paired difference of the "
                             f"{dimension} distance to start below 0",
                             per_seed(run, lambda e, d=dimension: below_zero(e["per_sequence_dims"][d],
                                                                             start["per_sequence_dims"][d]))))
    human_rep = human["per_sequence_scores"]["repetition"]
    for run in (r for r in runs if r.endswith("_repetition")):
        out.append(Claim(f"{run} overshoots the human repetition score",
                         "95% CI of its repetition score minus the human story's above 0",
                         per_seed(run, lambda e: delta(e["per_sequence_scores"]["repetition"], human_rep)["low"] > 0)))
    for algorithm in ALGORITHMS:
        dhm_run, rep_run = f"{algorithm}_dhm", f"{algorithm}_repetition"
        if dhm_run in runs and rep_run in runs:
            out.append(Claim(f"{algorithm}: d_HM is the better target than raw repetition",
                             f"every {dhm_run} seed's held-out d_HM below every {rep_run} seed's",
                             [(f"{dhm_run}@{a} vs {rep_run}@{b}", e["dhm"] < f["dhm"])
                              for a, e in sorted(runs[dhm_run].items()) for b, f in sorted(runs[rep_run].items())]))
    if "dpo_dhm" in runs:
        for algorithm in ALGORITHMS:
            other = f"{algorithm}_dhm"
            if other in runs:
                out.append(Claim(f"dpo_dhm matches {other} on held-out d_HM",
                                 f"for every pair of seeds, the 95% CI of dpo_dhm minus {other} contains 0",
                                 [(f"dpo_dhm@{a} vs {other}@{b}",
                                   (lambda d: d["low"] <= 0 <= d["high"])(delta(e["per_sequence"], f["per_sequence"])))
                                  for a, e in sorted(runs["dpo_dhm"].items()) for b, f in sorted(runs[other].items())]))
        out.append(Claim("dpo_dhm lengthens the stories", "95% CI of its sentences per story minus start's above 0",
                         per_seed("dpo_dhm", lambda e: delta(e["per_sequence_sentences"],
                                                              start["per_sequence_sentences"])["low"] > 0)))
    if "grpo_dhm" in runs and "ppo_dhm" in runs:
        out.append(Claim("against d_HM, GRPO drifts less from the start than PPO",
                         "every grpo_dhm seed's KL to start below every ppo_dhm seed's",
                         [(f"grpo_dhm@{a} vs ppo_dhm@{b}", g["kl"] < p["kl"])
                          for a, g in sorted(runs["grpo_dhm"].items()) for b, p in sorted(runs["ppo_dhm"].items())]))
    for run in runs:
        out.append(Claim(f"{run} uses fewer of the prompt's nouns than start",
                         "noun recall below start's (point estimate)",
                         per_seed(run, lambda e: e["noun_recall"] < start["noun_recall"])))
    return out


# -- the block --------------------------------------------------------------------------------


def _f(value, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _ci(d: dict) -> str:
    return f"{d['delta']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def summary_rows(results: dict) -> list[dict]:
    """Per run: the seeds, mean / sd / min / max of held-out d_HM, per-seed deltas, means of the rest."""
    start = results["policies"][results["start"]]
    rows = []
    for run, seeds in group(results).items():
        values = [seeds[s]["dhm"] for s in sorted(seeds)]
        finite = [v for v in values if math.isfinite(v)]
        rows.append({
            "run": run, "seeds": sorted(seeds), "dhm_mean": statistics.fmean(finite) if finite else math.nan,
            "dhm_sd": statistics.stdev(finite) if len(finite) > 1 else math.nan,
            "dhm_min": min(finite, default=math.nan), "dhm_max": max(finite, default=math.nan),
            "deltas": {s: _delta(seeds[s]["per_sequence"], start["per_sequence"], results["seed"]) for s in sorted(seeds)},
            **{key: statistics.fmean(seeds[s][key] for s in seeds)
               for key in ("dhm_coherence", "dhm_repetition", "kl", "sentences", "distinct_2", "noun_recall")},
        })
    return rows


def render_block(results: dict, provenance: dict, reward_model_table: str | None = None) -> str:
    """The README block (between the markers, markers excluded): Markdown."""
    import evaluate

    start = results["policies"][results["start"]]
    seeds = sorted({s for r in group(results).values() for s in r})
    lines = ["### The run", ""]
    lines += [f"- {key}: {value}" for key, value in provenance.items()]
    lines += [f"- evaluation: {results['n_sequences']} held-out sequences x {results['samples']} sampled stories per "
              f"policy (temperature {results['temperature']}, sampling seed {results['seed']} for every policy); "
              f"training seeds {', '.join(map(str, seeds))}; 95% intervals: paired bootstrap over the sequences, "
              "2000 resamples", ""]
    lines += ["### Held-out d_HM over training seeds", "",
              "| policy | seeds | d_HM mean | sd | min – max | delta to start per seed [95% CI] | d_HM coh. | d_HM rep. "
              "| KL to start | sentences | distinct-2 | noun recall |",
              "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
              f"| start | – | {_f(start['dhm'])} | | | | {_f(start['dhm_coherence'])} | {_f(start['dhm_repetition'])} "
              f"| 0 | {_f(start['sentences'], 2)} | {_f(start['distinct_2'], 3)} | {_f(start['noun_recall'], 3)} |"]
    for r in summary_rows(results):
        deltas = "<br>".join(f"{s}: {_ci(d)}" for s, d in r["deltas"].items())
        lines.append(f"| {r['run']} | {len(r['seeds'])} | {_f(r['dhm_mean'])} | {_f(r['dhm_sd'])} | "
                     f"{_f(r['dhm_min'])} – {_f(r['dhm_max'])} | {deltas} | {_f(r['dhm_coherence'])} | "
                     f"{_f(r['dhm_repetition'])} | {_f(r['kl'], 2)} | {_f(r['sentences'], 2)} | "
                     f"{_f(r['distinct_2'], 3)} | {_f(r['noun_recall'], 3)} |")
    lines += ["", "(Means over seeds but for d_HM's sd, min and max; sd: sample standard deviation over seeds.)", "",
              "### Conclusions, checked for every seed", "",
              "| conclusion | test | holds for | verdict |", "|---|---|---:|---|"]
    for c in claims(results):
        failed = [label for label, ok in c.outcomes if not ok]
        verdict = "holds for every seed" if c.holds else "does not hold: " + ", ".join(failed)
        lines.append(f"| {c.text} | {c.test} | {sum(ok for _, ok in c.outcomes)} of {len(c.outcomes)} | {verdict} |")
    lines += ["", "### Every policy and seed", ""]
    lines += evaluate.markdown({**results, "times": {}}).rstrip("\n").splitlines()
    if reward_model_table:  # storyrl meta-eval's table, without its own heading
        lines += ["", "### Story reward model: pair accuracy on the validation pairs", "",
                  *(line for line in reward_model_table.splitlines() if line.startswith("|"))]
    return "\n".join(lines) + "\n"


def replace_block(readme: Path, block: str) -> None:
    text = readme.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"report.py: {readme}: needs the markers {BEGIN!r} and {END!r} once each, in that order")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    tmp = readme.with_name(readme.name + ".tmp")
    tmp.write_text(f"{head}{BEGIN}\n{block}{END}{tail}", encoding="utf-8")
    tmp.replace(readme)


def read_block(readme: Path) -> str:
    """The README's block as written (markers excluded)."""
    text = readme.read_text(encoding="utf-8")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")


# -- provenance -------------------------------------------------------------------------------


def read_steps(path) -> list[dict]:
    """run.sh's times.tsv: name, seconds, commit, load before, load after (one line per step run)."""
    if path is None or not Path(path).is_file():
        return []
    out = []
    for k, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 5:
            raise SystemExit(f"report.py: {path}: line {k}: expected 5 tab-separated fields, got {len(fields)}")
        name, seconds, commit, before, after = fields
        out.append({"name": name, "seconds": float(seconds), "commit": commit, "load": (float(before), float(after))})
    return out


def wall_seconds(done_dir, steps: Sequence[dict]) -> float | None:
    """From the first step's start to the last step's end: each marker in ``done_dir`` (run.sh's
    ``out/rl_vist/done``) was written when its step ended, and its line holds the step's seconds."""
    ends = {}
    for s in steps:
        marker = Path(done_dir) / s["name"] if done_dir is not None else None
        if marker is None or not marker.is_file():
            return None
        ends[s["name"]] = (marker.stat().st_mtime, s["seconds"])
    if not ends:
        return None
    return max(end for end, _ in ends.values()) - min(end - seconds for end, seconds in ends.values())


def provenance(steps: Sequence[dict], jobs: int | None, wall: float | None = None) -> dict[str, str]:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or "unknown CPU")
    memory = next((f"{int(line.split()[1]) / 2**20:.0f} GiB" for line in _lines("/proc/meminfo")
                   if line.startswith("MemTotal")), "unknown memory")
    commits = sorted({s["commit"] for s in steps})
    loads = [v for s in steps for v in s["load"]]
    total = sum(s["seconds"] for s in steps)
    out = {
        "commit": ", ".join(commits) if commits else "unknown (no times.tsv)",
        "packages": ", ".join(f"{n} {version(n)}" for n in VERSIONS) + f"; Python {platform.python_version()}",
        "machine": f"{cpu}, {os.cpu_count()} cores, {memory}, {platform.system()} {platform.machine()}; "
                   f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {jobs or 1} steps at a time",
        "load": (f"1-minute load average {min(loads):.1f} – {max(loads):.1f} (at the start and end of each step)"
                 if loads else "not recorded"),
        "steps": f"{len(steps)}, {total:.0f} s of step time in all"
                 + (f", {wall:.0f} s of wall time from the first step's start to the last one's end" if wall else "")
                 + ": "
                 + ", ".join(f"{s['name']} {s['seconds']:.0f}" for s in steps),
    }
    if len(commits) > 1:
        out["commit"] += " (steps ran at different commits: see the steps' log, times.tsv)"
    out["tables"] = f"written by report.py at commit {current_commit()}"
    return out


def current_commit() -> str:
    """HEAD of the checkout report.py runs in, ``+uncommitted`` when tracked files other than the
    README and its picture (which this writes) differ from it; ``unknown`` outside git."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        example = here.relative_to(here.parents[1])
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 f":(exclude){example}/README.md", f":(exclude){example}/results.png"],
                                cwd=here.parents[1], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+uncommitted" if status.stdout.strip() else "")


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


# -- the plot ---------------------------------------------------------------------------------


def figure(results: dict):
    """results.png: held-out d_HM per policy (a point per seed, the mean as a bar), each seed's
    training reward (the mean over seeds bold), and each seed's improvement against its drift."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from evaluate import _legend_outside, reward_curve

    runs = group(results)
    start = results["policies"][results["start"]]
    colours = {run: plt.get_cmap("tab10")(k % 10) for k, run in enumerate(runs)}
    fig, axes = plt.subplots(1, 3, figsize=(20, 5), layout="constrained")
    ax = axes[0]
    names = [results["start"], *runs]
    for x, name in enumerate(names):
        values = [start["dhm"]] if name == results["start"] else [e["dhm"] for _, e in sorted(runs[name].items())]
        colour = "grey" if name == results["start"] else colours[name]
        ax.bar(x, float(np.nanmean(values)), 0.6, color=colour, alpha=0.35,
               label="mean over seeds" if x == 1 else None)
        offsets = np.linspace(-0.15, 0.15, len(values)) if len(values) > 1 else [0.0]
        ax.plot(x + np.asarray(offsets), values, "o", color=colour, ms=5, ls="none",
                label="one training seed" if x == 1 else None)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylim(bottom=0)
    ax.set_ylabel(f"d_HM to the {results['label']} human stories (lower is better)")
    ax.set_title(f"{results['label']} d_HM per training seed")
    _legend_outside(ax)
    ax = axes[1]
    for run, seeds in runs.items():
        curves = []
        for _, e in sorted(seeds.items()):
            t = e.get("training") or {}
            if not t.get("curve"):
                continue
            steps, change = reward_curve(t)
            curves.append((steps, change))
            ax.plot(steps, change, color=colours[run], lw=0.6, alpha=0.5,
                    marker="o" if t.get("curve_steps") else None, ms=2)
        if curves and len({len(c) for _, c in curves}) == 1:
            ax.plot(curves[0][0], np.mean([c for _, c in curves], axis=0), color=colours[run], lw=2,
                    ls="--" if "repetition" in run else "-", label=f"{run} (mean; thin: seeds)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward - its start (moving mean of 10; DPO: monitor)")
    ax.set_title("training reward per seed")
    _legend_outside(ax)
    ax = axes[2]
    for run, seeds in runs.items():
        for k, (s, e) in enumerate(sorted(seeds.items())):
            d = _delta(e["per_sequence"], start["per_sequence"], results["seed"])
            ax.errorbar(e["kl"], d["delta"], yerr=[[d["delta"] - d["low"]], [d["high"] - d["delta"]]],
                        fmt="s" if "repetition" in run else "o", color=colours[run], capsize=3,
                        label=run if k == 0 else None)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("KL to the start policy (nats per story)")
    ax.set_ylabel("delta d_HM vs start (95% CI), one point per seed")
    ax.set_title(f"{results['label']} improvement vs drift")
    _legend_outside(ax)
    return fig


def plot(results: dict, path: Path) -> None:
    import evaluate

    evaluate.plot(results, path, figure)


# -- main -------------------------------------------------------------------------------------


def report(results_path: Path, out_dir: Path, times=None, reward_model_table=None, readme=None,
           jobs: int | None = None, done=None) -> str:
    results = json.loads(Path(results_path).read_text(encoding="utf-8"))
    if not group(results):
        raise SystemExit(f"report.py: {results_path}: no trained policy (names RUN@SEED)")
    table = Path(reward_model_table).read_text(encoding="utf-8") if reward_model_table else None
    steps = read_steps(times)
    block = render_block(results, provenance(steps, jobs, wall_seconds(done, steps)), table)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "seeds.md").write_text(block, encoding="utf-8")
    summary = {"summary": summary_rows(results),
               "claims": [{"text": c.text, "test": c.test, "outcomes": c.outcomes, "holds": c.holds}
                          for c in claims(results)]}
    (out_dir / "seeds.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    plot(results, out_dir / "results.png")
    if readme is not None:
        replace_block(Path(readme), block)
        picture = Path(readme).parent / "results.png"  # the README's picture is this run's
        shutil.copyfile(out_dir / "results.png", picture.with_name("results.tmp.png"))
        picture.with_name("results.tmp.png").replace(picture)
    return block


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--times", type=Path)
    parser.add_argument("--reward-model-table", type=Path)
    parser.add_argument("--readme", type=Path)
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--done", type=Path, help="run.sh's step markers (out/rl_vist/done): the wall time")
    args = parser.parse_args(argv)
    block = report(args.results, args.out or args.results.parent, args.times, args.reward_model_table, args.readme,
                   args.jobs, args.done)
    print(block)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
