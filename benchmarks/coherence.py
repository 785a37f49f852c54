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

Usage::

    python benchmarks/coherence.py [--model small|large] [--device cpu|cuda]
        [--precision fp32|fp16|bf16] [--batch-size 64] [--ref-pairs 300] [--json OUT]
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
SHAPES = {
    "small": dict(embedding_size=128, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "large": dict(embedding_size=128, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
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
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


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


def main(argv=None) -> int:
    args = parse_args(argv)
    if not DATA.is_dir():
        print(f"missing data: {DATA}", file=sys.stderr)
        return 2
    import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)
    import torch
    from transformers import AlbertConfig

    from storyrl.rewards import create_reward
    from storyrl.models.coherence import CoherenceModel
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
