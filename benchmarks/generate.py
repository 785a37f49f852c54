"""Benchmark: zero-shot story generation, storyrl's batched ``storyrl
generate`` path vs the authors' way (one story at a time, one call per image
for the linguistic settings), same model, same images, same run.

What is timed
-------------
For each setting (``visual``, ``prev_sentence``, ``all_sentences``,
``no_context``), stories per second over ``--stories`` stories of 5 images:

(a) storyrl: what ``storyrl generate --model DIR --setting S --data D --out
    OUT`` runs, in process: ``load_records(D)`` (the JSONL records with image
    paths), ``create_generator("prompting", ...)`` and
    ``storyrl.generators.runs.generate_to_file`` (batches of
    ``--batch-size`` stories, left padding; for the sentence settings one
    call per image position across the batch; the story file and its sidecar
    rewritten after every batch). The model is already loaded (storyrl keeps
    one shared instance per process); loading is timed once, separately.
(b) the authors' way, written out here with transformers: for each story,
    build the sequence image by hand (images resized, 2-px white frame, side
    by side) or take each image, then ``processor(images=[img],
    text=[prompt])`` → ``model.generate`` (greedy) → decode the whole
    sequence skipping special tokens → the text after the last ``[/INST]``,
    é/ê → e, blank lines → space; the sentence settings join their outputs as
    the authors did (split on '.', strip quotes, ' . ', final ' .'). The
    prompt templates come from storyrl's prompts file (their text is checked
    against the reference notes by tests/test_prompting.py); the wrapping and
    the filling are done here. Same model object, its own processor loaded
    from the same directory.

Both are timed with ``time.perf_counter`` after an untimed warm-up story
each (``torch.cuda.synchronize`` around them on CUDA), ``--repeats`` times
alternating, and the best time of each way is kept; peak CUDA memory
(``torch.cuda.max_memory_allocated``) is recorded per way on a GPU. The stories must be
identical (greedy): exit status 1 otherwise. PASS/FAIL against the target
(storyrl ≥ 4× the authors' way on CPU, over all settings timed) is printed
only.

Models
------
Random weights (hubs are unreachable), built here from configs and saved
with their processor, so storyrl loads them the way it loads
``llava-hf/llava-v1.6-mistral-7b-hf``: LLaVA-NeXT with a Mistral decoder and
a CLIP vision tower, ``--shape``:

* ``tiny``: the tests' model (tests/tiny_models.py ``save_tiny_vlm``:
  decoder hidden 32 × 1 layer, vision 16 × 1 layer, 32-px tiles).
* ``small``: decoder hidden 256 × 4 layers (4 heads, 2 KV heads, MLP 1024,
  vocabulary 8,192), vision hidden 128 × 4 layers (64-px tiles, patch 16).
* ``7b``: the LLaVA-NeXT-7B architecture (Mistral-7B: hidden 4096, 32
  layers, 32 heads, 8 KV heads, MLP 14336, vocabulary 32,064; CLIP
  ViT-L/14-336; the model's anyres grid), for a GPU
  (``--device cuda --precision fp16``), with VIST-like 500×375 images and
  256×256 sequence tiles as the authors used. ``--vllm`` also times storyrl
  with ``backend="vllm"`` (when vLLM imports) after the transformers runs.

The vocabulary is word-level (the prompts' words plus filler words to the
shape's size), so token counts differ somewhat from Mistral's SentencePiece.

``--memory-estimate`` prints, without running anything, the GPU memory the
paper's configurations need, from parameter counts of the real-shaped models
built on the meta device (an estimate by arithmetic, not a measurement).

Exit status: 0, 1 (stories differ), 2 (missing data/packages).

Usage::

    python benchmarks/generate.py [--shape tiny|small|7b] [--setting visual|prev_sentence|all_sentences|no_context|all]
        [--stories 32] [--batch-size 8] [--max-new-tokens 32] [--repeats 2] [--device cpu|cuda]
        [--precision fp32|fp16|bf16]
        [--threads 1] [--vllm] [--json OUT] [--memory-estimate]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tiny_models: vlm_tokenizer, save_tiny_vlm

import storyrl  # noqa: E402,F401  (before transformers: CPU torchvision fallback)

TARGET = 4.0
SETTINGS = ("visual", "prev_sentence", "all_sentences", "no_context")
PROMPTS_FILE = REPO / "configs" / "prompts" / "dhm.yaml"
EXTRA_WORDS = "[INST] [/INST] <s> The dog ran home . A cat sat . \"quoted\" five four three two"

# Per shape: text (Mistral) and vision (CLIP) configs, vocabulary size, tile
# size and anyres grid (height, width), image sizes (width, height) and the
# sequence-image tile size ("WxH", None: as the tests' tiny model).
SHAPES = {
    "tiny": dict(images=(32, 32), sequence_image_size="12x12"),
    "small": dict(
        text=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024, max_position_embeddings=4096),
        vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    image_size=64, patch_size=16),
        vocab=8192, tile=64, grid=[[64, 128], [128, 64], [128, 128], [192, 64], [64, 192]],
        vision_feature_layer=-2, images=(96, 64), sequence_image_size="28x28",
    ),
    "7b": dict(
        text=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, max_position_embeddings=32768, rope_theta=1e6, sliding_window=None,
                  rms_norm_eps=1e-5),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu"),
        vocab=32064, tile=336, grid=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        vision_feature_layer=-2, images=(500, 375), sequence_image_size="256x256",
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    p.add_argument("--stories", type=int, default=32, help="stories of 5 images (default 32)")
    p.add_argument("--batch-size", type=int, default=8, help="storyrl's stories per call (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per call (default 32; the paper: 500)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each way, alternating; best kept (default 2)")
    p.add_argument("--prompt", default="P3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a busy 2-core machine 2 threads made both ways erratic, "
                        "up to 8x slower; 0 keeps torch's default)")
    p.add_argument("--vllm", action="store_true", help="also time backend='vllm' (CUDA, vLLM installed)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="keep the random model here (default: a temporary directory)")
    p.add_argument("--json", type=Path)
    p.add_argument("--memory-estimate", action="store_true",
                   help="print the paper configurations' GPU memory from parameter counts and exit")
    return p.parse_args(argv)


# -- the model -------------------------------------------------------------------------


def build_model(shape: str, directory: Path, device: str, seed: int = 0) -> str:
    """A random-weight LLaVA-NeXT (Mistral decoder) and its processor saved in
    ``directory``; returns it."""
    from tiny_models import save_tiny_vlm

    vocab_text = [PROMPTS_FILE.read_text(), EXTRA_WORDS]
    if shape == "tiny":
        save_tiny_vlm(directory, "llava_next", vocab_text, seed=seed)
        _no_image_token_outputs(directory)
        return str(directory)
    import torch
    from transformers import (CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor, MistralConfig)

    s = SHAPES[shape]
    tokenizer = _tokenizer(vocab_text, s["vocab"])
    text = MistralConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **s["text"])
    config = LlavaNextConfig(vision_config=CLIPVisionConfig(**s["vision"]), text_config=text,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=s["grid"], vision_feature_layer=s["vision_feature_layer"],
                             vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    big = shape == "7b"
    # 7b: initialised in fp16 on the GPU (fp32 on a CPU would take ~30 GB and minutes).
    dtype = torch.float16 if big else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device if big else "cpu"):
            model = LlavaNextForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    tile = s["tile"]
    images = LlavaNextImageProcessor(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                     image_grid_pinpoints=s["grid"])
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=s["vision"]["patch_size"],
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    del model
    if big:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    _no_image_token_outputs(directory)
    return str(directory)


def _no_image_token_outputs(directory: Path) -> None:
    """A random model may generate ``<image>`` (a trained one does not); fed
    back as context in the sentence settings, it would make the processor
    refuse the prompt (both ways alike). The saved generation config
    suppresses it (and [PAD]/[UNK]) for every ``generate`` call."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(directory)
    try:
        gen = GenerationConfig.from_pretrained(directory)
    except OSError:
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(directory))
    # Words of the vocabulary that contain "<image>" (e.g. "<image>\\n" from the prompts file's comments) too.
    image_words = [i for t, i in tok.get_vocab().items() if "<image>" in t]
    gen.suppress_tokens = sorted({*image_words, *(tok.convert_tokens_to_ids(t) for t in ("[PAD]", "[UNK]"))})
    gen.save_pretrained(directory)


def _tokenizer(texts, size: int):
    """The tests' word-level VLM tokenizer over ``texts`` plus filler words
    ``w0 w1 ...`` so that it has exactly ``size`` entries."""
    from tiny_models import vlm_tokenizer

    return sized_tokenizer(vlm_tokenizer(texts), size)


def sized_tokenizer(tokenizer, size: int):
    """``tokenizer`` (a word-level ``PreTrainedTokenizerFast``) with filler
    words ``w0 w1 ...`` appended to its vocabulary so that it has exactly
    ``size`` entries (a real model's vocabulary, e.g. LLaVA-NeXT-7B's 32,064).

    The words are written into the saved vocabulary rather than trained:
    ``tokenizers``' WordLevelTrainer keeps at most 30,000 words by default,
    which is what made every 7B build fail its size check."""
    import tempfile

    from transformers import AutoTokenizer

    if len(tokenizer) > size:
        raise ValueError(f"the tokenizer already has {len(tokenizer)} entries, more than {size}")
    with tempfile.TemporaryDirectory(prefix="storyrl_vocab_") as tmp:
        tokenizer.save_pretrained(tmp)
        path = Path(tmp) / "tokenizer.json"
        state = json.loads(path.read_text(encoding="utf-8"))
        vocab = state["model"]["vocab"]
        if not isinstance(vocab, dict):
            raise ValueError(f"not a word-level vocabulary: {state['model'].get('type')}")
        taken = {*vocab, *(t["content"] for t in state.get("added_tokens", []))}
        next_id = 1 + max([*vocab.values(), *(t["id"] for t in state.get("added_tokens", []))])
        k = 0
        while next_id < size:
            word = f"w{k}"
            k += 1
            if word not in taken:
                vocab[word] = next_id
                next_id += 1
        path.write_text(json.dumps(state), encoding="utf-8")
        out = AutoTokenizer.from_pretrained(tmp)
    if len(out) != size:
        raise ValueError(f"vocabulary of {len(out)} entries, wanted {size}")
    return out


def write_data(directory: Path, n_stories: int, size: tuple[int, int], seed: int = 0) -> Path:
    """``n_stories`` stories of 5 distinct colour-gradient + noise PNG images
    (``size`` = width, height) and their JSONL records; returns the records."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    x = np.linspace(0, 1, w)[None, :, None]
    y = np.linspace(0, 1, h)[:, None, None]
    lines = []
    for s in range(n_stories):
        paths = []
        for k in range(5):
            base = rng.uniform(0, 255, size=3)
            pixels = base * (0.4 + 0.6 * x) * (0.5 + 0.5 * y) + rng.normal(0, 12, size=(h, w, 3))
            path = directory / f"s{s}_{k}.png"
            Image.fromarray(np.clip(pixels, 0, 255).astype("uint8")).save(path)
            paths.append(str(path))
        lines.append(json.dumps({"story_id": f"s{s}", "story": "a human story .", "images": paths}))
    records = directory / "records.jsonl"
    records.write_text("\n".join(lines) + "\n")
    return records


# -- the authors' way ------------------------------------------------------------------------


class Authors:
    """One story at a time; one ``model.generate`` per story (visual) or per
    image (sentence settings), each on a batch of one."""

    def __init__(self, model_dir: str, model, device, dtype, max_new_tokens: int, prompt: str,
                 sequence_image_size: str | None):
        from transformers import AutoProcessor

        from storyrl.generators.prompts import load_prompts

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model, self.device, self.dtype = model, device, dtype
        self.max_new_tokens = max_new_tokens
        prompts = load_prompts(PROMPTS_FILE)
        self.visual_template = prompts[("visual", prompt)].text
        self.sentence_template = prompts[("sentence", prompt)].text
        self.tile = tuple(int(v) for v in sequence_image_size.split("x")) if sequence_image_size else None

    def call(self, prompt: str, image) -> str:
        import torch

        inputs = self.processor(images=[image], text=[prompt], return_tensors="pt").to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        with torch.inference_mode():
            ids = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        text = self.processor.tokenizer.decode(ids[0], skip_special_tokens=True)
        text = text.rsplit("[/INST]", 1)[-1].replace("é", "e").replace("ê", "e")
        return re.sub(r"\n\s*\n", " ", text).strip()

    def sequence_image(self, paths):
        from PIL import Image, ImageOps

        framed = []
        for p in paths:
            img = Image.open(p).convert("RGB")
            if self.tile is not None and img.size != self.tile:
                img = img.resize(self.tile, Image.Resampling.BICUBIC)
            framed.append(ImageOps.expand(img, border=2, fill="white"))
        out = Image.new("RGB", (sum(f.width for f in framed), max(f.height for f in framed)), "white")
        x = 0
        for f in framed:
            out.paste(f, (x, 0))
            x += f.width
        return out

    def story(self, setting: str, paths: list[str]) -> str:
        from PIL import Image

        if setting == "visual":
            words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
            text = self.visual_template.replace("{n}", words[len(paths)])
            return self.call(f"[INST] <image>\n{text} [/INST]", self.sequence_image(paths))
        outputs: list[str] = []
        for path in paths:
            if setting == "no_context" or not outputs:
                context = ""
            elif setting == "prev_sentence":
                context = outputs[-1]
            else:
                context = " ".join(outputs)
            text = self.sentence_template.replace("{context}", context)
            outputs.append(self.call(f"[INST] <image>\n{text} [/INST]", Image.open(path).convert("RGB")))
        pieces = [p.strip().strip("\"'").strip() for p in " ".join(outputs).split(".")]
        pieces = [p for p in pieces if p]
        return " . ".join(pieces) + " ." if pieces else ""


# -- timing ------------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device) -> float | None:
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return None


def run_storyrl(args, model_dir: str, setting: str, records_path: Path, out: Path, backend: str = "transformers"):
    """What ``storyrl generate`` runs (see storyrl/cli/generate.py), minus
    click: records, generator, generate_to_file. Returns (seconds, stories)."""
    from storyrl.datasets import load_records
    from storyrl.generators import create_generator
    from storyrl.generators.runs import generate_to_file

    _sync(args.device)
    t0 = time.perf_counter()
    records = load_records(records_path)
    generator = create_generator("prompting", model=model_dir, setting=setting, prompt=args.prompt,
                                 batch_size=args.batch_size, device=args.device, precision=args.precision,
                                 max_new_tokens=args.max_new_tokens, backend=backend,
                                 sequence_image_size=SHAPES[args.shape]["sequence_image_size"])
    run = generate_to_file(generator, records, out, overwrite=True, progress=False,
                           inputs={"data": str(records_path)})
    _sync(args.device)
    seconds = time.perf_counter() - t0
    if run.failures:
        print(f"storyrl failures ({setting}): {dict(list(run.failures.items())[:3])}", file=sys.stderr)
    return seconds, run.stories


def run_authors(args, authors: Authors, setting: str, records_path: Path):
    lines = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    _sync(args.device)
    t0 = time.perf_counter()
    stories = {r["story_id"]: authors.story(setting, r["images"]) for r in lines}
    _sync(args.device)
    return time.perf_counter() - t0, stories


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_estimate:
        return memory_estimate(args)
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    for needed in (PROMPTS_FILE, REPO / "tests" / "tiny_models.py"):
        if not needed.is_file():
            print(f"missing: {needed} (a source checkout of storyrl is needed)", file=sys.stderr)
            return 2
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.shape == "7b" and torch.device(args.device).type != "cuda":
        print("--shape 7b needs --device cuda (a random 7.6 B-parameter model; ~15 GiB in fp16)", file=sys.stderr)
        return 2
    settings = list(SETTINGS) if args.setting == "all" else [args.setting]
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model_dir or tmp / "model"
        t0 = time.perf_counter()
        if not (Path(model_dir) / "config.json").is_file():
            build_model(args.shape, Path(model_dir), args.device)
        build_s = time.perf_counter() - t0
        (tmp / "images").mkdir()
        records = write_data(tmp / "images", args.stories, shape["images"])
        warm = tmp / "images" / "warm.jsonl"
        warm.write_text(records.read_text().splitlines()[0] + "\n")

        from storyrl.models.vlm import load_vlm

        t0 = time.perf_counter()
        vlm = load_vlm(str(model_dir), None, args.device, args.precision)
        load_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in vlm.model.parameters())
        authors = Authors(str(model_dir), vlm.model, vlm.device, dtype, args.max_new_tokens, args.prompt,
                          shape["sequence_image_size"])

        print(f"storyrl generate benchmark: shape {args.shape} ({n_params / 1e6:.2f} M parameters), "
              f"{args.stories} stories x 5 images, batch {args.batch_size}, max_new_tokens {args.max_new_tokens}, "
              f"best of {args.repeats}, "
              f"prompt {args.prompt}, device {args.device}, {args.precision}, torch threads {torch.get_num_threads()}")
        print(f"model built in {build_s:.1f} s, loaded by storyrl in {load_s:.1f} s (not in the figures)")
        print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{platform.machine()} {platform.processor() or ''}".rstrip())
        rows, mismatches = [], []
        tot_s = tot_a = 0.0
        for setting in settings:
            # untimed warm-up story each way (first-call costs)
            run_storyrl(args, str(model_dir), setting, warm, tmp / "warm.json")
            run_authors(args, authors, setting, warm)
            a_s = s_s = float("inf")
            a_peak = s_peak = None
            for _ in range(args.repeats):  # alternating, best of each
                _reset_peak(args.device)
                seconds, a_stories = run_authors(args, authors, setting, records)
                a_s, a_peak = min(a_s, seconds), _peak_mib(args.device)
                _reset_peak(args.device)
                seconds, s_stories = run_storyrl(args, str(model_dir), setting, records, tmp / f"{setting}.json")
                s_s, s_peak = min(s_s, seconds), _peak_mib(args.device)
            same = s_stories == a_stories
            differ = sorted(k for k in a_stories if s_stories.get(k) != a_stories[k])
            if not same:
                mismatches.append(setting)
                for k in differ[:2]:
                    print(f"  DIFFER {setting} {k}:\n    storyrl: {s_stories.get(k)!r}\n    authors: {a_stories[k]!r}",
                          file=sys.stderr)
            calls = args.stories * (1 if setting == "visual" else 5)
            row = dict(setting=setting, stories=args.stories, authors_calls=calls,
                       authors_s=a_s, storyrl_s=s_s, authors_sps=args.stories / a_s, storyrl_sps=args.stories / s_s,
                       speedup=a_s / s_s, identical=same, differing=len(differ),
                       mean_words=float(sum(len(v.split()) for v in a_stories.values()) / max(1, len(a_stories))),
                       authors_peak_mib=a_peak, storyrl_peak_mib=s_peak)
            rows.append(row)
            tot_s += s_s
            tot_a += a_s
            peak = f", peak CUDA {a_peak:.0f} / {s_peak:.0f} MiB" if a_peak is not None else ""
            print(f"  {setting:14s} authors {row['authors_sps']:8.3f} stories/s ({a_s:6.1f} s, {calls} calls)  "
                  f"storyrl {row['storyrl_sps']:8.3f} stories/s ({s_s:6.1f} s)  {row['speedup']:5.2f}x  "
                  f"identical: {'yes' if same else f'NO ({len(differ)} differ)'}{peak}")
        n_all = args.stories * len(settings)
        total = dict(setting="all", stories=n_all, authors_sps=n_all / tot_a, storyrl_sps=n_all / tot_s,
                     speedup=tot_a / tot_s, identical=not mismatches)
        if len(settings) > 1:
            print(f"  {'all':14s} authors {total['authors_sps']:8.3f} stories/s ({tot_a:6.1f} s)"
                  f"{'':17s}  storyrl {total['storyrl_sps']:8.3f} stories/s ({tot_s:6.1f} s)  {total['speedup']:5.2f}x")
        verdict = "PASS" if total["speedup"] >= TARGET else "FAIL"
        print(f"speed-up storyrl / authors' way: {total['speedup']:.2f}x -> {verdict} (target >= {TARGET:g}x on CPU)")
        print(f"stories identical: {'yes' if not mismatches else 'NO: ' + ', '.join(mismatches)}")

        vllm_rows = []
        if args.vllm:
            vllm_rows = run_vllm(args, str(model_dir), settings, records, tmp, rows)
        if args.json:
            args.json.write_text(json.dumps(dict(
                shape=args.shape, parameters=n_params, device=args.device, precision=args.precision,
                batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, prompt=args.prompt,
                repeats=args.repeats, stories=args.stories,
                threads=torch.get_num_threads(), python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, model_load_s=load_s, rows=rows, total=total,
                target=TARGET, verdict=verdict, vllm=vllm_rows,
                date=time.strftime("%Y-%m-%d")), indent=1))
    return 1 if mismatches else 0


def run_vllm(args, model_dir: str, settings, records: Path, tmp: Path, rows) -> list[dict]:
    """storyrl with backend='vllm', after the transformers model is freed.
    Its stories are compared with the transformers ones but not required to
    match (other kernels, fp16 rounding)."""
    import gc

    import torch

    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm: not installed; skipped")
        return []
    from storyrl.models.runtime import release_models

    release_models()
    gc.collect()
    torch.cuda.empty_cache()
    from storyrl.datasets import load_records
    from storyrl.generators import create_generator
    from storyrl.generators.runs import generate_to_file

    out = []
    for setting, row in zip(settings, rows):
        try:
            t0 = time.perf_counter()
            generator = create_generator(
                "prompting", model=model_dir, setting=setting, prompt=args.prompt, batch_size=args.batch_size,
                device=args.device, precision=args.precision, max_new_tokens=args.max_new_tokens, backend="vllm",
                sequence_image_size=SHAPES[args.shape]["sequence_image_size"]).setup()
            engine_s = time.perf_counter() - t0  # vLLM's engine start, not in the figure
            generate_to_file(generator, load_records(records)[:1], tmp / "vllm_warm.json", overwrite=True,
                             progress=False)
            t0 = time.perf_counter()
            run = generate_to_file(generator, load_records(records), tmp / f"vllm_{setting}.json", overwrite=True,
                                   progress=False)
            seconds, stories = time.perf_counter() - t0, run.stories
            del generator, run
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as exc:  # report, do not hide the transformers figures
            print(f"vllm {setting}: failed: {type(exc).__name__}: {exc}")
            out.append(dict(setting=setting, error=f"{type(exc).__name__}: {exc}"))
            continue
        ref = json.loads((tmp / f"{setting}.json").read_text())
        agree = sum(stories.get(k) == v for k, v in ref.items()) / max(1, len(ref))
        sps = args.stories / seconds
        print(f"  vllm {setting:14s} {sps:8.3f} stories/s ({seconds:6.1f} s; engine start {engine_s:.0f} s, not "
              f"counted), {sps / row['authors_sps']:.2f}x the authors' way; same story as transformers for {agree:.0%}")
        out.append(dict(setting=setting, storyrl_vllm_sps=sps, seconds=seconds, engine_start_s=engine_s,
                        agree_with_transformers=agree))
    return out


# -- GPU memory of the paper's configurations (estimate from parameter counts) ------------------


def _count(build) -> dict[str, int]:
    """Parameter counts of a model built on the meta device, by top-level
    module name."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = build()
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[name] = p.numel()
    return counts


def memory_estimate(args) -> int:
    """Weights memory by arithmetic from real-shaped configs (meta device, no
    weights allocated), plus KV cache and a rough activation figure."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("--memory-estimate needs accelerate", file=sys.stderr)
        return 2
    from transformers import (CLIPVisionConfig, LlamaConfig, LlamaForCausalLM, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, MistralConfig)

    from storyrl.generators.tapm.encoder import VisualEncoder

    GiB = 2**30
    s7 = SHAPES["7b"]
    llava_cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(**s7["vision"]),
                                text_config=MistralConfig(vocab_size=s7["vocab"], **s7["text"]),
                                image_grid_pinpoints=s7["grid"], vision_feature_layer=-2)
    llava = _count(lambda: LlavaNextForConditionalGeneration(llava_cfg))
    n_llava = sum(llava.values())
    parts = {"vision tower": sum(v for k, v in llava.items() if "vision_tower" in k),
             "projector": sum(v for k, v in llava.items() if "multi_modal_projector" in k or "image_newline" in k),
             "decoder": sum(v for k, v in llava.items() if "language_model" in k or "lm_head" in k)}
    rows = []
    print("GPU memory of the paper's configurations: ESTIMATES from parameter counts (models built on the meta "
          "device with the real shapes; no weights allocated)\n")
    print(f"LLaVA-NeXT-7B (Mistral-7B + CLIP ViT-L/14-336): {n_llava / 1e9:.3f} B parameters "
          + ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in parts.items()))
    w_llava = n_llava * 2
    print(f"  weights fp16: {w_llava / GiB:.2f} GiB")
    t = s7["text"]
    head_dim = t["hidden_size"] // t["num_attention_heads"]
    kv_per_token = 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * head_dim * 2  # K and V, fp16
    # Image tokens of the authors' VIST sequence image (1300x260) under the 7B anyres grid.
    image_tokens = _llava_next_image_tokens(1300, 260, s7)
    text_tokens = 45  # the P3 visual prompt in Mistral's tokenizer, about
    tokens = image_tokens + text_tokens + 500
    kv = kv_per_token * tokens
    print(f"  KV cache: 2 x {t['num_hidden_layers']} layers x {t['num_key_value_heads']} KV heads x {head_dim} "
          f"x 2 bytes = {kv_per_token / 1024:.0f} KiB per token; a visual-setting call (1300x260 sequence image "
          f"= {image_tokens} image tokens + ~{text_tokens} text + 500 new = {tokens} tokens): "
          f"{kv / GiB:.2f} GiB per story")
    rows.append(dict(config="LLaVA-NeXT-7B fp16 inference", parameters=n_llava, weights_gib=w_llava / GiB,
                     kv_cache_gib_per_story=kv / GiB, tokens=tokens, image_tokens=image_tokens))

    llama_cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                            intermediate_size=11008, vocab_size=32000)
    llama = _count(lambda: LlamaForCausalLM(llama_cfg))
    n_llama = sum(llama.values())
    quantized = sum(v for k, v in llama.items() if k.endswith("proj.weight"))  # the Linear layers bnb quantises
    kept = n_llama - quantized  # embeddings, lm_head (skipped by transformers), norms: 16-bit
    # NF4: 4 bits a weight + absmax per 64-weight block (double quantisation: 8-bit absmax + an fp32
    # constant per 256 blocks) = 0.5 + (1 + 4/256)/64 bytes a weight.
    nf4 = quantized * (0.5 + (1 + 4 / 256) / 64)
    lora = 32 * 4 * 2 * 8 * 4096  # r=8 A (8x4096) + B (4096x8) on q, k, v, o of 32 layers
    encoder = _count(lambda: VisualEncoder({"image": 2048}, 4096, 4096, [-2, -1, 1, 2]))
    n_enc = sum(encoder.values())
    trainable = lora + n_enc
    # fp32 trainable weights + fp32 grads + Adam's two fp32 moments = 16 bytes a trainable parameter.
    train_state = trainable * 16
    weights = nf4 + kept * 2
    print(f"\nTAPM +LLaMA 2 (LLaMA-2-7B 4-bit NF4 + LoRA r=8 q/k/v/o + TAPM visual encoder, ResNet 2048-d "
          f"features, width 4096), batch 2:")
    print(f"  LLaMA-2-7B {n_llama / 1e9:.3f} B parameters: {quantized / 1e9:.3f} B in NF4 "
          f"({nf4 / GiB:.2f} GiB), {kept / 1e6:.0f} M kept in 16 bits (embeddings, lm_head, norms: "
          f"{kept * 2 / GiB:.2f} GiB)")
    print(f"  LoRA {lora / 1e6:.2f} M + visual encoder {n_enc / 1e6:.1f} M trainable parameters: fp32 weights, "
          f"grads and Adam moments = {train_state / GiB:.2f} GiB")
    # Activations (rough): batch 2 stories x 5 sentences = 10 sequences of 8 prefix + 40 text tokens;
    # Korthikanti et al. (2022) per layer s*b*h*(34 + 5*a*s/h) bytes in 16 bits, no recomputation.
    seq, b, h, a, L = 48, 10, 4096, 32, 32
    act = L * seq * b * h * (34 + 5 * a * seq / h)
    logits = seq * b * 32000 * 4
    total = weights + train_state + act + logits
    print(f"  activations (rough, 10 sequences x 48 tokens, Korthikanti et al. formula, no checkpointing): "
          f"{act / GiB:.2f} GiB, fp32 logits {logits / GiB:.2f} GiB")
    print(f"  total training estimate: {total / GiB:.1f} GiB + CUDA context/allocator overhead (~1-2 GiB)")
    kv_llama = 2 * 32 * 32 * 128 * 2
    print(f"  generation KV cache: {kv_llama / 1024:.0f} KiB per token (no GQA); 5 sentences x (8 + 30) tokens "
          f"per story: {kv_llama * 5 * 38 / 2**20:.0f} MiB per story")
    rows.append(dict(config="TAPM +LLaMA 2 (4-bit + LoRA) training, batch 2", parameters=n_llama,
                     quantized=quantized, weights_gib=weights / GiB, lora=lora, encoder=n_enc,
                     train_state_gib=train_state / GiB, activations_gib=act / GiB, total_gib=total / GiB))
    if args.json:
        args.json.write_text(json.dumps(dict(estimate=True, rows=rows), indent=1))
    return 0


def _llava_next_image_tokens(width: int, height: int, shape: dict) -> int:
    """Image tokens LLaVA-NeXT's processor puts in for an image of this size
    (its own computation, with the shape's tile and grid)."""
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    tile = shape["tile"]
    images = LlavaNextImageProcessor(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                     image_grid_pinpoints=shape["grid"])
    proc = LlavaNextProcessor(image_processor=images, tokenizer=_tokenizer([PROMPTS_FILE.read_text()], 200),
                              patch_size=shape["vision"]["patch_size"], vision_feature_select_strategy="default",
                              num_additional_image_tokens=1)
    return proc._get_number_of_features(height, width, tile, tile)


if __name__ == "__main__":
    sys.exit(main())
