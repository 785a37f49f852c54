"""The learning-rate / KL sweep behind the example's settings: short RL runs
of the example's configs with other values, evaluated on the *validation*
sequences (val.jsonl, from the train pool), never on the held-out ones.

    python examples/rl_vist/sweep.py [--configs grpo_dhm,ppo_dhm,...] [--lr 3e-5,1e-4,3e-4]
        [--kl 0.05] [--set KEY=VALUE ...] [--tag TAG] [--steps 80] [--out out/rl_vist/sweep]

Needs the data, the start policy and the coherence model of run.sh (run it
once, or its first steps). For every config x learning rate x KL coefficient
(``beta`` for GRPO/RLOO, ``kl_coef`` for PPO) it writes a config to
``OUT/configs/``, removes ``OUT/runs/NAME`` and trains into it, then
evaluates every final policy (and the start policy) with evaluate.py on
val.jsonl (one sample per sequence) into ``OUT/eval``. ``--set`` sets
further keys of the algorithm's config (YAML values: ``--set
use_score_scaling=true``). Names look like ``grpo_dhm-lr1e-04-kl0.05`` (plus
``-TAG``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIGS = ["ppo_dhm", "grpo_dhm", "rloo_dhm", "ppo_repetition", "grpo_repetition", "rloo_repetition"]
KL_KEY = {"ppo": "kl_coef", "grpo": "beta", "rloo": "beta"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--lr", default="3e-5,1e-4,3e-4")
    parser.add_argument("--kl", default="0.05")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another key of the algorithm's config (YAML value)")
    parser.add_argument("--tag", default="", help="appended to the run names")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "rl_vist" / "sweep")
    parser.add_argument("--val", type=Path, default=ROOT / "out" / "rl_vist" / "data" / "val.jsonl")
    parser.add_argument("--eval-only", action="store_true", help="evaluate the runs already in OUT/runs")
    args = parser.parse_args()

    import yaml

    from storyrl.config import load_yaml

    (args.out / "configs").mkdir(parents=True, exist_ok=True)
    times = args.out / "times.tsv"
    names = []
    for base in args.configs.split(","):
        config = load_yaml(HERE / f"{base}.yaml")
        algorithm = config["algorithm"]
        for lr in args.lr.split(","):
            for kl in args.kl.split(","):
                name = f"{base}-lr{float(lr):.0e}-kl{kl}" + (f"-{args.tag}" if args.tag else "")
                names.append(name)
                if args.eval_only:
                    continue
                run_dir = args.out / "runs" / name
                nested = dict(config[algorithm])
                nested.update({"learning_rate": float(lr), KL_KEY[algorithm]: float(kl)})
                nested.update({k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)})
                path = args.out / "configs" / f"{name}.yaml"
                path.write_text(yaml.safe_dump({**config, algorithm: nested, "output_dir": str(run_dir),
                                                "max_steps": args.steps}, sort_keys=False))
                shutil.rmtree(run_dir, ignore_errors=True)
                began = time.time()
                with (args.out / f"{name}.log").open("w") as log:
                    rc = subprocess.call([sys.executable, str(HERE / "train_rl.py"), "--config", str(path), "--quiet"],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                seconds = time.time() - began
                with times.open("a") as f:
                    f.write(f"{name}\t{seconds:.1f}\n")
                print(f"{name}: exit {rc}, {seconds:.0f} s", flush=True)
    policies = [f"start={ROOT / 'out' / 'rl_vist' / 'policy'}"]
    policies += [f"{n}={args.out / 'runs' / n / 'final'}" for n in names if (args.out / "runs" / n / "final").is_dir()]
    command = [sys.executable, str(HERE / "evaluate.py"), "--heldout", str(args.val), "--coherence-model",
               str(ROOT / "out" / "rl_vist" / "coherence" / "best"), "--out", str(args.out / "eval"),
               "--runs-dir", str(args.out / "runs"), "--times", str(times), "--samples", "1", "--label", "validation"]
    for p in policies:
        command += ["--policy", p]
    subprocess.check_call(command, cwd=ROOT)


if __name__ == "__main__":
    main()
