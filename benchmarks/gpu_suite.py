"""GPU validation suite: the paper's real model sizes (random weights) through
storyrl's GPU paths on whatever GPU is there, in one command, into one
Markdown report.

Parts (``--parts``, comma-separated; default all, in this order):

* ``arch``: parameter counts of every architecture at full size, counted on
  the meta device (nothing allocated), against the published figures.
* ``generate``: ``storyrl generate``'s batched path vs the authors' one
  story (one image) at a time, same model object, greedy, stories compared;
  LLaVA-NeXT (Mistral-7B + CLIP ViT-L/14-336) in fp16 and 4-bit, and
  storyrl's vLLM backend when vLLM imports (benchmarks/generate.py's pieces).
* ``clip``: GROOViST and CLIPScore (open_clip ViT-B/32 and ViT-L/14)
  images/s and stories/s on first visit (image caches cold) and revisit,
  and the ResNet-50 v2 image tower (COSMiC's) images/s.
* ``pairs``: RoViST-C (ALBERT-large) pairs/s batched vs one pair per
  forward, with the >= 5x target; Vrank (BERT-large, SimCSE's) likewise.
* ``rl``: one PPO, one GRPO and (not in ``--quick``) one RLOO run (a few
  steps) of LLaVA-NeXT-7B + LoRA and LLaMA-2-7B 4-bit + LoRA with the
  ``dhm`` reward, through benchmarks/rl_step.py's runners: time split and
  peak CUDA memory, next to benchmarks/README.md's 7B memory estimates; and
  next to each run's generation phase, plain ``generate`` on the same
  model, LoRA unmerged and merged, with the same inputs and decoding steps
  (benchmarks/rl_generate.py), and the ratio (target <= 1.25, issue 32).
* ``deepspeed``: ``storyrl launch`` with configs/accelerate/deepspeed_zero2.yaml
  on one GPU, a few PPO steps of a small policy, in a subprocess.

Every model has random weights built from a config in gpu_suite_arch.py (no
hub: the GPU machine has no network) and a word-level tokenizer built here,
filled with filler words to the real vocabulary size (LLaVA-NeXT-7B 32,064,
LLaMA-2 32,000, ALBERT 30,000, BERT 30,522). The 7B LLaVA-NeXT is built once
per run and shared by the rl and generate parts.
The code: this file (options, the driver, the report's header), and beside it
gpu_suite_arch.py (architectures, parameter counts), gpu_suite_report.py
(sections, rows, skips, the time budget and --quick's plan, timing),
gpu_suite_parts.py (arch, generate, clip, pairs; synthetic data) and
gpu_suite_rl.py (rl, deepspeed).
Each part is timed; a part or a row that cannot run is skipped with a
one-line reason (no CUDA, a package missing, out of memory, the time budget).
``--budget-minutes`` (default 40; 7.33 with --quick) is checked against each
part's estimate before it starts, and against each expensive row's.

Modes: the default runs every part at full size (~35 minutes on one H100).
``--quick`` runs the same parts at full size with less work in each (one
warm-up and one timed step per RL run, 24 new tokens per story there, PPO
and GRPO only, 2 stories in generate, 20 images in clip, 50 stories in
pairs), the most important first (rl, generate, clip, pairs, then arch and
deepspeed); its estimates, derived in
gpu_suite_report.py from the first H100 run's figures, add up to <= 8
minutes with the wheels' install. ``--tiny`` shrinks every architecture to a
layer or two of width 32 and runs what it can on the CPU in well under a
minute (the tests run it, at fp32, fp16 and bf16, so that the suite cannot
rot). ``--precision`` (auto: fp16 on CUDA, fp32 on the CPU) is the dtype of
the rewards' models, of generation, and of the RL policy and its rewards
(auto leaves the policy in storyrl's own auto: bf16 on a GPU that has it);
every row shows the dtype its model's weights really had. The rl part's
noun phrases: spaCy's when spaCy is installed, else a regular expression
(the report says which).

A row's error other than a skip is written as a FAILED line and the part
goes on with its other rows. The report is rewritten after every part.

Exit status: 0; 1 when a part or one of its rows failed (an error other than
a skip); 2 for bad options or a report that exists (``--overwrite``).

Usage::

    python benchmarks/gpu_suite.py [--out benchmarks/gpu_report.md] [--overwrite] [--tiny | --quick]
        [--parts arch,generate,clip,pairs,rl,deepspeed] [--budget-minutes 40] [--device auto|cpu|cuda]
        [--precision auto|fp32|fp16|bf16] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (BENCH, REPO / "tests"):  # generate.py, rl_step.py; tiny_models
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from gpu_suite_parts import part_arch, part_clip, part_generate, part_pairs
from gpu_suite_report import (
    ALLOWANCE,
    QUICK_PARTS,
    QUICK_TOTAL_S,
    Budget,
    Context,
    Section,
    Skip,
    _is_oom,
    _one_line,
    free_memory,
)
from gpu_suite_rl import part_deepspeed, part_rl

DEFAULT_OUT = BENCH / "gpu_report.md"

# -- driver -------------------------------------------------------------------------------------

# key -> (title, runner, estimated seconds at full size on a GPU, estimated seconds with --tiny)
PARTS = {
    "arch": ("Architectures at full size (parameter counts)", part_arch, 30, 15),
    "generate": ("1. `storyrl generate`: batched vs one at a time (fp16, 4-bit, vLLM)", part_generate, 600, 25),
    "clip": ("2. GROOViST / CLIPScore (and ResNet-50 v2) throughput", part_clip, 180, 15),
    "pairs": ("3. RoViST-C and Vrank pairs/s, batched vs one pair per forward", part_pairs, 180, 10),
    "rl": ("4. PPO, GRPO (and RLOO) steps with LoRA (and 4-bit), dhm reward, next to plain generate", part_rl,
           900, 60),
    "deepspeed": ("5. DeepSpeed ZeRO-2 through the shipped accelerate config", part_deepspeed, 180, 1),
}


# --quick: what matters most first (the RL rows for PPO and GRPO, then generate fp16 / 4-bit, then CLIP and
# pairs), so that a GPU window that ends early has the figures that count; estimates: QUICK_PARTS.
QUICK_ORDER = ["rl", "generate", "clip", "pairs", "arch", "deepspeed"]
# The default --budget-minutes of --quick: 8 minutes on the machine, less the wheels' install before the run
QUICK_BUDGET_MINUTES = (QUICK_TOTAL_S - ALLOWANCE["install_s"]) / 60
PRECISIONS = ("auto", "fp32", "fp16", "bf16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the Markdown report (default {DEFAULT_OUT})")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true", help="shrunk architectures; what can run runs on the CPU")
    mode.add_argument("--quick", action="store_true",
                      help="full size, less work per part, most important part first: fits 8 minutes on one H100 "
                           "with the install")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)} (default all)")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help=f"parts that would not fit are skipped (default 40; --quick {QUICK_BUDGET_MINUTES:.2f})")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="the models' dtype: rewards, generation, the RL policy (default auto: fp16 on CUDA, fp32 on "
                        "the CPU; the RL policy then keeps storyrl's own auto)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when available (default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        p.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    args.parts = [k for k in (QUICK_ORDER if args.quick else PARTS) if k in parts]
    if args.budget_minutes is None:
        args.budget_minutes = QUICK_BUDGET_MINUTES if args.quick else 40.0
    if not args.budget_minutes > 0:
        p.error(f"--budget-minutes must be > 0, got {args.budget_minutes:g}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "open_clip_torch", "timm", "bitsandbytes",
                 "vllm", "deepspeed"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join(out)


def device_line(device: str) -> str:
    import torch

    if device != "cuda":
        return f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; no CUDA device)"
    props = torch.cuda.get_device_properties(0)
    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                check=False, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return (f"{torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, driver {driver}, "
            f"CUDA {torch.version.cuda}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    out = args.out
    if out.exists() and not args.overwrite:
        print(f"{out}: exists; pass --overwrite to replace it, or --out another path", file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"--out {out}: no directory {out.parent}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    import torch

    import storyrl  # noqa: F401  (before transformers: CPU torchvision fallback)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use --device auto or cpu", file=sys.stderr)
        return 2
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    from storyrl.models.runtime import cuda_native_bf16

    if args.precision == "bf16" and device == "cuda" and not cuda_native_bf16():
        print(f"--precision bf16: {torch.cuda.get_device_name(0)} does not support bfloat16; use fp16 or fp32",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = Budget(args.budget_minutes)
    sections = []
    shared: dict = {}  # models built once for several parts (the 7B LLaVA-NeXT: rl and generate)
    with tempfile.TemporaryDirectory(prefix="storyrl_gpu_suite_") as root:
        for key in args.parts:
            title, runner, full_s, tiny_s = PARTS[key]
            section = Section(key, title)
            section.estimate = tiny_s if args.tiny else QUICK_PARTS[key] if args.quick else full_s
            sections.append(section)
            estimate = section.estimate
            print(f"[gpu_suite] {key}: starting (estimate {estimate / 60:.1f} min, {budget.left() / 60:.1f} left)",
                  file=sys.stderr)
            t0 = time.perf_counter()
            try:
                budget.check(estimate, f"estimate of part {key}")
                (Path(root) / key).mkdir()
                runner(Context(args.tiny, device, budget, Path(root), quick=args.quick, precision=args.precision,
                               shared=shared), section)
                if section.status == "ok" and not any(line.startswith("|") for line in section.lines):
                    section.status = "skipped"  # every row skipped
            except Skip as exc:
                section.status = "skipped"
                section.skip(key, str(exc))
            except Exception as exc:  # noqa: BLE001  (reported in the section; the other parts still run)
                if _is_oom(exc):
                    section.status = "skipped"
                    section.skip(key, f"out of memory: {_one_line(exc)}")
                else:
                    section.status = "failed"
                    section.lines.append(f"- FAILED: {type(exc).__name__}: {_one_line(exc)}")
                    traceback.print_exc()
                free_memory()
            shutil.rmtree(Path(root) / key, ignore_errors=True)  # 7B models: ~15 GB of disk each
            section.seconds = time.perf_counter() - t0
            print(f"[gpu_suite] {key}: {section.status} in {section.seconds:.1f} s", file=sys.stderr)
            # after every part: a run cut short (a machine's time limit) still leaves what it measured
            running = len(sections) < len(args.parts)
            out.write_text(render(args, device, sections, budget, running), encoding="utf-8")
    print(f"wrote {out}")
    return 1 if any(s.status == "failed" for s in sections) else 0


def mode_line(args) -> str:
    if args.tiny:
        return "--tiny (shrunk architectures)"
    if args.quick:
        return (f"--quick (full-size architectures, less work per part; parts' estimates add up to "
                f"{sum(QUICK_PARTS[k] for k in args.parts) / 60:.1f} min, + {ALLOWANCE['install_s']} s for the "
                f"install)")
    return "full-size architectures"


def precision_line(precision: str, device: str) -> str:
    if precision == "auto":
        return (f"auto: {'fp16' if device == 'cuda' else 'fp32'} for the rewards and generation; the RL policy in "
                f"storyrl's auto (bf16 on a GPU that supports it, else fp32)")
    return f"{precision} (rewards, generation, the RL policy and its rewards)"


def render(args, device: str, sections: list[Section], budget: Budget, running: bool = False) -> str:
    lines = ["# storyrl GPU validation suite", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
             f"- command: `{' '.join(['python benchmarks/gpu_suite.py', *args.argv])}`",
             f"- device: {device_line(device)}",
             f"- mode: {mode_line(args)}, random weights",
             f"- precision: {precision_line(args.precision, device)}",
             f"- python {platform.python_version()}; {_versions()}",
             f"- budget: {args.budget_minutes:g} min; used {(budget.total - budget.left()) / 60:.1f} min",
             *([f"- INCOMPLETE: {len(sections)} of {len(args.parts)} parts done, still running"] if running else []),
             "",
             "## Summary", "", "| part | status | seconds | estimate (s) |", "|---|---|---|---|"]
    lines += [f"| {s.key} | {s.status} | {s.seconds:.1f} | {s.estimate:.0f} |" for s in sections]
    for s in sections:
        lines += ["", f"## {s.title} (`{s.key}`)", "", *s.lines, "", f"- time: {s.seconds:.1f} s"]
    return "\n".join(re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).splitlines()) + "\n"


if __name__ == "__main__":
    sys.exit(main())
