"""Pretrain the example's starting storyteller: a tiny LLaMA with a
word-level tokenizer, trained on the train split's (prompt, human story)
pairs. Nothing is downloaded.

    python examples/rl_vist/make_policy.py TRAIN_JSONL OUT_DIR [--heldout HELDOUT_JSONL]
        [--steps 400] [--batch-size 32] [--lr 3e-3] [--seed 0]

The tokenizer knows the words that occur at least twice in the train
split's prompts and stories (others read as ``[UNK]``); it splits on
whitespace, as VIST stories are written (``we went to the park .``), and
decodes words joined by spaces with the punctuation attached (``we went to
the park.``). The loss covers the story and its ``[EOS]`` only: not the
prompt, and not the story's ``[UNK]`` tokens, so the policy is never taught
to write ``[UNK]`` (which decoding drops, leaving holes such as "the was
great") and picks a known word instead. With ``--heldout`` the held-out
stories' per-token loss is printed at the end (not used for anything else).
400 steps of 32 stories (about 8 passes over 1500 stories) take 3-5 minutes
on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import storyrl  # noqa: F401  (torchvision fallback before transformers)
from storyrl.console import configure_output

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CHAT_TEMPLATE, EOS, chat_text, user_prompt

#: The policy: 2 layers of width 128; about 1.4 M parameters with the 4.2k-word vocabulary of 1500 stories.
LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}


def load_records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def pairs(records: list[dict]) -> list[tuple[str, str]]:
    """(chat prompt, chat prompt + story + [EOS]) per record."""
    return [(chat_text(user_prompt(r["noun_phrases"])), chat_text(user_prompt(r["noun_phrases"]), r["story"]))
            for r in records]


def build_tokenizer(texts: list[str], min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # VIST text is already tokenized (words, ' . ')
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", EOS],
                                                             min_frequency=min_frequency))
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)


def encode(tokenizer, examples: list[tuple[str, str]]):
    """input_ids, attention_mask, labels (-100 on the prompt, the padding and
    [UNK]), right-padded."""
    batch = tokenizer([full for _, full in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels = labels.masked_fill(batch["input_ids"] == tokenizer.unk_token_id, -100)
    for i, (prompt, _) in enumerate(examples):
        labels[i, : len(tokenizer(prompt, add_special_tokens=False)["input_ids"])] = -100
    return batch, labels


def story_loss(model, tokenizer, examples, batch_size: int = 64) -> float:
    """Mean loss per story token (incl. [EOS]) over ``examples``."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch, labels = encode(tokenizer, examples[start : start + batch_size])
            logits = model(**batch).logits[:, :-1]
            target = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            total += loss.item()
            count += int((target != -100).sum())
    model.train()
    return total / max(count, 1)


def pretrain(records: list[dict], out, steps: int = 400, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
             size: dict | None = None, heldout: list[dict] | None = None, log_every: int = 100) -> dict:
    """Train the tokenizer and the policy on ``records``, save both to ``out``;
    returns {"parameters", "vocabulary", "train_loss", "heldout_loss"?}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.time()
    torch.manual_seed(seed)
    examples = pairs(records)
    tokenizer = build_tokenizer([full for _, full in examples])
    # WordLevelTrainer's ids can skip one: size the embeddings by the largest id.
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    config = LlamaConfig(vocab_size=vocab_size, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **(size or LLAMA))
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"policy: {n_params / 1e6:.2f} M parameters, vocabulary {vocab_size}, {len(examples)} stories")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for step in range(steps):
        while len(order) < batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        chosen, order = order[:batch_size], order[batch_size:]
        batch, labels = encode(tokenizer, [examples[i] for i in chosen])
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % log_every == 0 or step == steps - 1:
            print(f"pretraining step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    figures = {"parameters": n_params, "vocabulary": vocab_size,
               "train_loss": story_loss(model, tokenizer, examples[:200])}
    if heldout:
        figures["heldout_loss"] = story_loss(model, tokenizer, pairs(heldout))
        print(f"story loss per token: held-out {figures['heldout_loss']:.3f}, train {figures['train_loss']:.3f}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"policy saved to {out} in {time.time() - started:.0f} s")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--heldout", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configure_output()  # as storyrl's commands: library notices only with STORYRL_VERBOSE=1
    pretrain(load_records(args.train), args.out, args.steps, args.batch_size, args.lr, args.seed,
             heldout=load_records(args.heldout) if args.heldout else None)


if __name__ == "__main__":
    main()
