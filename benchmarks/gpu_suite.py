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
* ``rl``: one PPO and one GRPO run (a few steps) of LLaVA-NeXT-7B + LoRA and
  LLaMA-2-7B 4-bit + LoRA with the ``dhm`` reward, through
  benchmarks/rl_step.py's runners: time split and peak CUDA memory, next to
  benchmarks/README.md's 7B memory estimates.
* ``deepspeed``: ``storyrl launch`` with configs/accelerate/deepspeed_zero2.yaml
  on one GPU, a few PPO steps of a small policy, in a subprocess.

Every model has random weights built from a config in this file (no hub:
the GPU machine has no network) and a word-level tokenizer built here.
Each part is timed; a part or a row that cannot run is skipped with a
one-line reason (no CUDA, a package missing, out of memory, the time budget).
``--budget-minutes`` (default 40) is checked against each part's estimate
before it starts. ``--tiny`` shrinks every architecture to a layer or two of
width 32 and runs what it can on the CPU in about a minute (the tests run it
so that the suite cannot rot).

A row's error other than a skip is written as a FAILED line and the part
goes on with its other rows. The report is rewritten after every part.

Exit status: 0; 1 when a part or one of its rows failed (an error other than
a skip); 2 for bad options or a report that exists (``--overwrite``).

Usage::

    python benchmarks/gpu_suite.py [--out benchmarks/gpu_report.md] [--overwrite] [--tiny]
        [--parts arch,generate,clip,pairs,rl,deepspeed] [--budget-minutes 40] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (BENCH, REPO / "tests"):  # generate.py, rl_step.py; tiny_models
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

DEFAULT_OUT = BENCH / "gpu_report.md"
COHERENCE_TARGET = 5.0

# -- architectures (full size; --tiny shrinks them) --------------------------------------------

MISTRAL_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None,
                  "rms_norm_eps": 1e-5}
CLIP_VIT_L14_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                        "image_size": 336, "patch_size": 14, "projection_dim": 768, "hidden_act": "quick_gelu"}
LLAVA_NEXT_GRID = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAMA2_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "intermediate_size": 11008, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
ALBERT_LARGE = {"embedding_size": 128, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096, "max_position_embeddings": 512}
BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                  "max_position_embeddings": 512}
TINY_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "intermediate_size": 64, "max_position_embeddings": 2048}
TINY_ALBERT = {"embedding_size": 16, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "intermediate_size": 64, "max_position_embeddings": 512}
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                 "max_position_embeddings": 512}
TINY_CLIP = {"embed_dim": 32,
             "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}

# Published parameter counts (full size), for the arch part and the tests.
EXPECTED_PARAMETERS = {
    "LLaMA-2-7B": 6.74e9, "Mistral-7B": 7.24e9, "ALBERT-large": 17.7e6, "BERT-large": 335e6,
    "CLIP ViT-B/32": 151e6, "CLIP ViT-L/14": 428e6, "ResNet-50 v2": 25.5e6,
    # llava-v1.6-mistral-7b's model card: 7.57 B (its row name contains Mistral-7B's and CLIP ViT-L/14's: matched
    # whole, never by substring)
    "LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)": 7.57e9,
}


def _mistral(tiny: bool, vocab: int = 32000):
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, **(TINY_TEXT if tiny else MISTRAL_7B))


def _llava_next_config(tiny: bool, vocab: int = 32064):
    from transformers import CLIPVisionConfig, LlavaNextConfig

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32,
                  "patch_size": 8} if tiny else CLIP_VIT_L14_336
    grid = [[32, 64], [64, 32], [64, 64]] if tiny else LLAVA_NEXT_GRID
    return LlavaNextConfig(vision_config=CLIPVisionConfig(**vision), text_config=_mistral(tiny, vocab),
                           image_grid_pinpoints=grid, vision_feature_layer=-2)


def _open_clip_cfg(name: str, tiny: bool) -> dict:
    if tiny:
        return TINY_CLIP
    import open_clip

    cfg = open_clip.get_model_config(name)  # shipped with open_clip: no network
    if cfg is None:
        raise RuntimeError(f"open_clip has no config {name!r}")
    return cfg


def architectures(tiny: bool = False) -> dict:
    """Name -> a function building the (random-weight) model, full size or
    shrunk with ``tiny``. Build them under ``torch.device("meta")`` to count."""
    def llava():
        from transformers import LlavaNextForConditionalGeneration

        return LlavaNextForConditionalGeneration(_llava_next_config(tiny))

    def mistral():
        from transformers import MistralForCausalLM

        return MistralForCausalLM(_mistral(tiny))

    def llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        size = {k: v for k, v in TINY_TEXT.items()} if tiny else LLAMA2_7B
        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, **size))

    def albert():
        from transformers import AlbertConfig, AlbertModel

        return AlbertModel(AlbertConfig(vocab_size=30000, **(TINY_ALBERT if tiny else ALBERT_LARGE)))

    def bert():
        from transformers import BertConfig, BertModel

        return BertModel(BertConfig(vocab_size=30522, **(TINY_BERT if tiny else BERT_LARGE)))

    def clip(name):
        def build():
            import open_clip

            return open_clip.CLIP(**_open_clip_cfg(name, tiny))

        return build

    return {
        "LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336)": llava,
        "Mistral-7B": mistral,
        "LLaMA-2-7B": llama,
        "CLIP ViT-B/32": clip("ViT-B-32"),
        "CLIP ViT-L/14": clip("ViT-L-14"),
        "ALBERT-large": albert,
        "BERT-large": bert,
        "ResNet-50 v2": lambda: resnetv2(tiny),
    }


def resnetv2(tiny: bool):
    """timm's ``resnetv2_50`` (pre-activation ResNet-50 v2, COSMiC's image
    tower), or the same design with one block per stage and narrow channels."""
    import timm

    if not tiny:
        return timm.create_model("resnetv2_50", pretrained=False)
    from timm.layers import BatchNormAct2d, create_conv2d
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=(1, 1, 1, 1), channels=(32, 64, 128, 256), stem_chs=16, num_classes=10,
                    conv_layer=create_conv2d, norm_layer=BatchNormAct2d)


def count_parameters(build) -> int:
    """Parameters of the model ``build()`` returns, built on the meta device
    (shapes only: a 7B model costs no memory)."""
    import torch

    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


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

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device ({what} needs one)")


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


def timed(fn, device: str, *args, **kwargs):
    """(seconds, ``fn(*args, **kwargs)``), the device synchronised around it."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - t0, out


# -- synthetic data ---------------------------------------------------------------------------

WORDS = ["dog", "cat", "church", "bride", "cake", "tree", "beach", "sky", "car", "street", "crowd", "stage", "band", "flowers", "table", "wedding", "bottle", "dress", "girl", "boy", "man", "woman", "house", "garden", "river", "boat", "bridge", "park"]
ADJS = ["the", "a", "big", "small", "old", "new", "red", "happy", "quiet", "long"]
VERBS = ["saw", "liked", "found", "watched", "visited", "painted", "loved", "left"]


def synthetic_stories(n: int, seed: int = 0, sentences: int = 5) -> list[str]:
    """Lower-cased VIST-like stories of ``sentences`` sentences."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(sentences):
            k = rng.randint(0, 2)
            noun = " and the ".join(rng.choice(WORDS) for _ in range(1 + k))
            parts.append(f"{rng.choice(ADJS)} {rng.choice(WORDS)} {rng.choice(VERBS)} the {noun} .")
        out.append(" ".join(parts))
    return out


def write_sequence_images(directory: Path, sequences: int, size: tuple[int, int], seed: int = 0) -> list[list[str]]:
    """5 distinct PNGs (gradient + noise, ``size`` = width, height) per sequence."""
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    x = np.linspace(0, 1, w)[None, :, None]
    y = np.linspace(0, 1, h)[:, None, None]
    out = []
    for s in range(sequences):
        paths = []
        for k in range(5):
            pixels = rng.uniform(0, 255, size=3) * (0.4 + 0.6 * x) * (0.5 + 0.5 * y) + rng.normal(0, 12, (h, w, 3))
            path = directory / f"seq{s}_{k}.png"
            Image.fromarray(np.clip(pixels, 0, 255).astype("uint8")).save(path)
            paths.append(str(path))
        out.append(paths)
    return out


# -- part: arch ---------------------------------------------------------------------------------


def part_arch(ctx: Context, section: Section) -> None:
    rows = []
    for name, build in architectures(tiny=False).items():
        n = count_parameters(build)
        expected = next((v for k, v in EXPECTED_PARAMETERS.items() if name == k), None)
        rows.append({"architecture": name, "parameters (M)": n / 1e6,
                     "published (M)": expected / 1e6 if expected else None,
                     "fp16 weights (GiB)": n * 2 / 2**30})
    section.table(rows)
    section.note("counted on the meta device (shapes only); LLaVA-NeXT's vocabulary is 32,064 (llava-v1.6), "
                 "Mistral-7B's and LLaMA-2's 32,000; ALBERT/BERT are the encoders with their pooler.")
    if ctx.tiny:
        tiny = {name: count_parameters(build) for name, build in architectures(tiny=True).items()}
        section.note("--tiny runs these shrunk (a layer or two, width 32): "
                     + ", ".join(f"{k} {v / 1e3:.1f} k" for k, v in tiny.items()))


# -- part: generate -----------------------------------------------------------------------------


def _generate_storyrl(ctx, model_dir, setting, records, out, *, precision, load_in_4bit, batch_size, max_new_tokens,
                      sequence_image_size, backend="transformers"):
    from storyrl.datasets import load_records
    from storyrl.generators import create_generator
    from storyrl.generators.runs import generate_to_file

    def run():
        generator = create_generator("prompting", model=model_dir, setting=setting, prompt="P3",
                                     batch_size=batch_size, device=ctx.device, precision=precision,
                                     load_in_4bit=load_in_4bit, max_new_tokens=max_new_tokens, backend=backend,
                                     sequence_image_size=sequence_image_size)
        return generate_to_file(generator, load_records(records), out, overwrite=True, progress=False,
                                inputs={"data": str(records)})

    seconds, result = timed(run, ctx.device)
    if result.failures:
        raise RuntimeError(f"storyrl generate: {len(result.failures)} stories failed: "
                           f"{next(iter(result.failures.values()))}")
    return seconds, result.stories


def _authors_all(authors, setting: str, lines: list[dict]) -> dict[str, str]:
    return {r["story_id"]: authors.story(setting, r["images"]) for r in lines}


def part_generate(ctx: Context, section: Section) -> None:
    import generate as gen  # benchmarks/generate.py
    import torch

    from storyrl.models.vlm import load_vlm

    shape = "tiny" if ctx.tiny else "7b"
    if shape == "7b":
        ctx.need_cuda("the 7B LLaVA-NeXT")
    n_stories, batch, max_new = (3, 3, 6) if ctx.tiny else (8, 8, 32)
    settings = ["visual", "prev_sentence"]
    tmp = ctx.root / "generate"
    (tmp / "images").mkdir(parents=True)
    t0 = time.perf_counter()
    model_dir = gen.build_model(shape, tmp / "model", ctx.device if shape == "7b" else "cpu")
    section.note(f"model: LLaVA-NeXT {'(tiny)' if ctx.tiny else '7B (Mistral-7B + CLIP ViT-L/14-336)'}, random "
                 f"weights, built and saved in {time.perf_counter() - t0:.1f} s; {n_stories} stories x 5 images, "
                 f"batch {batch}, {max_new} new tokens per call, greedy, prompt P3")
    sizes = gen.SHAPES[shape]
    records = gen.write_data(tmp / "images", n_stories, sizes["images"])
    warm = tmp / "images" / "warm.jsonl"
    warm.write_text(records.read_text().splitlines()[0] + "\n")
    variants = [("fp32", "fp32", False)] if not ctx.cuda else []
    variants += [("fp16", "fp16", False), ("4-bit NF4", "fp16", True)]
    rows, fp16_rows = [], []
    for label, precision, four_bit in variants:
        vlm = authors = None  # drop the previous variant's model (also after an out-of-memory error)
        with row(section, label):
            if precision == "fp16":
                ctx.need_cuda(f"{label} generation")
            if four_bit:
                need("bitsandbytes", "4-bit loading: pip install 'storyrl[quant]'")
            ctx.budget.check(60 if ctx.tiny else 150, f"generate {label}")
            free_memory()
            vlm = load_vlm(model_dir, None, ctx.device, precision, four_bit)
            dtype = torch.float32 if precision == "fp32" else torch.float16
            authors = gen.Authors(model_dir, vlm.model, vlm.device, dtype, max_new, "P3",
                                  sizes["sequence_image_size"])
            opts = {"precision": precision, "load_in_4bit": four_bit, "batch_size": batch, "max_new_tokens": max_new,
                        "sequence_image_size": sizes["sequence_image_size"]}
            lines = [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
            for setting in settings:
                _generate_storyrl(ctx, model_dir, setting, warm, tmp / "warm.json", **opts)  # first-call costs
                authors.story(setting, lines[0]["images"])
                _reset_peak(ctx.device)
                a_s, a_stories = timed(_authors_all, ctx.device, authors, setting, lines)
                a_peak = _peak_gib(ctx.device)
                _reset_peak(ctx.device)
                out = tmp / (f"{setting}.json" if precision == "fp16" and not four_bit else f"{label}_{setting}.json")
                s_s, s_stories = _generate_storyrl(ctx, model_dir, setting, records, out, **opts)
                s_peak = _peak_gib(ctx.device)
                differ = sum(s_stories.get(k) != v for k, v in a_stories.items())
                r = {"precision": label, "setting": setting, "stories": n_stories,
                     "one at a time (stories/s)": n_stories / a_s, "storyrl batched (stories/s)": n_stories / s_s,
                     "speed-up": a_s / s_s, "same stories": differ == 0, "differing": differ,
                     "peak GiB (one / batched)": None if a_peak is None else f"{a_peak:.2f} / {s_peak:.2f}"}
                rows.append(r)
                if precision == "fp16" and not four_bit:
                    fp16_rows.append({"authors_sps": r["one at a time (stories/s)"]})
    vlm = authors = None
    free_memory()
    section.table(rows)
    with row(section, "vLLM"):
        ctx.need_cuda("vLLM")
        need("vllm", "pip install vllm")
        if len(fp16_rows) != len(settings):
            raise Skip("needs the fp16 transformers figures first (that row did not run)")
        ctx.budget.check(240, "vLLM engine start and generation")
        args = SimpleNamespace(device=ctx.device, precision="fp16", prompt="P3", batch_size=batch,
                               max_new_tokens=max_new, shape=shape, stories=n_stories)
        vrows = gen.run_vllm(args, model_dir, settings, records, tmp, fp16_rows)
        section.table([{"setting": v["setting"], "vLLM (stories/s)": v.get("storyrl_vllm_sps"),
                        "engine start (s)": v.get("engine_start_s"),
                        "same story as transformers": v.get("agree_with_transformers"),
                        "error": v.get("error")} for v in vrows])
    section.note("'same stories': storyrl's batched stories equal the one-at-a-time ones, story for story "
                 "(greedy; fp16/4-bit kernels may differ in the last digits with padding, so a few may differ).")


# -- part: clip ---------------------------------------------------------------------------------


def _save_clip(directory: Path, cfg: dict) -> str:
    import open_clip
    import torch

    directory.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(open_clip.CLIP(**cfg).state_dict(), directory / "open_clip_pytorch_model.bin")
    (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    return f"local-dir:{directory}"


def _repeat(model, x, reps: int) -> None:
    for _ in range(reps):
        model(x)


def part_clip(ctx: Context, section: Section) -> None:
    import numpy as np
    from tiny_models import KeywordPhrases

    from storyrl.rewards import create_reward
    from storyrl.text import clear_caches

    sequences, candidates = (2, 2) if ctx.tiny else (16, 8)
    tmp = ctx.root / "clip"
    images = write_sequence_images(tmp / "images", sequences, (64, 48) if ctx.tiny else (500, 375))
    stories = synthetic_stories(sequences * candidates, seed=1)
    story_images = [images[i // candidates] for i in range(len(stories))]
    pronouns = tmp / "pronouns.txt"
    pronouns.write_text("it\nwe\nthey\nhe\nshe\n")
    precision = "fp16" if ctx.cuda else "fp32"
    rows = []
    for name in ("ViT-B-32", "ViT-L-14"):
        with row(section, f"CLIP {name}"):
            ctx.budget.check(20 if ctx.tiny else 60, f"CLIP {name}")
            clip = _save_clip(tmp / name, _open_clip_cfg(name, ctx.tiny))
            for reward_name in ("groovist", "clipscore"):
                free_memory()
                clear_caches()
                options = {"clip_model": clip, "clip_pretrained": None, "device": ctx.device, "precision": precision}
                if reward_name == "groovist":
                    options.update(regions="grid", weighting="none", pronouns=str(pronouns))
                reward = create_reward(reward_name, **options)
                if reward_name == "groovist":
                    reward._extractor = KeywordPhrases(WORDS)  # no spaCy pipeline offline
                reward.setup()
                _reset_peak(ctx.device)
                cold_s, cold = timed(reward.score, ctx.device, stories, images=story_images)
                warm_s, warm = timed(reward.score, ctx.device, stories, images=story_images)
                n_images = sequences * 5
                regions = n_images * (reward.grid ** 2 + 1) if reward_name == "groovist" else n_images
                same = np.allclose(cold, warm, atol=1e-5, equal_nan=True)
                rows.append({"reward": reward_name, "CLIP": name + (" (tiny)" if ctx.tiny else ""),
                             "stories": len(stories), "images": n_images, "crops encoded": regions,
                             "images/s (first visit)": n_images / cold_s,
                             "stories/s (first visit)": len(stories) / cold_s,
                             "stories/s (revisit)": len(stories) / warm_s,
                             "first = revisit scores": bool(same), "peak GiB": _peak_gib(ctx.device)})
    section.table(rows)
    section.note("first visit: every image (GROOViST: its 3x3 grid + whole-image regions) is embedded inside the "
                 "call; revisit: the same calls again with the embedding caches warm (text work only). Noun "
                 "phrases come from a keyword stand-in (no spaCy pipeline offline); GROOViST unweighted.")
    with row(section, "ResNet-50 v2"):
        import torch

        need("timm", "pip install timm")
        free_memory()
        model = resnetv2(ctx.tiny).eval().to(ctx.device)
        dtype = torch.float16 if ctx.cuda else torch.float32
        model = model.to(dtype)
        batch, size = (4, 64) if ctx.tiny else (64, 224)
        x = torch.randn(batch, 3, size, size, device=ctx.device, dtype=dtype)
        with torch.inference_mode():
            model(x)
            _reset_peak(ctx.device)
            reps = 2 if ctx.tiny else 10
            seconds, _ = timed(_repeat, ctx.device, model, x, reps)
        section.table([{"model": "ResNet-50 v2 (timm resnetv2_50)" + (" (tiny)" if ctx.tiny else ""),
                        "batch": batch, "pixels": size, "precision": "fp16" if ctx.cuda else "fp32",
                        "images/s": batch * reps / seconds, "peak GiB": _peak_gib(ctx.device)}])
        del model


# -- part: pairs --------------------------------------------------------------------------------


def _one_pair_per_forward(loaded, pairs: list[tuple[str, str]], kind: str):
    """The authors' way: one tokenizer call and one forward pass per pair, in
    the reward's own model object (``kind``: coherence -> P(coherent), vrank
    -> the prediction the reward returns)."""
    import numpy as np
    import torch

    net, tok, device, dtype = loaded
    out = []
    with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        for first, second in pairs:
            truncation = "only_first" if kind == "coherence" else "longest_first"
            enc = tok(first, second, return_tensors="pt", truncation=truncation, max_length=512)
            logits = net(**{k: v.to(device) for k, v in enc.items()}).float()
            out.append(torch.softmax(logits, -1)[0, 1].item() if kind == "coherence" else -logits.item())
    return np.asarray(out)


def part_pairs(ctx: Context, section: Section) -> None:
    import coherence as coherence_bench  # benchmarks/coherence.py: its word-level ALBERT tokenizer
    import numpy as np
    import torch
    from tiny_models import bert_wordpiece_tokenizer
    from transformers import AlbertConfig, BertConfig

    from storyrl.models.coherence import CoherenceModel
    from storyrl.models.vrank import VrankModel
    from storyrl.rewards import create_reward
    from storyrl.rewards.coherence import sentence_pairs
    from storyrl.text import split_sentences

    n = 12 if ctx.tiny else 200
    precision = "fp16" if ctx.cuda else "fp32"
    stories = synthetic_stories(n, seed=2)
    others = synthetic_stories(n, seed=3)
    tmp = ctx.root / "pairs"
    rows = []
    with row(section, "RoViST-C"):
        ctx.budget.check(20 if ctx.tiny else 90, "RoViST-C")
        free_memory()
        tokenizer = coherence_bench.build_tokenizer(stories)
        torch.manual_seed(0)
        config = AlbertConfig(vocab_size=len(tokenizer), **(TINY_ALBERT if ctx.tiny else ALBERT_LARGE))
        CoherenceModel.from_config(config).save_pretrained(tmp / "coherence", tokenizer)
        reward = create_reward("coherence", model=str(tmp / "coherence"), device=ctx.device, precision=precision,
                               batch_size=64)
        reward.score(stories[:2])  # load, warm up
        tok = reward._loaded()[1]
        pairs = [p for s in stories for p in sentence_pairs(split_sentences(s)) if p[0].strip() != p[1].strip()]
        _reset_peak(ctx.device)
        batched_s, batched = timed(reward.pair_probabilities, ctx.device, pairs)
        tok.truncation_side = "left"  # keep the end of the prefix, as storyrl does
        single_s, single = timed(_one_pair_per_forward, ctx.device, reward._loaded(), pairs, "coherence")
        speedup = single_s / batched_s
        rows.append({"model": "RoViST-C (ALBERT-large)" + (" (tiny)" if ctx.tiny else ""), "pairs": len(pairs),
                     "one per forward (pairs/s)": len(pairs) / single_s, "batched (pairs/s)": len(pairs) / batched_s,
                     "speed-up": speedup, "max abs diff": float(np.max(np.abs(single - batched))),
                     f"target >= {COHERENCE_TARGET:g}x": "PASS" if speedup >= COHERENCE_TARGET else "FAIL",
                     "peak GiB": _peak_gib(ctx.device)})
        del reward
    with row(section, "Vrank"):
        ctx.budget.check(20 if ctx.tiny else 90, "Vrank")
        free_memory()
        tokenizer = bert_wordpiece_tokenizer(stories + others, tmp / "bert_vocab")
        torch.manual_seed(0)
        config = BertConfig(vocab_size=len(tokenizer), **(TINY_BERT if ctx.tiny else BERT_LARGE))
        VrankModel.from_config(config).save_pretrained(tmp / "vrank", tokenizer)
        reward = create_reward("vrank", model=str(tmp / "vrank"), device=ctx.device, precision=precision,
                               batch_size=32)
        reward.compare(stories[:2], others[:2])  # load, warm up
        _reset_peak(ctx.device)
        batched_s, batched = timed(reward.compare, ctx.device, stories, others)
        single_s, single = timed(_one_pair_per_forward, ctx.device, reward._loaded(), list(zip(stories, others)),
                                 "vrank")
        rows.append({"model": "Vrank (BERT-large)" + (" (tiny)" if ctx.tiny else ""), "pairs": n,
                     "one per forward (pairs/s)": n / single_s, "batched (pairs/s)": n / batched_s,
                     "speed-up": single_s / batched_s, "max abs diff": float(np.max(np.abs(single - batched))),
                     f"target >= {COHERENCE_TARGET:g}x": "—", "peak GiB": _peak_gib(ctx.device)})
        del reward
    section.table(rows)
    section.note(f"{precision}; synthetic 5-sentence stories, word-level tokenizers built here; 'max abs diff': "
                 f"batched vs one-per-forward probabilities (RoViST-C) or Vrank predictions; the >= "
                 f"{COHERENCE_TARGET:g}x target is RoViST-C's on a GPU.")


# -- part: rl -----------------------------------------------------------------------------------

MISTRAL_CHAT_TEMPLATE = (
    "{% for m in messages %}[INST] {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %} [/INST]{% endfor %}"
)


def readme_estimates() -> dict[str, str]:
    """The 7B memory estimates of benchmarks/README.md's table (last column),
    by model: ``llava`` (LLaVA-NeXT-7B fp16 inference) and ``llama`` (LLaMA-2-7B
    4-bit + LoRA, TAPM training at batch 2)."""
    found = {}
    readme = BENCH / "README.md"
    if not readme.is_file():
        return found
    for line in readme.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or "GiB" not in cells[-1]:
            continue
        if cells[0].startswith("LLaVA-NeXT-7B") and "llava" not in found:
            found["llava"] = cells[-1]
        elif "LLaMA-2-7B" in cells[0] and "4-bit" in cells[0] and "llama" not in found:
            found["llama"] = cells[-1]
    return found


@contextmanager
def rl_options(extra: dict):
    """Let benchmarks/rl_step.py's ``rl_config`` build RLConfigs with
    ``extra`` keys too (policy kind, LoRA, 4-bit; ``ppo``/``grpo`` keys merged),
    without changing rl_step.py."""
    from storyrl.training.rl.config import RLConfig

    raw = vars(RLConfig).get("from_mapping")  # None: inherited
    original = RLConfig.from_mapping

    def from_mapping(cls, mapping, *a, **kw):
        if cls is RLConfig:
            mapping = dict(mapping)
            for key, value in extra.items():
                if isinstance(value, dict) and isinstance(mapping.get(key), dict):
                    mapping[key] = {**mapping[key], **value}
                elif isinstance(value, dict) and key in ("ppo", "grpo") and key not in mapping:
                    continue  # the other algorithm's keys
                else:
                    mapping[key] = value
        return original.__func__(cls, mapping, *a, **kw)

    RLConfig.from_mapping = classmethod(from_mapping)
    try:
        yield
    finally:
        if raw is not None:
            RLConfig.from_mapping = raw
        else:
            del RLConfig.from_mapping


def _build_llama_7b(directory: Path, texts: list[str], device: str) -> str:
    """LLaMA-2-7B's architecture, random fp16 weights made on the GPU, with a
    word-level chat tokenizer padded with filler words to 32,000 entries."""
    import torch
    from tiny_models import chat_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    base = len(chat_tokenizer(texts))
    tokenizer = chat_tokenizer([*texts, " ".join(f"w{i}" for i in range(32000 - base))])
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **LLAMA2_7B)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    free_memory()
    return str(directory)


def _build_llava(directory: Path, texts: list[str], ctx: Context) -> str:
    import generate as gen
    from tiny_models import LLAVA_CHAT_TEMPLATE, save_tiny_chat_vlm
    from transformers import AutoProcessor

    if ctx.tiny:
        return save_tiny_chat_vlm(directory, texts)
    gen.build_model("7b", directory, ctx.device)
    processor = AutoProcessor.from_pretrained(directory)
    processor.chat_template = MISTRAL_CHAT_TEMPLATE if "[INST]" in processor.tokenizer.get_vocab() \
        else LLAVA_CHAT_TEMPLATE
    processor.save_pretrained(directory)
    free_memory()
    return str(directory)


def part_rl(ctx: Context, section: Section) -> None:
    try:
        rl_step = importlib.import_module("rl_step")
        runners = {"ppo": rl_step.run_ppo, "grpo": rl_step.run_grpo}
        build_assets, summarise, peak = rl_step.build_assets, rl_step.summarise, rl_step._peak_mib
    except (ImportError, AttributeError) as exc:
        raise Skip(f"benchmarks/rl_step.py's runners are not importable ({_one_line(exc)})") from None
    with _hidden_gpus(ctx.device == "cpu"):  # accelerate (PPO) would take a visible GPU
        _part_rl(ctx, section, rl_step, runners, build_assets, summarise, peak)


@contextmanager
def _hidden_gpus(hide: bool):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _rl_row(model: str, algorithm: str, result, run_s: float, summarise, peak_mib, estimate) -> dict:
    """A report row from one of rl_step.py's runners' results: (steps, reward
    calls[, seconds preparing the rewards])."""
    s = summarise(algorithm, result[0], result[1], peak_mib)
    share = s["share"]
    peak_mib = s.get("peak_cuda_mib")
    return {"model": model, "algorithm": algorithm.upper(), "step (s)": s["mean_s"]["step"],
            **{phase: f"{100 * share[phase]:.0f} %" for phase in ("generation", "forward", "reward", "optimisation")},
            "run (s)": run_s, "rewards prepared (s)": result[2] if len(result) > 2 else None,
            "peak GiB": None if peak_mib is None else peak_mib / 1024,
            "README estimate": estimate or "not found in benchmarks/README.md"}


def _part_rl(ctx: Context, section: Section, rl_step, runners, build_assets, summarise, peak) -> None:
    steps, warmup = (1, 0) if ctx.tiny else (2, 1)
    batch, generations = (4, 2) if ctx.tiny else (8, 4)
    # rl_step's own parser: its defaults for whatever options it has grown (NP extraction, ...)
    args = rl_step.parse_args(["--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch),
                               "--generations", str(generations), "--max-new-tokens", "16" if ctx.tiny else "64",
                               "--ppo-epochs", "1" if ctx.tiny else "4", "--sft-steps", "20" if ctx.tiny else "1",
                               "--device", ctx.device, "--reward", "dhm",
                               # --tiny: the cheap regex NPs (the spaCy-shaped default costs seconds to set up)
                               *(["--noun-phrases", "regex"] if ctx.tiny and "regex" in getattr(
                                   rl_step, "NP_EXTRACTORS", ()) else [])])
    # rewards prepared before training (the image side embedded once) where rl_step.py can do it
    prepare = {"prepare": True} if "prepare" in inspect.signature(runners["ppo"]).parameters else {}
    tmp = ctx.root / "rl"
    t0 = time.perf_counter()
    assets = build_assets(tmp, args)
    vocabulary = " ".join([*rl_step.DETS, *rl_step.ADJS, *rl_step.NOUNS, *rl_step.VERBS, *rl_step.INTRANSITIVE,
                           *rl_step.PREPS, "we it was day then . [INST] [/INST]"])
    prompt = rl_step._prompt_text(rl_step.IMAGES_PER_SEQUENCE)
    section.note(f"data and reward models (the dhm reward's tiny CLIP and ALBERT of rl_step.py; its NP extractor "
                 f"{getattr(args, 'noun_phrases', 'regex')}) built in {time.perf_counter() - t0:.1f} s; "
                 f"{'the LLaMA policy: rl_step.py tiny one, fitted to write sentences; ' if ctx.tiny else ''}"
                 f"{batch} stories per step, "
                 f"{warmup} warm-up + {steps} timed step(s), {args.max_new_tokens} new tokens")
    estimates = readme_estimates()
    gc_on = not ctx.tiny  # 7B with LoRA: activations recomputed, as the shipped configs do
    models = [
        ("LLaVA-NeXT-7B + LoRA", "llava", {"policy": "vlm", "setting": "visual", "freeze_vision_tower": True,
                                           "lora": {"enabled": True, "r": 16, "alpha": 32}}),
        ("LLaMA-2-7B 4-bit + LoRA", "llama", {"policy": "causal_lm", "setting": "text", "load_in_4bit": True,
                                              "lora": {"enabled": True, "r": 16, "alpha": 32}}),
    ]
    rows = []
    for label, key, extra in models:
        with row(section, label):
            ctx.budget.check(40 if ctx.tiny else 420, f"rl {label}")  # 7B: build, save, PPO and GRPO
            if extra.get("load_in_4bit"):
                if not ctx.cuda:
                    extra = {k: v for k, v in extra.items() if k != "load_in_4bit"}
                    section.skip(f"{label}, its 4-bit base", "no CUDA device (bitsandbytes needs one); ran LoRA on the "
                                 "full-precision base instead")
                    label = label.replace(" 4-bit", "")
                else:
                    need("bitsandbytes", "4-bit loading: pip install 'storyrl[quant]'")
            if key == "llava":
                policy = _build_llava(tmp / "llava", [prompt, vocabulary, *synthetic_stories(4)], ctx)
            elif ctx.tiny:
                policy = assets["policy"]  # rl_step's tiny LLaMA, fitted to write sentences
            else:
                policy = _build_llama_7b(tmp / "llama", [prompt, vocabulary], ctx.device)
            extra = {**extra, "ppo": {"gradient_checkpointing": gc_on},
                     "grpo": {"gradient_checkpointing": gc_on}}
            for algorithm in ("ppo", "grpo"):
                free_memory()
                with row(section, f"{label}, {algorithm.upper()}"):  # an OOM in PPO still lets GRPO run
                    ctx.budget.check(15 if ctx.tiny else 150, f"rl {label} {algorithm}")
                    with rl_options(extra):
                        t1 = time.perf_counter()
                        run_assets = {**assets, "policy": policy,
                                      "rewards": {"dhm": [*assets["rewards"]["dhm"], "bleu"]}}
                        result = runners[algorithm](run_assets, args, "dhm", tmp / f"{key}_{algorithm}", **prepare)
                        run_s = time.perf_counter() - t1
                    rows.append(_rl_row(label + (" (tiny)" if ctx.tiny else ""), algorithm, result, run_s,
                                        summarise, peak(ctx.device), estimates.get(key)))
            if not ctx.tiny:
                shutil.rmtree(Path(policy), ignore_errors=True)  # ~15 GB of disk
    section.table(rows)
    section.note("rewards prepared: the image side of the data set embedded (and the human stories scored) "
                 "before training by RLConfig prepare_rewards, untimed in the steps (— where rl_step.py cannot).")
    section.note("time split: rl_step.py's phases (generation, no-grad forwards, the dhm reward, the rest = "
                 "optimisation) as shares of the mean timed step; peak = torch.cuda.max_memory_allocated over the "
                 "run. README estimate: benchmarks/README.md's table of 7B memory estimates, its LLaVA-NeXT-7B fp16 "
                 "inference row and its LLaMA-2-7B 4-bit + LoRA (TAPM training, batch 2) row: not for RL: they are a floor to compare with, not the same workload. The 7B policies are "
                 "random (not fitted), so most of their stories are unscorable word soup: `bleu` (model-free, against the "
                 "human story) is added next to `dhm` so that every step has a finite reward (storyrl stops a run "
                 "whose rewards score nothing); its cost counts in the reward share, and `dhm` does less work on "
                 "one-sentence soup (no coherence pairs) than on a trained policy's stories.")


# -- part: deepspeed ----------------------------------------------------------------------------


def launch_rl_steps(tmp: Path, launch_options: list[str], steps: int = 3, timeout: float = 600):
    """``storyrl launch OPTIONS -- storyrl train rl`` in a subprocess: ``steps``
    PPO steps of a tiny LLaMA on 8 synthetic sequences, scored by ``bleu``.
    Returns (exit status, last lines of its output, seconds, history rows)."""
    import yaml
    from tiny_models import save_tiny_llama

    paths = write_sequence_images(tmp / "images", 8, (64, 48))
    stories = synthetic_stories(8)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": p}) + "\n"
                            for k, (s, p) in enumerate(zip(stories, paths))))
    policy = save_tiny_llama(tmp / "policy", [*stories, "write a story of five sentences ."])
    config = {"algorithm": "ppo", "output_dir": str(tmp / "run"), "model": policy, "data": str(data),
              "setting": "text", "rewards": ["bleu"], "max_steps": steps, "report_to": "none",
              "ppo": {"per_device_train_batch_size": 4, "response_length": 16, "num_ppo_epochs": 1,
                      "save_steps": None, "logging_steps": 1}}
    (tmp / "rl.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "storyrl", "launch", *launch_options,
               "--", "storyrl", "train", "rl", "--config", str(tmp / "rl.yaml")]
    t0 = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - t0
    history = tmp / "run" / "history.jsonl"
    logged = [json.loads(x) for x in history.read_text().splitlines() if x.strip()] if history.is_file() else []
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-400:]
    return done.returncode, tail, seconds, logged


def part_deepspeed(ctx: Context, section: Section) -> None:
    need("deepspeed", "pip install deepspeed")
    ctx.need_cuda("DeepSpeed ZeRO-2")
    ctx.budget.check(180, "deepspeed")
    zero2 = REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"
    try:
        status, tail, seconds, logged = launch_rl_steps(
            ctx.root / "deepspeed", ["--config_file", str(zero2), "--num_processes", "1"],
            timeout=max(60, ctx.budget.left()))
    except subprocess.TimeoutExpired:
        raise Skip("time budget: storyrl launch did not finish in the time left") from None
    if status != 0:
        raise RuntimeError(f"storyrl launch exited {status}: {tail}")
    step_s = [h["time/step"] for h in logged if "time/step" in h]
    section.table([{"config": "configs/accelerate/deepspeed_zero2.yaml (--num_processes 1)",
                    "policy": "tiny LLaMA (hidden 32, 2 layers)", "reward": "bleu", "steps logged": len(logged),
                    "mean step (s)": sum(step_s) / len(step_s) if step_s else None, "run incl. start (s)": seconds}])
    section.note("`storyrl launch ... -- storyrl train rl` in a subprocess: checks that ZeRO-2 through the shipped "
                 "accelerate config trains end to end on one GPU, not its speed.")


# -- driver -------------------------------------------------------------------------------------

# key -> (title, runner, estimated seconds at full size on a GPU, estimated seconds with --tiny)
PARTS = {
    "arch": ("Architectures at full size (parameter counts)", part_arch, 30, 15),
    "generate": ("1. `storyrl generate`: batched vs one at a time (fp16, 4-bit, vLLM)", part_generate, 600, 25),
    "clip": ("2. GROOViST / CLIPScore (and ResNet-50 v2) throughput", part_clip, 180, 15),
    "pairs": ("3. RoViST-C and Vrank pairs/s, batched vs one pair per forward", part_pairs, 180, 10),
    "rl": ("4. PPO and GRPO steps with LoRA (and 4-bit), dhm reward", part_rl, 900, 60),
    "deepspeed": ("5. DeepSpeed ZeRO-2 through the shipped accelerate config", part_deepspeed, 180, 1),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the Markdown report (default {DEFAULT_OUT})")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--tiny", action="store_true", help="shrunk architectures; what can run runs on the CPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)} (default all)")
    p.add_argument("--budget-minutes", type=float, default=40.0, help="parts that would not fit are skipped (40)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when available (default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown or not parts:
        p.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    args.parts = [k for k in PARTS if k in parts]
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
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = Budget(args.budget_minutes)
    sections = []
    with tempfile.TemporaryDirectory(prefix="storyrl_gpu_suite_") as root:
        for key in args.parts:
            title, runner, full_s, tiny_s = PARTS[key]
            section = Section(key, title)
            sections.append(section)
            estimate = tiny_s if args.tiny else full_s
            print(f"[gpu_suite] {key}: starting (estimate {estimate / 60:.1f} min, {budget.left() / 60:.1f} left)",
                  file=sys.stderr)
            t0 = time.perf_counter()
            try:
                budget.check(estimate, f"estimate of part {key}")
                (Path(root) / key).mkdir()
                runner(Context(args.tiny, device, budget, Path(root)), section)
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


def render(args, device: str, sections: list[Section], budget: Budget, running: bool = False) -> str:
    lines = ["# storyrl GPU validation suite", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
             f"- command: `{' '.join(['python benchmarks/gpu_suite.py', *args.argv])}`",
             f"- device: {device_line(device)}",
             f"- mode: {'--tiny (shrunk architectures)' if args.tiny else 'full-size architectures'}, random weights",
             f"- python {platform.python_version()}; {_versions()}",
             f"- budget: {args.budget_minutes:g} min; used {(budget.total - budget.left()) / 60:.1f} min",
             *([f"- INCOMPLETE: {len(sections)} of {len(args.parts)} parts done, still running"] if running else []),
             "",
             "## Summary", "", "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {s.key} | {s.status} | {s.seconds:.1f} |" for s in sections]
    for s in sections:
        lines += ["", f"## {s.title} (`{s.key}`)", "", *s.lines, "", f"- time: {s.seconds:.1f} s"]
    return "\n".join(re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).splitlines()) + "\n"


if __name__ == "__main__":
    sys.exit(main())
