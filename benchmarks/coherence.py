"""Benchmark: RoViST-C sentence-pair throughput, storyrl vs one forward pass
per pair (the authors' way), same model and pairs, same run.

What is measured
----------------
Pairs per second for scoring the d_HM VWP test stories (586 human + 586
LLaVA, ``shared/data/dhm/vwp``) in the d_HM ``prefix`` mode:

(a) storyrl: ``create_reward("coherence", model=DIR).score(stories)``: all
    pairs of all stories, de-duplicated, sorted by length, in batches of
    ``--batch-size``; includes sentence splitting and tokenisation.
(b) reference: for each pair, ``tokenizer(first, sentence)`` and one forward
    pass, as the authors' scorer does; timed on ``--ref-pairs`` pairs spread
    evenly over all pairs (its cost per pair does not depend on the others)
    and scaled.

Both use the same model object in eval mode, fp32 (``--device cuda
--precision fp16`` on a GPU). The model is random-weight (hubs are
unreachable): ``--model small`` (ALBERT, hidden 256, 4 layers) or ``--model
large`` (albert-large-v1's shape: hidden 1024, 24 layers, 16 heads, for the
GPU machine). The tokenizer is a word-level one trained in the script on the
stories (no hub), so token counts are close to but not exactly ALBERT's
SentencePiece. Scores must agree within ``--tol`` (exit 1 otherwise).

``--attn eager|sdpa`` picks ALBERT's attention implementation (transformers'
default for ALBERT is ``sdpa``).

``--compare`` (issue 24, item 3) instead times, on ``--stories`` stories
drawn at random (seed 0), every batching x attention combination, interleaved
and repeated ``--repeats`` times in rotating order (the machine is shared:
medians and the load average are reported):

* ``current``: storyrl's ``pair_probabilities`` (pairs sorted by characters,
  batches under the token budget);
* ``tokens``: pairs sorted by their exact token count, neighbours batched
  under the same budget, order restored;
* ``unsorted``: pairs in story order, batched under the same budget;
* ``single``: one pair per forward pass.

It also counts real and padded tokens per variant, and checks that every
variant's probabilities agree with ``current`` within ``--tol``.

Usage::

    python benchmarks/coherence.py [--model small|large] [--device cpu|cuda]
        [--precision fp32|fp16|bf16] [--batch-size 64] [--ref-pairs 300]
        [--attn sdpa|eager] [--json OUT]
    python benchmarks/coherence.py --compare [--model small|large] [--stories 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "dhm" / "vwp"
TARGET = 5.0
ATTN = ("sdpa", "eager")
BATCHINGS = ("current", "tokens", "unsorted", "single")
SHAPES = {
    "small": {"embedding_size": 128, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 1024},
    "large": {"embedding_size": 128, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
              "intermediate_size": 4096},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ref-pairs", type=int, default=300)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--attn", choices=ATTN, default="sdpa", help="ALBERT attention implementation")
    p.add_argument("--compare", action="store_true", help="batching x attention comparison (see module docs)")
    p.add_argument("--stories", type=int, default=300, help="--compare: stories drawn at random")
    p.add_argument("--repeats", type=int, default=3, help="--compare: interleaved repetitions")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for name in ("batch_size", "ref_pairs", "stories", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def build_tokenizer(stories):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(stories, trainers.WordLevelTrainer(vocab_size=30000, special_tokens=specials))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def group(order, lengths, batch_size, budget):
    """Greedy batches over ``order``: at most ``batch_size`` pairs and
    (pairs x longest length) <= ``budget``, storyrl's rule."""
    batches, current, longest = [], [], 0
    for k in order:
        wide = max(longest, lengths[k])
        if current and (len(current) >= batch_size or (len(current) + 1) * wide > budget):
            batches.append(current)
            current, wide = [], lengths[k]
        current.append(k)
        longest = wide
    return batches + ([current] if current else [])


def compare(args, reward, stories, split_sentences, sentence_pairs) -> int:
    """Batching x attention, interleaved repetitions, medians (module docs)."""
    import os
    import random

    import torch

    from storyrl.models.coherence import encode_pairs

    net, tok, device, _ = reward._loaded()
    picked = random.Random(0).sample(stories, min(args.stories, len(stories)))
    pairs = list(dict.fromkeys(p for s in picked for p in sentence_pairs(split_sentences(s)) if p[0].strip() != p[1].strip()))
    budget = reward.max_batch_tokens or (32768 if device.type == "cuda" else 512)
    counts = {"real": 0, "padded": 0, "forwards": 0}

    def count(_module, _args, kwargs):
        counts["real"] += int(kwargs["attention_mask"].sum())
        counts["padded"] += kwargs["input_ids"].numel()
        counts["forwards"] += 1

    def forward(batches):
        probs = np.empty(len(pairs))
        with torch.inference_mode():
            for index in batches:
                enc = encode_pairs(tok, [pairs[k] for k in index], reward.max_length)
                logits = net(**{k: v.to(device) for k, v in enc.items()}).float()
                probs[index] = torch.softmax(logits, -1)[:, 1].cpu().numpy()
        return probs

    def by_tokens():
        firsts = tok([a for a, _ in pairs], add_special_tokens=False)["input_ids"]
        seconds = tok([b for _, b in pairs], add_special_tokens=False)["input_ids"]
        lengths = [min(len(a) + len(b), reward.max_length - 3) + 3 for a, b in zip(firsts, seconds)]
        return forward(group(sorted(range(len(pairs)), key=lengths.__getitem__), lengths, reward.batch_size, budget))

    def unsorted():
        lengths = [len(a) + len(b) for a, b in pairs]  # characters, ~4 a token, as storyrl estimates
        return forward(group(range(len(pairs)), lengths, reward.batch_size, 4 * budget))

    variants = {
        "current": lambda: reward.pair_probabilities(pairs),
        "tokens": by_tokens,
        "unsorted": unsorted,
        "single": lambda: forward([[k] for k in range(len(pairs))]),
    }
    combos = [(b, a) for a in ATTN for b in BATCHINGS]
    times = {c: [] for c in combos}
    tokens, probs = {}, {}
    handle = net.register_forward_pre_hook(count, with_kwargs=True)
    load = [os.getloadavg()]
    for rep in range(args.repeats):
        for c in combos[rep % len(combos):] + combos[: rep % len(combos)]:  # rotate: no combo always first
            net.albert_model.set_attn_implementation(c[1])
            counts.update(real=0, padded=0, forwards=0)
            start = time.perf_counter()
            out = variants[c[0]]()
            times[c].append(time.perf_counter() - start)
            tokens[c], probs[c] = dict(counts), out
        load.append(os.getloadavg())
    handle.remove()
    base = times[("current", "sdpa")]
    rows = []
    for c in combos:
        med = float(np.median(times[c]))
        rows.append({
            "batching": c[0], "attn": c[1], "median_s": med, "times_s": times[c],
            "pairs_per_s": len(pairs) / med, "vs_current_sdpa": float(np.median(base)) / med,
            "forwards": tokens[c]["forwards"], "real_tokens": tokens[c]["real"], "padded_tokens": tokens[c]["padded"],
            "max_abs_diff": float(np.max(np.abs(probs[c] - probs[("current", "sdpa")]))),
        })
    result = {
        "model": args.model, "device": args.device, "precision": args.precision, "batch_size": args.batch_size,
        "budget_tokens": budget, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "stories": len(picked), "pairs": len(pairs), "repeats": args.repeats,
        "loadavg_1_5_15_before_each_rep_and_after": load, "rows": rows,
        "python": platform.python_version(), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    print(f"{'batching':9} {'attn':5} {'median s':>9} {'pairs/s':>8} {'vs current':>10} {'forwards':>8} {'pad %':>6} {'max diff':>9}")
    for r in rows:
        pad = 100 * (1 - r["real_tokens"] / r["padded_tokens"])
        print(f"{r['batching']:9} {r['attn']:5} {r['median_s']:9.2f} {r['pairs_per_s']:8.1f} {r['vs_current_sdpa']:9.2f}x "
              f"{r['forwards']:8d} {pad:6.1f} {r['max_abs_diff']:9.1e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    worst = max(r["max_abs_diff"] for r in rows)
    if worst > args.tol:
        print(f"MISMATCH: a variant differs from storyrl's current batching by {worst:.3g}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if not DATA.is_dir():
        print(f"missing data: {DATA}", file=sys.stderr)
        return 2
    import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)

    # isort: split
    import torch
    from transformers import AlbertConfig

    from storyrl.models.coherence import CoherenceModel
    from storyrl.rewards import create_reward
    from storyrl.rewards.coherence import sentence_pairs
    from storyrl.text import split_sentences

    if args.threads:
        torch.set_num_threads(args.threads)
    stories = [s for name in ("gt_test", "llava_vc_p3") for s in json.loads((DATA / f"{name}.json").read_text()).values()]
    tokenizer = build_tokenizer(stories)
    torch.manual_seed(0)
    config = AlbertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SHAPES[args.model])
    with tempfile.TemporaryDirectory() as tmp:
        CoherenceModel.from_config(config).save_pretrained(tmp, tokenizer)
        reward = create_reward("coherence", model=tmp, device=args.device, precision=args.precision, batch_size=args.batch_size)
        reward.score(stories[:2])  # load the model, warm up
        net, tok, device, dtype = reward._loaded()
        net.albert_model.set_attn_implementation(args.attn)
        if args.compare:
            return compare(args, reward, stories, split_sentences, sentence_pairs)

        pairs = [p for s in stories for p in sentence_pairs(split_sentences(s)) if p[0].strip() != p[1].strip()]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        ours = reward.score(stories)
        sync()
        t_ours = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None

        # Per-pair reference on the first pairs, and storyrl's own probabilities for them.
        ref_pairs = pairs[:: max(1, len(pairs) // args.ref_pairs)]  # spread over short and long prefixes
        tok.truncation_side = "left"
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        ref = []
        sync()
        start = time.perf_counter()
        with torch.no_grad(), autocast:
            for first, sentence in ref_pairs:
                enc = tok(first, sentence, return_tensors="pt", truncation="only_first", max_length=512)
                # (truncation_side is set to "left" below: keep the end of the prefix, as storyrl does)
                logits = net(**{k: v.to(device) for k, v in enc.items()}).float()
                ref.append(torch.softmax(logits, -1)[0, 1].item())
        sync()
        t_ref = (time.perf_counter() - start) * len(pairs) / len(ref_pairs)
        check = reward.pair_probabilities(ref_pairs)

    diff = float(np.max(np.abs(np.asarray(ref) - check)))
    result = {
        "model": args.model,
        "device": args.device,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "stories": len(stories),
        "pairs": len(pairs),
        "storyrl_pairs_per_s": len(pairs) / t_ours,
        "reference_pairs_per_s": len(pairs) / t_ref,
        "reference_timed_pairs": len(ref_pairs),
        "speedup": t_ref / t_ours,
        "max_abs_diff": diff,
        "scored_stories": int(np.isfinite(ours).sum()),
        "peak_cuda_mib": peak,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    print(f"speed-up {result['speedup']:.1f}x, target >= {TARGET:.0f}x: {'PASS' if result['speedup'] >= TARGET else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if diff > args.tol:
        print(f"MISMATCH: storyrl and the per-pair reference differ by {diff:.3g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
