"""The parts of benchmarks/gpu_suite.py that measure inference: arch,
generate, clip and pairs, and the synthetic data they run on."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from gpu_suite_arch import (
    ALBERT_LARGE,
    BERT_LARGE,
    EXPECTED_PARAMETERS,
    TINY_ALBERT,
    TINY_BERT,
    _open_clip_cfg,
    architectures,
    count_parameters,
    resnetv2,
)
from gpu_suite_report import (
    QUICK_CLIP_IMAGES,
    QUICK_GEN_TOKENS,
    Context,
    Section,
    Skip,
    _peak_gib,
    _reset_peak,
    free_memory,
    need,
    row,
    shared_models_dtype,
    timed,
    weights_dtype,
)

COHERENCE_TARGET = 5.0

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


def llava_7b(ctx: Context) -> str:
    """The 7B LLaVA-NeXT (random fp16 weights, built on the GPU and saved,
    ~15 GB) in the run's shared folder: built by the first part that needs
    it (rl or generate), reused by the other."""
    import generate as gen

    if "llava_7b" not in ctx.shared:
        t0 = time.perf_counter()
        ctx.shared["llava_7b"] = gen.build_model("7b", ctx.root / "shared_llava_7b", ctx.device)
        ctx.shared["llava_7b_build_s"] = time.perf_counter() - t0
    return ctx.shared["llava_7b"]


def generate_variants(precision: str) -> list[tuple[str, str, bool]]:
    """The generate part's rows, ``(label, precision, 4-bit)``: the
    --precision variant, then 4-bit NF4 (CUDA only) computing in it, in fp16
    when that is fp32 (NF4 is a half-precision recipe; an fp32 compute dtype
    would not be the 4-bit figure users compare with)."""
    return [(precision, precision, False), ("4-bit NF4", "fp16" if precision == "fp32" else precision, True)]


def part_generate(ctx: Context, section: Section) -> None:
    import generate as gen
    import torch

    from storyrl.models.vlm import load_vlm

    shape = "tiny" if ctx.tiny else "7b"
    if shape == "7b":
        ctx.need_cuda("the 7B LLaVA-NeXT")
    n_stories, batch, max_new = ctx.pick((3, 3, 6), (2, 2, QUICK_GEN_TOKENS), (8, 8, 32))
    settings = ["visual", "prev_sentence"]
    tmp = ctx.root / "generate"
    (tmp / "images").mkdir(parents=True)
    t0 = time.perf_counter()
    if shape == "tiny":
        model_dir = gen.build_model(shape, tmp / "model", "cpu")
        built = f"built and saved in {time.perf_counter() - t0:.1f} s"
    else:
        reused = "llava_7b" in ctx.shared
        if not reused:
            ctx.check("generate build", 0, 0, "building the 7B LLaVA-NeXT")
        model_dir = llava_7b(ctx)
        built = (f"built and saved in {ctx.shared['llava_7b_build_s']:.1f} s"
                 + (" (by the rl part; reused here)" if reused else ""))
    section.note(f"model: LLaVA-NeXT {'(tiny)' if ctx.tiny else '7B (Mistral-7B + CLIP ViT-L/14-336)'}, random "
                 f"weights, {built}; {n_stories} stories x 5 images, "
                 f"batch {batch}, {max_new} new tokens per call, greedy, prompt P3")
    sizes = gen.SHAPES[shape]
    records = gen.write_data(tmp / "images", n_stories, sizes["images"])
    warm = tmp / "images" / "warm.jsonl"
    warm.write_text(records.read_text().splitlines()[0] + "\n")
    variants = generate_variants(ctx.dtype_name)
    rows, fp16_rows = [], []
    for label, precision, four_bit in variants:
        vlm = authors = None  # drop the previous variant's model (also after an out-of-memory error)
        with row(section, label):
            if four_bit:
                ctx.need_cuda(f"{label} generation")
                need("bitsandbytes", "4-bit loading: pip install 'storyrl[quant]'")
            ctx.check("generate 4-bit" if four_bit else "generate fp16", 150, 60, f"generate {label}")
            free_memory()
            vlm = load_vlm(model_dir, None, ctx.device, precision, four_bit)
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
            authors = gen.Authors(model_dir, vlm.model, vlm.device, dtype, max_new, "P3",
                                  sizes["sequence_image_size"])
            opts = {"precision": precision, "load_in_4bit": four_bit, "batch_size": batch, "max_new_tokens": max_new,
                        "sequence_image_size": sizes["sequence_image_size"]}
            lines = [json.loads(x) for x in records.read_text().splitlines() if x.strip()]
            for i, setting in enumerate(settings):
                # first-call costs; --quick warms up once per model (the visual setting) to save calls
                if i == 0 or not ctx.quick:
                    _generate_storyrl(ctx, model_dir, setting, warm, tmp / "warm.json", **opts)
                    authors.story(setting, lines[0]["images"])
                _reset_peak(ctx.device)
                a_s, a_stories = timed(_authors_all, ctx.device, authors, setting, lines)
                a_peak = _peak_gib(ctx.device)
                _reset_peak(ctx.device)
                out = tmp / f"{label}_{setting}.json"
                s_s, s_stories = _generate_storyrl(ctx, model_dir, setting, records, out, **opts)
                s_peak = _peak_gib(ctx.device)
                differ = sum(s_stories.get(k) != v for k, v in a_stories.items())
                r = {"precision": label, "weights": weights_dtype(vlm.model), "setting": setting, "stories": n_stories,
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
        ctx.check("vllm", 240, 240, "vLLM engine start and generation")
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


def _first_visits(ctx, reward_name: str, options: dict, stories, story_images, warm_images):
    """``{pipeline: (seconds, scores)}`` of a first visit (models and caches
    released before each, so neither pipeline finds the other's texts
    embedded; two stories on the ``warm_images`` sequences first, so that
    kernels, threads and decode workers have started) and the fast reward,
    for the revisit."""
    from storyrl.models.runtime import release_models
    from storyrl.rewards import create_reward
    from storyrl.text import clear_caches
    from tiny_models import KeywordPhrases

    visits, reward = {}, None
    for pipeline in ("exact", "fast"):
        reward = None
        release_models()
        free_memory()
        clear_caches()
        reward = create_reward(reward_name, **options, image_pipeline=pipeline)
        if reward_name == "groovist":
            reward._extractor = KeywordPhrases(WORDS)  # no spaCy pipeline offline
        reward.setup()
        reward.score(stories[:2], images=warm_images)
        _reset_peak(ctx.device)
        visits[pipeline] = timed(reward.score, ctx.device, stories, images=story_images)
    return visits, reward


def part_clip(ctx: Context, section: Section) -> None:
    import image_pipelines
    import numpy as np

    sequences, candidates = ctx.pick((2, 2), (QUICK_CLIP_IMAGES // 5, 4), (16, 8))
    tmp = ctx.root / "clip"
    # Photo-like JPEGs of VIST's sizes (500x375 to 1024x768): decoding is a large share of the work.
    sizes = [(64, 48), (48, 64)] if ctx.tiny else None
    photos = image_pipelines.write_photos(tmp / "images", sequences * 5, sizes=sizes)
    images = [photos[k:k + 5] for k in range(0, len(photos), 5)]
    warm_photos = image_pipelines.write_photos(tmp / "warm", 10, seed=1, sizes=sizes)
    warm_photos = [warm_photos[:5], warm_photos[5:]]  # 10 files: enough for the decode workers to start
    stories = synthetic_stories(sequences * candidates, seed=1)
    story_images = [images[i // candidates] for i in range(len(stories))]
    pronouns = tmp / "pronouns.txt"
    pronouns.write_text("it\nwe\nthey\nhe\nshe\n")
    precision = ctx.dtype_name
    rows = []
    for name in ("ViT-B-32", "ViT-L-14"):
        with row(section, f"CLIP {name}"):
            ctx.check("clip", 60, 20, f"CLIP {name}")
            clip = _save_clip(tmp / name, _open_clip_cfg(name, ctx.tiny))
            for reward_name in ("groovist", "clipscore"):
                options = {"clip_model": clip, "clip_pretrained": None, "device": ctx.device, "precision": precision}
                if reward_name == "groovist":
                    options.update(regions="grid", weighting="none", pronouns=str(pronouns))
                visits, reward = _first_visits(ctx, reward_name, options, stories, story_images, warm_photos)
                (exact_s, exact), (cold_s, cold) = visits["exact"], visits["fast"]
                peak = _peak_gib(ctx.device)
                warm_s, warm = timed(reward.score, ctx.device, stories, images=story_images)
                weights = shared_models_dtype()
                n_images = sequences * 5
                regions = n_images * (reward.grid ** 2 + 1) if reward_name == "groovist" else n_images
                same = np.allclose(cold, warm, atol=1e-5, equal_nan=True)
                rows.append({"reward": reward_name, "CLIP": name + (" (tiny)" if ctx.tiny else ""),
                             "precision": precision,
                             "weights": weights,
                             "stories": len(stories), "images": n_images, "crops encoded": regions,
                             "exact images/s (first visit)": n_images / exact_s,
                             "fast images/s (first visit)": n_images / cold_s,
                             "exact crops/s": regions / exact_s, "fast crops/s": regions / cold_s,
                             "fast speed-up": exact_s / cold_s,
                             "fast stories/s (first visit)": len(stories) / cold_s,
                             "stories/s (revisit)": len(stories) / warm_s,
                             "first = revisit scores": bool(same),
                             "max fast-exact score diff": float(np.nanmax(np.abs(np.asarray(cold) - exact))),
                             "peak GiB": peak})
    section.table(rows)
    section.note("first visit: every image (GROOViST: its 3x3 grid + whole-image regions) is embedded inside the "
                 "call, models and caches released before each pipeline's; exact = PIL decoding and the model's "
                 "transform per region (the authors' scores), fast = the default: decoding in worker processes, "
                 "resizing and normalising on the device; revisit: the fast calls again with the caches warm (text "
                 "work only); the score diff is between the two first visits. Photo-like JPEGs of VIST's sizes; "
                 "noun phrases from a keyword stand-in (no spaCy pipeline offline); GROOViST unweighted.")
    with row(section, "ResNet-50 v2"):
        import torch

        need("timm", "pip install timm")
        free_memory()
        model = resnetv2(ctx.tiny).eval().to(ctx.device)
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        model = model.to(dtype)
        batch, size = (4, 64) if ctx.tiny else (64, 224)
        x = torch.randn(batch, 3, size, size, device=ctx.device, dtype=dtype)
        with torch.inference_mode():
            model(x)
            _reset_peak(ctx.device)
            reps = ctx.pick(2, 3, 10)
            seconds, _ = timed(_repeat, ctx.device, model, x, reps)
        section.table([{"model": "ResNet-50 v2 (timm resnetv2_50)" + (" (tiny)" if ctx.tiny else ""),
                        "batch": batch, "pixels": size, "precision": precision, "weights": weights_dtype(model),
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


ALBERT_VOCAB, BERT_VOCAB = 30000, 30522  # albert-large-v2's and bert-large-uncased's (SimCSE's) vocabularies


def rovist_tokenizer(texts: list[str], tiny: bool):
    """benchmarks/coherence.py's word-level ALBERT tokenizer over ``texts``;
    at full size filled up to ALBERT's 30,000 entries, so that the embedding
    table is the real model's."""
    import coherence as coherence_bench
    import generate as gen

    tokenizer = coherence_bench.build_tokenizer(texts)
    return tokenizer if tiny else gen.sized_tokenizer(tokenizer, ALBERT_VOCAB)


def vrank_tokenizer(texts: list[str], directory: Path, tiny: bool):
    """The tests' BERT WordPiece tokenizer over ``texts``; at full size filled
    up to BERT's 30,522 entries."""
    import generate as gen
    from tiny_models import bert_wordpiece_tokenizer

    tokenizer = bert_wordpiece_tokenizer(texts, directory)
    return tokenizer if tiny else gen.sized_tokenizer(tokenizer, BERT_VOCAB)


def part_pairs(ctx: Context, section: Section) -> None:
    import numpy as np
    import torch
    from transformers import AlbertConfig, BertConfig

    from storyrl.models.coherence import CoherenceModel
    from storyrl.models.vrank import VrankModel
    from storyrl.rewards import create_reward
    from storyrl.rewards.coherence import sentence_pairs
    from storyrl.text import split_sentences

    n = ctx.pick(12, 50, 200)  # stories (RoViST-C: ~4 sentence pairs each)
    precision = ctx.dtype_name
    stories = synthetic_stories(n, seed=2)
    others = synthetic_stories(n, seed=3)
    tmp = ctx.root / "pairs"
    rows = []
    with row(section, "RoViST-C"):
        ctx.check("coherence", 90, 20, "RoViST-C")
        free_memory()
        tokenizer = rovist_tokenizer(stories, ctx.tiny)
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
        rows.append({"model": "RoViST-C (ALBERT-large)" + (" (tiny)" if ctx.tiny else ""),
                     "weights": weights_dtype(reward._loaded()[0]), "pairs": len(pairs),
                     "one per forward (pairs/s)": len(pairs) / single_s, "batched (pairs/s)": len(pairs) / batched_s,
                     "speed-up": speedup, "max abs diff": float(np.max(np.abs(single - batched))),
                     f"target >= {COHERENCE_TARGET:g}x": "PASS" if speedup >= COHERENCE_TARGET else "FAIL",
                     "peak GiB": _peak_gib(ctx.device)})
        del reward
    with row(section, "Vrank"):
        ctx.check("vrank", 90, 20, "Vrank")
        free_memory()
        tokenizer = vrank_tokenizer(stories + others, tmp / "bert_vocab", ctx.tiny)
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
        rows.append({"model": "Vrank (BERT-large)" + (" (tiny)" if ctx.tiny else ""),
                     "weights": weights_dtype(reward._loaded()[0]), "pairs": n,
                     "one per forward (pairs/s)": n / single_s, "batched (pairs/s)": n / batched_s,
                     "speed-up": single_s / batched_s, "max abs diff": float(np.max(np.abs(single - batched))),
                     f"target >= {COHERENCE_TARGET:g}x": "—", "peak GiB": _peak_gib(ctx.device)})
        del reward
    section.table(rows)
    section.note(f"{precision}; synthetic 5-sentence stories, word-level tokenizers built here; 'max abs diff': "
                 f"batched vs one-per-forward probabilities (RoViST-C) or Vrank predictions; the >= "
                 f"{COHERENCE_TARGET:g}x target is RoViST-C's on a GPU.")
