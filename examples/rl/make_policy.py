"""Build the example's starting policy: a tiny LLaMA (about 0.2 M parameters)
that writes stories, half of them repetitive.

No download: the tokenizer is a word-level one trained on the bundled example
stories, and the model is pretrained here for about a minute on CPU, on the
six human stories of ``examples/human.jsonl`` and on degenerate versions of
them (the first sentence repeated). Sampling from it gives a mix of both, so
RL with the repetition reward has something to fix.

    python examples/rl/make_policy.py OUT_DIR [--steps 300]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import storyrl  # noqa: F401  (torchvision fallback before transformers)
from storyrl.console import configure_output
from storyrl.generators.prompts import load_prompts
from storyrl.text import split_sentences

HERE = Path(__file__).resolve().parent
STORIES = HERE.parent / "human.jsonl"
# The prompt `storyrl train rl` sends by default: the d_HM paper's P3.
PROMPT = load_prompts(HERE.parents[1] / "configs" / "prompts" / "dhm.yaml")[("visual", "P3")]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def load_stories() -> list[str]:
    return [json.loads(line)["story"] for line in STORIES.read_text().splitlines() if line.strip()]


def training_texts(stories: list[str]) -> list[str]:
    """Chat-formatted prompt + story pairs: each human story once, and a
    repetitive version of it (its first sentence, as many times as the story
    has sentences)."""
    texts = []
    for story in stories:
        sentences = split_sentences(story)
        prompt = PROMPT.render(len(sentences))
        for reply in (story, " ".join([sentences[0]] * len(sentences))):
            texts.append(f"user : {prompt}\nassistant : {reply}")
    return texts


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", chat_template=CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    configure_output()  # as storyrl's commands: library notices only with STORYRL_VERBOSE=1

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    texts = training_texts(load_stories())
    tokenizer = build_tokenizer(texts)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    model = LlamaForCausalLM(config)
    batch = tokenizer([t + " [EOS]" for t in texts], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"pretraining step {step}: loss {loss.item():.3f}")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"policy saved to {args.out}")


if __name__ == "__main__":
    main()
