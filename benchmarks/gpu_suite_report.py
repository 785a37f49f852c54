"""The report machinery of benchmarks/gpu_suite.py: sections and their
tables, skips, the time budget, a part's context, one row's error handling
and the timing/peak-memory helpers."""

from __future__ import annotations

import gc
import math
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# -- the report ---------------------------------------------------------------------------------


class Skip(Exception):
    """A part or a row that cannot run here; the message is the reason."""


@dataclass
class Section:
    key: str
    title: str
    lines: list[str] = field(default_factory=list)
    status: str = "ok"  # ok, skipped, failed
    seconds: float = 0.0
    estimate: float = 0.0  # what the budget expected, seconds

    def table(self, rows: list[dict], columns: list[str] | None = None) -> None:
        if not rows:
            return
        columns = columns or list(rows[0])
        self.lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        self.lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
        self.lines.append("")

    def skip(self, what: str, reason: str) -> None:
        self.lines.append(f"- skipped: {what}: {reason}")

    def note(self, text: str) -> None:
        self.lines.append(f"- {text}")


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "/")


class Budget:
    def __init__(self, minutes: float) -> None:
        self.total = minutes * 60
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)

    def check(self, seconds: float, what: str) -> None:
        if seconds > self.left():
            raise Skip(f"time budget: needs ~{seconds / 60:.1f} min, {max(self.left(), 0) / 60:.1f} min left "
                       f"of {self.total / 60:g} ({what})")


@dataclass
class Context:
    tiny: bool
    device: str  # cpu or cuda
    budget: Budget
    root: Path
    quick: bool = False
    precision: str = "auto"  # --precision: auto (fp16 on CUDA, fp32 on the CPU), fp32, fp16, bf16
    shared: dict = field(default_factory=dict)  # built once, used by several parts (the 7B LLaVA-NeXT)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def dtype_name(self) -> str:
        """The precision the parts run their models in."""
        if self.precision != "auto":
            return self.precision
        return "fp16" if self.cuda else "fp32"

    def pick(self, tiny, quick, full):
        """A size (or an estimate) for the mode the suite runs in."""
        return tiny if self.tiny else quick if self.quick else full

    def check(self, key: str, full: float, tiny: float, what: str) -> None:
        """The budget check of one row: ``--quick`` takes its estimate from
        ``QUICK_ROWS[key]`` (derived from measured H100 figures)."""
        self.budget.check(self.pick(tiny, QUICK_ROWS[key], full), what)

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device ({what} needs one)")


# -- --quick's time plan -----------------------------------------------------------------------
# Every figure below comes from the first full-size run on one H100 80GB (CUDA 13, torch 2.11,
# 2026-11-27, random weights; ../shared/gpu/README.md and issue 30), unless it is marked ALLOWANCE:
# that run did not time it (model build/save/load, the install), so a margin is allowed and the
# report's "estimate" column next to each part's real time is what corrects it after a --quick run.
H100 = {
    "grpo_llava_step_s": 7.6,     # GRPO LLaVA-NeXT-7B + LoRA, batch 8, 64 new tokens (78 % generation)
    "llava_generation_share": 0.78,
    "grpo_llama4_step_s": 9.8,    # GRPO LLaMA-2-7B 4-bit + LoRA, batch 8, 64 new tokens (91 % generation)
    "llama_generation_share": 0.91,
    "clipscore_images_s": 75.0,   # CLIPScore first visit, ViT-B/32 (ViT-L/14: 78)
    "groovist_images_s": 31.0,    # GROOViST first visit (3x3 grid + whole image)
}
ALLOWANCE = {
    "install_s": 40,              # pip --no-index of ~27 MB of wheels (../shared/gpu/pack-wheels.sh)
    "llava_build_save_s": 30,     # 7.57 B random fp16 weights made on the GPU, ~15 GB written
    "llava_load_s": 15,           # ~15 GB read back (page cache) onto the GPU
    "llama_build_save_s": 25,     # 6.74 B, ~13.5 GB written
    "llama_4bit_load_s": 20,      # read back and quantised to NF4 on load
    "small_model_s": 5,           # build + save + load of one CLIP / ALBERT / BERT / ResNet (<= 1.7 GB)
    "deepspeed_s": 60,            # a subprocess: python, accelerate and DeepSpeed start, 3 tiny PPO steps
    "arch_s": 10,                 # meta-device counting (no weights); ~5 s on a 2-core CPU
    "rl_assets_s": 5,             # rl_step.py's data and tiny reward models (1 SFT step)
    "replay_warmup_s": 1,         # rl, per run and plain-generate variant: a 2-token warm-up (LLaVA: image prefill)
    "merge_4bit_s": 2,            # rl part, LLaMA 4-bit runs: peft merge_and_unload into NF4 after the run
}
# --quick's work per part (gpu_suite_parts.py, gpu_suite_rl.py use these sizes)
QUICK_RL_STEPS = 2                # 1 warm-up + 1 timed step per run (batch 8, as measured)
QUICK_RL_TOKENS = 24              # new tokens per story (measured at 64): makes room for plain generate's replays
QUICK_GEN_CALLS = 20              # 2 stories, visual + prev_sentence: warm-up 2 + one at a time 2 + 10 + batched 1 + 5
QUICK_GEN_TOKENS = 16
QUICK_CLIP_IMAGES = 20            # 4 sequences of 5 images


def _token_s(step_s: float, share: float, tokens: int = 64) -> float:
    """Seconds per generated token at batch 8, from a measured GRPO step: its generation share over 64 tokens."""
    return step_s * share / tokens


_LLAVA_TOKEN_S = _token_s(H100["grpo_llava_step_s"], H100["llava_generation_share"])
_LLAMA4_TOKEN_S = _token_s(H100["grpo_llama4_step_s"], H100["llama_generation_share"])
A = ALLOWANCE


def _rl_run_s(load_s: float, step64_s: float, token_s: float, extra_s: float = 0.0) -> float:
    """One --quick RL run: the load, QUICK_RL_STEPS steps of QUICK_RL_TOKENS new tokens (the measured 64-token
    step less the tokens not generated, at its measured rate), and plain generate replayed, unmerged and
    merged, for each timed step at that same rate (an upper bound: the RL rate holds the phase's overhead)."""
    step_s = step64_s - (64 - QUICK_RL_TOKENS) * token_s
    replays_s = (QUICK_RL_STEPS - 1) * 2 * QUICK_RL_TOKENS * token_s + 2 * A["replay_warmup_s"]
    return load_s + QUICK_RL_STEPS * step_s + replays_s + extra_s


# Row estimates (seconds). PPO's step at 7B was not measured (it stopped at step 1 on that run): taken as
# GRPO's measured step (generation dominates both; --quick runs PPO with 1 epoch).
_RL_LLAVA_RUN = _rl_run_s(A["llava_load_s"], H100["grpo_llava_step_s"], _LLAVA_TOKEN_S)
_RL_LLAMA_RUN = _rl_run_s(A["llama_4bit_load_s"], H100["grpo_llama4_step_s"], _LLAMA4_TOKEN_S, A["merge_4bit_s"])
QUICK_ROWS = {
    "rl llava": A["llava_build_save_s"] + 2 * _RL_LLAVA_RUN,  # PPO and GRPO
    "rl llava run": _RL_LLAVA_RUN,
    "rl llama": A["llama_build_save_s"] + 2 * _RL_LLAMA_RUN,
    "rl llama run": _RL_LLAMA_RUN,
    # one generate call of 16 new tokens at the measured per-token rate (batch 8 with LoRA: an upper bound)
    "generate fp16": A["llava_load_s"] + QUICK_GEN_CALLS * QUICK_GEN_TOKENS * _LLAVA_TOKEN_S,
    # 4-bit decoding at the measured LLaMA-2-7B 4-bit rate (0.139 s/token vs LLaVA fp16's 0.093)
    "generate 4-bit": A["llama_4bit_load_s"] + QUICK_GEN_CALLS * QUICK_GEN_TOKENS * _LLAMA4_TOKEN_S,
    "generate build": A["llava_build_save_s"],  # only when the rl part did not build the 7B LLaVA-NeXT first
    "vllm": 240,  # not in --quick's plan (vLLM is not on the wheel list): engine start alone takes minutes
    # per CLIP: build + save, two rewards loaded, first visits at the measured images/s, revisits ~free;
    # twice: the exact and the fast image pipeline (the H100 rates were exact's, so an upper bound for fast)
    "clip": 3 * A["small_model_s"]
    + 2 * QUICK_CLIP_IMAGES * (1 / H100["clipscore_images_s"] + 1 / H100["groovist_images_s"]),
    "coherence": 2 * A["small_model_s"],   # 200 pairs: one per forward ~3 s, batched 7.6x faster (measured ratio)
    "vrank": 2 * A["small_model_s"],       # 50 pairs
    "deepspeed": A["deepspeed_s"],
}
QUICK_PARTS = {
    "rl": A["rl_assets_s"] + QUICK_ROWS["rl llava"] + QUICK_ROWS["rl llama"],
    "generate": QUICK_ROWS["generate fp16"] + QUICK_ROWS["generate 4-bit"],  # the rl part's 7B build reused
    "clip": 2 * QUICK_ROWS["clip"] + A["small_model_s"],  # ViT-B/32, ViT-L/14, ResNet-50 v2 (~7k images/s)
    "pairs": QUICK_ROWS["coherence"] + QUICK_ROWS["vrank"],
    "arch": A["arch_s"],
    "deepspeed": QUICK_ROWS["deepspeed"],
}
QUICK_TOTAL_S = 8 * 60  # one H100, the install included


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def need(module: str, extra: str) -> None:
    if not _have(module):
        raise Skip(f"{module} is not installed ({extra})")


def _is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def free_memory() -> None:
    from storyrl.models.runtime import release_models

    release_models()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def row(section: Section, what: str):
    """Run one row: a Skip or an out-of-memory error becomes a skip line, any
    other error a FAILED line that fails the part; either way the part goes on
    with its other rows (one GPU run should keep every figure it can get)."""
    try:
        yield
    except Skip as exc:
        section.skip(what, str(exc))
    except Exception as exc:  # noqa: BLE001  (reported in the section)
        if _is_oom(exc):
            section.skip(what, f"out of memory: {_one_line(exc)}")
        else:
            section.status = "failed"
            section.lines.append(f"- FAILED: {what}: {type(exc).__name__}: {_one_line(exc)}")
            traceback.print_exc()
        free_memory()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "…") if len(text) > 300 else text


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def weights_dtype(*objects) -> str | None:
    """The floating dtype holding most parameters of the torch modules in
    ``objects`` (modules, tuples of them, or objects with module attributes,
    one level down), in their linear/conv/attention layers: what a model
    really runs in, for the report to show
    next to the --precision asked for (a 4-bit model: its float parameters)."""
    import torch

    modules, seen = [], set()

    def visit(obj, depth):
        if id(obj) in seen or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
        elif depth > 0 and isinstance(obj, (tuple, list)):
            for x in obj:
                visit(x, depth - 1)
        elif depth > 0 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for x in vars(obj).values():
                visit(x, depth - 1)

    for obj in objects:
        visit(obj, 2)
    # the matrix-multiplying layers' own weights: embeddings and norms may stay fp32 by design (open_clip's
    # fp16 keeps its token embedding in fp32, a tiny model's largest table)
    matmul = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.MultiheadAttention)
    counts: dict = {}
    for module in modules:
        for layer in module.modules():
            if not isinstance(layer, matmul):
                continue
            for p in layer.parameters(recurse=False):
                if p.is_floating_point():
                    counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        return None
    dtype = max(counts, key=counts.get)
    return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."), str(dtype))


def shared_models_dtype() -> str | None:
    """:func:`weights_dtype` of the models storyrl's rewards hold now
    (``storyrl.models.runtime``'s shared instances)."""
    from storyrl.models import runtime

    return weights_dtype(*getattr(runtime, "_SHARED", {}).values())


def timed(fn, device: str, *args, **kwargs):
    """(seconds, ``fn(*args, **kwargs)``), the device synchronised around it."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - t0, out
