"""Benchmark: end-to-end RoViST-NR repetition throughput on the VIST test stories.

What is measured
----------------
Stories per second for scoring every story of the d_HM VIST test set (5055
human-written ``gt_test.json`` stories plus 5055 LLaVA ``llava_vc_p3.json``
stories), *including* sentence and word splitting, on one CPU core:

(a) storyrl: ``create_reward("repetition").score(stories)`` on the whole list.
    ``storyrl.text.clear_caches()`` is called before every timed repeat, so each
    repeat starts with cold split caches and measures real work, not cache hits
    left over from the previous repeat (caching *within* a run is part of what
    is measured, as it is in a training loop);
(b) the straightforward implementation, ``tests/nltk_reference.py``:
    ``repetition(story)`` per story, built on NLTK's own Punkt algorithm and
    Treebank word tokenizer plus the metric authors' pair loops.

Each is timed with ``time.perf_counter``; the figure reported is the best of
``--repeats`` (storyrl) / ``--ref-repeats`` (reference) runs. Per-file figures
(human vs LLaVA stories) are timed separately, with the same cold-cache rule.
Both implementations must give the same scores (same NaN set, finite scores
within ``--tol``); the script exits with status 1 on a mismatch, and 2 when the
data (or NLTK, for the reference) is missing. The target is >= 10,000 stories/s
for storyrl; PASS/FAIL against it is printed but does not change the exit
status (timings on a shared machine are noisy).

Usage::

    python benchmarks/repetition.py [--data DIR] [--repeats 3] [--ref-repeats 1]
                                    [--core 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "dhm" / "vist"
FILES = {"human (gt_test)": "gt_test.json", "LLaVA (llava_vc_p3)": "llava_vc_p3.json"}
TARGET = 10_000.0  # stories/s, storyrl


# ---------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help=f"folder with {' and '.join(FILES.values())} (default: <repo>/../shared/data/dhm/vist)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats for storyrl (best is kept; default 3)")
    p.add_argument("--ref-repeats", type=int, default=1,
                   help="timed repeats for the NLTK reference (default 1, it is slow)")
    p.add_argument("--core", type=int, default=None,
                   help="CPU core to pin to (default: the lowest core this process may use)")
    p.add_argument("--tol", type=float, default=1e-9, help="max allowed |storyrl - reference| (default 1e-9)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.ref_repeats < 1:
        p.error("--repeats and --ref-repeats must be >= 1")
    return args


def fail(message: str) -> None:
    """Exit with status 2 and a clear message (missing data or dependency)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_stories(data_dir: Path) -> dict[str, list[str]]:
    """The stories of each file, in file order ({story_id: story} JSON objects)."""
    missing = [name for name in FILES.values() if not (data_dir / name).is_file()]
    if missing:
        fail(f"VIST story files not found in {data_dir}: {', '.join(missing)}\n"
             "pass the folder that holds them with --data DIR")
    stories = {}
    for label, name in FILES.items():
        with open(data_dir / name, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            fail(f"{data_dir / name}: expected a JSON object {{story_id: story}}")
        stories[label] = list(data.values())
    return stories


def pin_to_core(core: int | None) -> str:
    """Pin this process to one core; returns a description for the output."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (os.sched_setaffinity unavailable on this platform)"
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[0] if core is None else core
    try:
        os.sched_setaffinity(0, {core})
    except OSError as exc:
        fail(f"cannot pin to core {core} ({exc}); this process may use cores {allowed}")
    return f"pinned to core {core} with os.sched_setaffinity"


def load_reference():
    """``tests/nltk_reference.py`` (needs NLTK 3.8, the ``dev`` extra)."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import nltk_reference
    except ImportError as exc:
        fail(f"cannot import tests/nltk_reference.py ({exc}); install the dev extra: pip install -e '.[dev]'")
    return nltk_reference


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def best_time(run: Callable[[], np.ndarray], repeats: int, before: Callable[[], None] = lambda: None):
    """Best wall time of ``repeats`` calls of ``run`` (``before`` runs untimed
    ahead of each); returns (seconds, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t0)
    return best, result


def time_storyrl(stories: list[str], repeats: int):
    from storyrl.rewards import create_reward
    from storyrl.text import clear_caches

    reward = create_reward("repetition")
    return best_time(lambda: reward.score(stories), repeats, before=clear_caches)


def time_reference(reference, stories: list[str], repeats: int):
    return best_time(lambda: np.array([reference.repetition(s) for s in stories], dtype=np.float64), repeats)


def compare(ours: np.ndarray, ref: np.ndarray, tol: float) -> dict:
    """Same NaN set and max |diff| over finite scores."""
    nan_ours, nan_ref = np.isnan(ours), np.isnan(ref)
    both = ~nan_ours & ~nan_ref
    max_diff = float(np.max(np.abs(ours[both] - ref[both]))) if both.any() else 0.0
    nan_mismatch = int(np.sum(nan_ours != nan_ref))
    return {
        "nan_storyrl": int(nan_ours.sum()),
        "nan_reference": int(nan_ref.sum()),
        "nan_set_mismatches": nan_mismatch,
        "max_abs_diff": max_diff,
        "match": nan_mismatch == 0 and max_diff <= tol,
    }


def measure(label: str, stories: list[str], reference, args) -> dict:
    t_ours, ours = time_storyrl(stories, args.repeats)
    t_ref, ref = time_reference(reference, stories, args.ref_repeats)
    n = len(stories)
    return {
        "label": label,
        "stories": n,
        "storyrl_s": t_ours,
        "reference_s": t_ref,
        "storyrl_stories_per_s": n / t_ours,
        "reference_stories_per_s": n / t_ref,
        "speedup": t_ref / t_ours,
        "scores": compare(ours, ref, args.tol),
    }


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def print_row(row: dict) -> None:
    check = row["scores"]
    verdict = "same" if check["match"] else "MISMATCH"
    print(f"{row['label']:<22} {row['stories']:>7,} {row['storyrl_stories_per_s']:>12,.0f} "
          f"{row['reference_stories_per_s']:>12,.0f} {row['speedup']:>7.2f}x "
          f"{check['nan_storyrl']:>5} {check['max_abs_diff']:>9.1e}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    per_file = load_stories(args.data)
    pinning = pin_to_core(args.core)
    reference = load_reference()
    all_stories = [s for stories in per_file.values() for s in stories]

    print("RoViST-NR repetition throughput, end to end (sentence + word splitting included)")
    print(f"data: {args.data}  ({len(all_stories):,} stories)")
    print(f"CPU: {pinning}; Python {platform.python_version()} on {platform.machine()}")
    print(f"timing: time.perf_counter, best of {args.repeats} (storyrl, caches cleared before each) "
          f"/ {args.ref_repeats} (NLTK reference)\n")

    rows = [measure("all", all_stories, reference, args)]
    rows += [measure(label, stories, reference, args) for label, stories in per_file.items()]

    print(f"{'stories':<22} {'n':>7} {'storyrl/s':>12} {'reference/s':>12} {'ratio':>8} "
          f"{'NaN':>5} {'max|diff|':>9}  scores")
    for row in rows:
        print_row(row)

    total = rows[0]
    passed = total["storyrl_stories_per_s"] >= TARGET
    all_match = all(row["scores"]["match"] for row in rows)
    print(f"\nstoryrl: {total['storyrl_stories_per_s']:,.0f} stories/s; reference: "
          f"{total['reference_stories_per_s']:,.0f} stories/s; ratio storyrl/reference: {total['speedup']:.2f}x")
    print(f"target: >= {TARGET:,.0f} stories/s for storyrl -> {'PASS' if passed else 'FAIL'}")
    nan_same = all(row["scores"]["nan_set_mismatches"] == 0 for row in rows)
    print(f"scores: same NaN set: {'yes' if nan_same else 'NO'} ({total['scores']['nan_storyrl']} NaN); "
          f"max |storyrl - reference| = {total['scores']['max_abs_diff']:.1e} (tol {args.tol:g}) -> "
          f"{'match' if all_match else 'MISMATCH'}")

    if args.json:
        report = {
            "date": date.today().isoformat(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_pinning": pinning,
            "data": str(args.data),
            "repeats": {"storyrl": args.repeats, "reference": args.ref_repeats},
            "target_stories_per_s": TARGET,
            "target_passed": passed,
            "scores_match": all_match,
            "results": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")

    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
