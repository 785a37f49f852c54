"""A learned story reward model (``storyrl train reward_model``) as a reward.

The trainer fits a sequence-classification model with one output (TRL's
``RewardTrainer``, Bradley-Terry loss on preference pairs) and writes
``final/``: the model, its tokenizer and :data:`METADATA_FILE`, which says
how the model read its stories: the token limit (``max_length``) and, when
the pairs' prompt was part of the scored text, that prompt as the text the
model read (:func:`prompt_text`: a conversation, as ``storyrl pairs
--policy`` writes for chat models and VLMs, rendered once by the trainer
with the reward model's chat template). This reward scores a story as the
trainer did: the text :func:`scored_text` (that prompt text, a space,
story), tokenized by :func:`encode` (TRL's end-of-sequence token appended,
cut to ``max_length`` tokens), and the model's one logit is the score
(higher = better, unbounded). Empty stories are unscorable (NaN).

The encoding and scoring helpers live here, not in the trainer, so that the
trainer's held-out accuracy and this reward compute the very same numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards.base import ModelConfig, Reward

__all__ = ["METADATA_FILE", "RewardModel", "RewardModelConfig", "encode", "prompt_text", "read_metadata",
           "score_texts", "scored_text"]

#: The storyrl file in a trained reward model's directory (how to score).
METADATA_FILE = "storyrl_reward_model.json"


def _message_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined (image parts
    dropped: a reward model reads text only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part["text"] for part in content
                        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))
    raise ValueError(f"a message's content must be a string or a list of parts, got {type(content).__name__}")


def prompt_text(prompt: str | list[dict[str, Any]], tokenizer: Any) -> str:
    """The text a reward model reads for a pairs' ``prompt``: a string as it
    is; a conversation (TRL's conversational format: ``storyrl pairs
    --policy`` with a chat model or VLM) with its messages' text only (no
    images), rendered by ``tokenizer``'s chat template up to the assistant
    turn (``add_generation_prompt``), so the story follows where the policy
    wrote it; a tokenizer without a chat template gets the messages' texts,
    one per line. A begin-of-sequence token the template writes is left to
    the tokenizer, which adds its own (no doubled BOS). ValueError when the
    conversation does not render."""
    if isinstance(prompt, str):
        return prompt
    try:
        messages = [{"role": str(m.get("role", "user")), "content": _message_text(m.get("content", ""))}
                    for m in prompt]
        if not getattr(tokenizer, "chat_template", None):
            return "\n".join(m["content"] for m in messages)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template's own error (roles, content) is the user's to see, on one line
        raise ValueError(f"the prompt's conversation does not render with the reward model's chat template: "
                         f"{' '.join(str(exc).split())}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def scored_text(story: str, prompt: str | None) -> str:
    """What the model reads: the story, after ``prompt`` and a space when
    there is a prompt (no space when it already ends in whitespace)."""
    if prompt is None:
        return story
    return prompt + ("" if not prompt or prompt[-1].isspace() else " ") + story


def encode(tokenizer: Any, text: str, max_length: int) -> list[int]:
    """Token ids of ``text`` as TRL's RewardTrainer tokenizes a plain-text
    pair (the tokenizer's EOS appended: the last token pools the sequence in
    causal-LM classifiers), cut to the first ``max_length`` tokens (TRL would
    drop the whole pair instead)."""
    eos = tokenizer.eos_token
    if eos and not text.endswith(eos):
        text = text + eos
    return list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The trainer's :data:`METADATA_FILE` of ``directory`` (ValueError
    naming the directory when it is missing or unreadable)."""
    path = Path(directory) / METADATA_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"model {directory}: no {METADATA_FILE}; give the final/ directory of a "
                         "storyrl train reward_model run") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc}); re-save the model with storyrl train reward_model") from None
    limit = data.get("max_length") if isinstance(data, dict) else None
    # bool is an int to Python: max_length true would silently cut every story to 1 token
    if not isinstance(data, dict) or type(limit) is not int or limit < 1 or not (
            data.get("prompt") is None or isinstance(data.get("prompt"), str)):
        raise ValueError(f"{path}: expected max_length (an integer >= 1) and prompt (string or null)")
    return data


def score_texts(model: Any, tokenizer: Any, texts: list[str], max_length: int, batch_size: int, device: Any,
                dtype: Any = None) -> np.ndarray:
    """The model's logit for each text (:func:`encode`d, padded on the right
    as TRL's preference collator pads, ``batch_size`` texts a forward pass)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = [encode(tokenizer, t, max_length) for t in texts]
    out = np.empty(len(ids))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None and dtype != torch.float32)
    with torch.inference_mode(), autocast:
        for start in range(0, len(ids), batch_size):
            chunk = ids[start:start + batch_size]
            width = max(len(x) for x in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for k, x in enumerate(chunk):
                input_ids[k, :len(x)] = torch.tensor(x, dtype=torch.long)
                mask[k, :len(x)] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
            out[start:start + len(chunk)] = logits[:, 0].float().cpu().numpy()
    return out


def load_reward_model(directory: str | Path, device: Any = "cpu", dtype: Any = None):
    """(model, tokenizer) of a trained directory: full weights, or LoRA
    adapters over their base (peft). ``dtype``: the weights' dtype (None:
    transformers' default, which is the dtype the checkpoint was saved in)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from storyrl.models.pretrained import adapter_base, is_adapter_dir, load_pretrained

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    kwargs = {} if dtype is None else {"dtype": dtype}
    if is_adapter_dir(directory):
        from peft import PeftModel

        # The base may be adapters too (a backbone that was an SFT final/):
        # it loads merged. peft keeps these adapters in fp32 over an fp16/bf16
        # base; autocast in score_texts runs the mix.
        base, revision = adapter_base(directory)
        backbone = load_pretrained(AutoModelForSequenceClassification, base, revision=revision, num_labels=1,
                                   **kwargs)
        model = PeftModel.from_pretrained(backbone, directory)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(directory, **kwargs)
    if tokenizer.pad_token is None:  # TRL trained with EOS as the padding token
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


@dataclass
class RewardModelConfig(ModelConfig):
    model: str | None = option(None, "A storyrl train reward_model final/ directory.", path="dir")
    batch_size: int = option(16, "Stories per forward pass.", min=1)
    max_length: int | None = option(None, "Token limit of (prompt +) story; default: the trained model's.", min=1)

    def _problems(self) -> list[str]:
        if self.model is not None and not (Path(self.model) / METADATA_FILE).is_file():
            return [(f"model {self.model}: no {METADATA_FILE}; give the final/ directory of a storyrl train "
                     "reward_model run")]
        return []


class RewardModel(Reward):
    """A trained story reward model: the model's logit of the story (higher
    = better). Options: :class:`RewardModelConfig`."""

    name = "reward_model"
    higher_is_better = True
    config_class = RewardModelConfig

    def _loaded(self):
        """(model, tokenizer, metadata, device, dtype), loaded once per process."""
        from storyrl.models.runtime import check_runs, resolve_device, resolve_dtype, resolve_precision, shared_model

        if self.model is None:
            raise ValueError("reward_model needs model=<final/ directory of storyrl train reward_model>")
        metadata = read_metadata(self.model)
        device = resolve_device(self.device)
        precision = resolve_precision(self.precision, device)
        dtype = resolve_dtype(precision, device)

        def load():
            # Loaded in the precision's dtype: transformers' default would keep
            # the checkpoint's (a bf16-saved model would run bf16 at fp32).
            model, tokenizer = load_reward_model(self.model, device, dtype)
            check_runs(lambda: score_texts(model, tokenizer, ["a b."], 8, 1, device, dtype),
                       f"reward model {self.model}", precision, device)
            return model, tokenizer

        key = ("reward_model", str(Path(self.model).resolve()), str(device), precision)
        model, tokenizer = shared_model(key, load)
        return model, tokenizer, metadata, device, dtype

    def _setup(self) -> None:
        self._loaded()

    def _score_batch(self, stories: list[str], **_: Any) -> np.ndarray:
        from storyrl.models.runtime import check_finite, resolve_precision

        model, tokenizer, metadata, device, dtype = self._loaded()
        out = np.full(len(stories), np.nan)
        keep = [i for i, s in enumerate(stories) if s.strip()]
        for i in set(range(len(stories))) - set(keep):
            out[i] = self._unscorable("empty story")
        if keep:
            texts = [scored_text(stories[i], metadata.get("prompt")) for i in keep]
            scores = score_texts(model, tokenizer, texts, self.max_length or metadata["max_length"],
                                 self.batch_size, device, dtype)
            check_finite(scores, f"reward model {self.model}", resolve_precision(self.precision, device))
            out[keep] = scores
        return out
