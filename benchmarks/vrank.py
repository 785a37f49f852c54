"""Benchmark: Vrank story-pair throughput, the batched reward vs one forward
pass per pair, same model and pairs, same run.

What is measured
----------------
Pairs per second for judging N story pairs: the d_HM VIST test stories,
human story k against LLaVA story k (``shared/data/dhm/vist``; synthetic
stories of similar length when that folder is missing).

(a) storyrl: ``create_reward("vrank", model=DIR, batch_size=B).compare(firsts, seconds)``:
    pairs sorted by length, ``B`` per forward pass, tokenisation included.
(b) reference: for each pair ``tokenizer(first, second)`` and one forward
    pass, in the same model object (eval mode, no grad, same precision).

The model is random-weight (hubs are unreachable), saved as a storyrl Vrank
directory: ``--model tiny`` (the tests' BERT: hidden 32, 2 layers) or
``--model base`` (bert-base's shape: hidden 768, 12 layers, 12 heads, what
the paper's SimCSE BERT costs). The tokenizer is the tests' BERT WordPiece
tokenizer with a vocabulary of every word of the stories, so no word is split
and token counts are close to but not exactly bert-base's. Predictions must agree within ``--tol`` (exit 1 otherwise).

Usage::

    python benchmarks/vrank.py [--model tiny|base] [--device cpu|cuda] [--precision fp32|fp16|bf16]
        [--pairs 512] [--ref-pairs 128] [--batch-size 32] [--threads K] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "dhm" / "vist"
sys.path.insert(0, str(REPO / "tests"))  # tiny_models: bert_wordpiece_tokenizer, the tests' tokenizer
SHAPES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--pairs", type=int, default=512, help="pairs judged by the batched reward")
    p.add_argument("--ref-pairs", type=int, default=128, help="pairs timed one by one (spread over all; scaled)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def load_pairs(n: int) -> tuple[list[str], list[str], str]:
    if (DATA / "gt_test.json").is_file() and (DATA / "llava_vc_p3.json").is_file():
        human = json.loads((DATA / "gt_test.json").read_text())
        llava = json.loads((DATA / "llava_vc_p3.json").read_text())
        ids = [k for k in human if k in llava and human[k].strip() and llava[k].strip()][:n]
        return [human[k] for k in ids], [llava[k] for k in ids], str(DATA)
    rng = random.Random(0)
    words = "the a dog girl family went park ate cake played ball saw sea sang song walked home took photo".split()
    story = lambda: " ".join(" ".join(rng.choices(words, k=rng.randint(6, 14))) + " ." for _ in range(5))  # noqa: E731
    return [story() for _ in range(n)], [story() for _ in range(n)], "synthetic"


def main(argv=None) -> int:
    args = parse_args(argv)
    import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)
    import torch
    from transformers import BertConfig

    from storyrl.models.vrank import VrankModel
    from storyrl.rewards import create_reward
    from tiny_models import bert_wordpiece_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    firsts, seconds, source = load_pairs(args.pairs)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = bert_wordpiece_tokenizer(firsts + seconds, Path(tmp) / "tokenizer")
        config = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SHAPES[args.model])
        VrankModel.from_config(config).save_pretrained(tmp, tokenizer)
        reward = create_reward("vrank", model=tmp, device=args.device, precision=args.precision,
                               batch_size=args.batch_size)
        reward.compare(firsts[:2], seconds[:2])  # load the model, warm up
        net, tok, device, dtype = reward._loaded()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

        sync()
        start = time.perf_counter()
        ours = reward.compare(firsts, seconds)
        sync()
        t_ours = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None

        index = list(range(0, len(firsts), max(1, len(firsts) // args.ref_pairs)))[: args.ref_pairs]
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        ref = []
        sync()
        start = time.perf_counter()
        with torch.inference_mode(), autocast:
            for k in index:
                enc = tok(firsts[k], seconds[k], return_tensors="pt", truncation="longest_first", max_length=512)
                ref.append(-net(**{key: v.to(device) for key, v in enc.items()}).float().item())
        sync()
        t_ref = (time.perf_counter() - start) * len(firsts) / len(index)

    tokens = [len(tokenizer(a, b)["input_ids"]) for a, b in zip(firsts, seconds)]
    diff = float(np.max(np.abs(np.asarray(ref) - ours[index])))
    result = {
        "model": args.model,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "data": source,
        "pairs": len(firsts),
        "mean_tokens_per_pair": float(np.mean(tokens)),
        "batched_pairs_per_s": len(firsts) / t_ours,
        "one_by_one_pairs_per_s": len(firsts) / t_ref,
        "one_by_one_timed_pairs": len(index),
        "speedup": t_ref / t_ours,
        "max_abs_diff": diff,
        "peak_cuda_mib": peak,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    print(
        f"{args.model} on {result['device']}: batched {result['batched_pairs_per_s']:.1f} pairs/s, "
        f"one by one {result['one_by_one_pairs_per_s']:.1f} pairs/s, speed-up {result['speedup']:.2f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if diff > args.tol:
        print(f"MISMATCH: batched and per-pair predictions differ by {diff:.3g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
