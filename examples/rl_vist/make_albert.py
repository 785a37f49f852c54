"""Build the base model that ``storyrl train coherence`` starts from: a tiny
random-weight ALBERT and a word-level, lower-casing BERT-style tokenizer
(``[CLS] a [SEP] b [SEP]`` pairs with token types, as ALBERT's) over the
train split's stories. Nothing is downloaded; the coherence trainer loads it
with ``AlbertModel.from_pretrained(base_model)`` and the tokenizer from the
same directory.

    python examples/rl_vist/make_albert.py TRAIN_JSONL OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import storyrl  # noqa: F401  (torchvision fallback before transformers)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
#: ALBERT shape: one shared layer applied twice, width 64 (about 0.15 M parameters with a 3.2k-word vocabulary).
ALBERT = {"embedding_size": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "max_position_embeddings": 256}


def build_tokenizer(texts: list[str], min_frequency: int = 2):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=min_frequency))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def save_base(stories: list[str], out, seed: int = 0, size: dict | None = None) -> dict:
    """The tokenizer over ``stories`` and a random ALBERT of ``size`` saved to ``out``."""
    import torch
    from transformers import AlbertConfig, AlbertModel

    tokenizer = build_tokenizer(stories)
    torch.manual_seed(seed)
    vocab_size = max(tokenizer.get_vocab().values()) + 1
    model = AlbertModel(AlbertConfig(vocab_size=vocab_size, pad_token_id=tokenizer.pad_token_id, **(size or ALBERT)))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocabulary": vocab_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stories = [json.loads(line)["story"] for line in args.train.read_text(encoding="utf-8").splitlines()
               if line.strip()]
    figures = save_base(stories, args.out, args.seed)
    print(f"ALBERT base: {figures['parameters'] / 1e6:.2f} M parameters, vocabulary {figures['vocabulary']}, "
          f"saved to {args.out}")


if __name__ == "__main__":
    main()
