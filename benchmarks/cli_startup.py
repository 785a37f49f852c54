"""Benchmark: how long ``storyrl train <name>`` takes to answer before any work.

What is measured
----------------
Wall time of a whole ``python -m storyrl ...`` process, as a user waits for
it, for every registered trainer and four ways a command ends before
training:

* ``help``: ``storyrl train NAME --help``;
* ``bad_option``: ``storyrl train NAME --no-such-option`` (exit 2);
* ``config_error``: ``--config`` a YAML file with an unknown key (exit 1);
* ``locked``: a config whose ``output_dir`` another process (this script)
  holds locked, as a second run on a running run's directory (exit 1); the
  config's other required keys name dummy files, so the lock is the first
  fault a run would meet.

and ``storyrl score --help`` as the baseline (a command that imports no
model library). Each case runs once through a wrapper that lists which heavy
libraries (torch, transformers, trl, peft, datasets, accelerate) the command
imported (untimed, also a warm-up), then ``--repeats`` times plainly; the
best and the median are reported. The machine, CPU count and load average
(before and after) are printed with the figures; ``--json OUT`` writes them.

Usage::

    python benchmarks/cli_startup.py [--repeats 3] [--trainers sft,rl] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")
CASES = ("help", "bad_option", "config_error", "locked")

# Runs storyrl's command line in this process, then prints which heavy
# libraries it imported as the last line of stderr.
_WRAPPER = (
    "import sys\n"
    "from storyrl.__main__ import main\n"
    "try:\n"
    "    main()\n"
    "except SystemExit:\n"
    "    pass\n"
    f"print('HEAVY ' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (default 3)")
    p.add_argument("--trainers", default=None, help="comma-separated trainers (default: all registered)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one command may take (default 300)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()}


def _configs(root: Path, name: str, config_class) -> dict[str, Path]:
    """The YAML files of the config_error and locked cases for one trainer."""
    from storyrl.config import option_info

    bad = root / f"{name}_bad.yaml"
    bad.write_text("no_such_key: 1\n", encoding="utf-8")
    dummy_file, dummy_dir = root / "dummy.txt", root / "dummy_dir"
    dummy_file.write_text("{}\n", encoding="utf-8")
    dummy_dir.mkdir(exist_ok=True)
    # A local model directory: telling a local policy's kind is part of
    # checking a storyteller's config (a hub name is not read then).
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    values = {"output_dir": str(root / "locked_run")}
    for info in option_info(config_class):
        if info.name == "model":
            values["model"] = str(model)
        if not info.required or info.name in values:
            continue
        if info.name == "rewards":
            values[info.name] = ["repetition"]
        else:
            value = str(dummy_dir) if info.path == "dir" else str(dummy_file)
            values[info.name] = [value] if typing.get_origin(info.type) is list else value
    locked = root / f"{name}_locked.yaml"
    locked.write_text(json.dumps(values) + "\n", encoding="utf-8")  # JSON is YAML
    return {"config_error": bad, "locked": locked}


def _arguments(name: str, case: str, configs: dict[str, Path]) -> list[str]:
    if case == "help":
        return ["train", name, "--help"]
    if case == "bad_option":
        return ["train", name, "--no-such-option"]
    return ["train", name, "--config", str(configs[case])]


def _run(command: list[str], env: dict, timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return time.perf_counter() - start, done


def measure(arguments: list[str], repeats: int, env: dict, timeout: float) -> dict:
    _, wrapped = _run([sys.executable, "-c", _WRAPPER, *arguments], env, timeout)
    lines = wrapped.stderr.splitlines()
    last = lines[-1] if lines else ""
    heavy = [m for m in last[len("HEAVY "):].split(",") if m] if last.startswith("HEAVY ") else None
    times, done = [], None
    for _ in range(repeats):
        seconds, done = _run([sys.executable, "-m", "storyrl", *arguments], env, timeout)
        times.append(seconds)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    return {"command": "storyrl " + " ".join(arguments), "best_s": round(min(times), 3),
            "median_s": round(statistics.median(times), 3), "exit": done.returncode,
            "error": errors[0][:160] if errors else None, "heavy": heavy}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from storyrl.console import configure_output
    from storyrl.training import TRAINERS
    from storyrl.training.runs import lock_directory

    configure_output()  # this process imports the trainers' modules: no library notices in the figures

    names = TRAINERS.names() if args.trainers is None else [n.strip() for n in args.trainers.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRAINERS]
    if unknown:
        print(f"unknown trainers: {', '.join(unknown)}; registered: {', '.join(TRAINERS.names())}", file=sys.stderr)
        return 2
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("STORYRL_DEBUG", None)
    env.pop("STORYRL_VERBOSE", None)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="storyrl-cli-startup-") as tmp:
        root = Path(tmp)
        rows.append({"trainer": None, "case": "baseline",
                     **measure(["score", "--help"], args.repeats, env, args.timeout)})
        with lock_directory(root / "locked_run"):  # what a running run holds
            for name in names:
                # Importing a trainer here may load torch into this process: harmless for
                # the figures, which are of the subprocesses.
                config_class = TRAINERS.get(name).config_class
                configs = _configs(root, name, config_class)
                for case in CASES:
                    row = {"trainer": name, "case": case,
                           **measure(_arguments(name, case, configs), args.repeats, env, args.timeout)}
                    rows.append(row)
                    print(f"{name:<13} {case:<13} best {row['best_s']:6.2f} s  median {row['median_s']:6.2f} s  "
                          f"exit {row['exit']}  heavy {','.join(row['heavy'] or []) or '-'}"
                          + (f"  ({'refused: in use' if 'in use by another run' in (row['error'] or '') else row['error']})"
                             if case == "locked" else ""), flush=True)
    load_after = os.getloadavg()
    baseline = rows[0]
    report = {"date": date.today().isoformat(), "machine": _machine(),
              "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after],
              "repeats": args.repeats, "rows": rows}
    print(f"\nbaseline: storyrl score --help  best {baseline['best_s']:.2f} s  median {baseline['median_s']:.2f} s")
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cpus']} CPUs; load average "
          f"{' '.join(map(str, report['load_before']))} before, {' '.join(map(str, report['load_after']))} after")
    slowest = max(rows[1:], key=lambda r: r["median_s"], default=None)
    if slowest is not None:
        print(f"slowest: {slowest['command']}  median {slowest['median_s']:.2f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
