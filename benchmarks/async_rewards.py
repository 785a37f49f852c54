"""Benchmark: two model rewards one after the other (TRL's sync path) vs
concurrently as async rewards (``async_rewards: true``; TRL's async path:
``asyncio.gather`` on one loop, each reward in its own worker thread).

What is measured
----------------
Wall time of one "step": two RoViST-C coherence rewards (random-weight
ALBERT, hidden 256, 4 layers, different seeds; hubs are unreachable) each
scoring the same ``--stories`` distinct stories (5 sentences drawn from
``examples/*.jsonl``), on the CPU
with ``--threads`` torch threads. (a) sequential: ``r1(...)`` then
``r2(...)``; (b) concurrent: ``await asyncio.gather(AsyncReward(r1)(...),
AsyncReward(r2)(...))``. Median of ``--repeats`` after a warm-up; the two
paths' values must be equal (exit 1 otherwise).

Usage::

    python benchmarks/async_rewards.py [--stories 64] [--threads 1] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

SHAPE = dict(embedding_size=128, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stories", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)
    import torch
    from coherence import build_tokenizer
    from transformers import AlbertConfig

    from storyrl.models.coherence import CoherenceModel
    from storyrl.rewards import create_reward
    from storyrl.rewards.concurrent import AsyncReward

    torch.set_num_threads(args.threads)
    texts = [json.loads(line)["story"] for f in sorted((REPO / "examples").glob("*.jsonl"))
             for line in f.read_text().splitlines() if line.strip()]
    # Distinct stories (5 sentences drawn from the examples): the reward de-duplicates sentence pairs.
    import random

    from storyrl.text import split_sentences

    sentences = [x for t in texts for x in split_sentences(t)]
    rng = random.Random(0)
    stories = [" ".join(rng.sample(sentences, 5)) for _ in range(args.stories)]
    tokenizer = build_tokenizer(texts)
    config = AlbertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SHAPE)
    with tempfile.TemporaryDirectory() as tmp:
        rewards = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            CoherenceModel.from_config(config).save_pretrained(f"{tmp}/m{seed}", tokenizer)
            rewards.append(create_reward("coherence", model=f"{tmp}/m{seed}", device="cpu", batch_size=64))
        concurrent = [AsyncReward(r) for r in rewards]
        call = dict(prompts=["p"] * len(stories), completions=stories)

        def sequential():
            return [r(**call) for r in rewards]

        def together():
            async def both():
                return await asyncio.gather(*(r(**call) for r in concurrent))
            return list(asyncio.run(both()))

        expected = sequential()  # loads the models, warms up
        if together() != expected:
            print("values differ between the paths", file=sys.stderr)
            return 1
        times = {"sequential": [], "concurrent": []}
        for _ in range(args.repeats):
            for name, run in (("sequential", sequential), ("concurrent", together)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    result = {k: round(statistics.median(v), 3) for k, v in times.items()}
    result.update(stories=args.stories, threads=args.threads, repeats=args.repeats,
                  speedup=round(result["sequential"] / result["concurrent"], 2))
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
