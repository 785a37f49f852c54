"""The Vrank model (Hsu et al., 2022, §4): a sentence encoder reading two
stories at once and a regression head predicting their human rank gap.

Input: the tokenizer's pair encoding of ``(story1, story2)`` -- for BERT
``[CLS] story1 [SEP] story2 [SEP]`` with token types 0/1 (:func:`encode_story_pairs`).
Pairs longer than ``max_length`` tokens are cut with
``truncation="longest_first"``: tokens are removed from the end of the longer
story first, so both keep as much as the limit allows (the paper does not say
how it truncated; VIST stories are ~60 tokens, far below BERT's 512).

Output: one float per pair, the predicted gap
``avg_rank(story1) - avg_rank(story2)`` (VHED's ``label``). Lower rank =
better, so a NEGATIVE prediction means story1 is the better story; the reward
(:mod:`storyrl.rewards.vrank`) flips the sign so that positive = first better.

Pooling (``pooling``): ``"pooler"`` (default) is the encoder's
``pooler_output``, i.e. the [CLS] vector through BERT's dense+tanh layer. In a
supervised SimCSE checkpoint (the paper's ``princeton-nlp/sup-simcse-bert-base-uncased``)
that layer holds SimCSE's MLP, and the SimCSE authors use the [CLS]-with-MLP
representation as the sentence embedding of their supervised models, so this
is "the acquired sentence embedding" the paper feeds to its regression layer.
``"cls"`` takes the raw last-layer [CLS] vector (SimCSE's
``cls_before_pooler``; the only choice for encoders without a pooler). The
head is dropout + ``Linear(hidden, 1)`` (dropout: the encoder's
``hidden_dropout_prob``, as transformers' sequence-regression heads; the paper
does not give it).

Not reproduced: the paper's extra MLM pre-training of SimCSE on VIST
reference stories (run it with any MLM script and pass the resulting
directory as ``base_model``).

Storage (:meth:`VrankModel.save_pretrained`): a directory with the encoder's
``config.json``, ``model.safetensors`` (encoder + head), the tokenizer and
``storyrl_vrank.json`` (format, pooling, dropout, max_length).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_BASE = "princeton-nlp/sup-simcse-bert-base-uncased"
POOLINGS = ("pooler", "cls")
CONFIG_FILE = "storyrl_vrank.json"
_WEIGHTS_FILE = "model.safetensors"
_FORMAT = "storyrl-vrank"


def encode_story_pairs(tokenizer, firsts: list[str], seconds: list[str], max_length: int = 512) -> dict[str, torch.Tensor]:
    """Padded batch tensors of the pair encoding ``tokenizer(first, second)``,
    cut to ``max_length`` tokens with ``longest_first`` (see module docs)."""
    if len(firsts) != len(seconds):
        raise ValueError(f"{len(firsts)} first stories for {len(seconds)} second stories")
    enc = tokenizer(
        list(firsts),
        list(seconds),
        truncation="longest_first",
        max_length=max_length,
        padding=True,
        return_tensors="pt",
    )
    return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


class VrankModel(nn.Module):
    """A transformers encoder + dropout + ``Linear(hidden, 1)``; ``forward``
    returns the predicted rank gaps, shape ``(batch,)``."""

    def __init__(self, encoder, pooling: str = "pooler", dropout: float | None = None, max_length: int = 512) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if pooling == "pooler" and getattr(encoder, "pooler", None) is None:
            raise ValueError(
                f"pooling='pooler' needs an encoder with a pooler layer ({type(encoder).__name__} has none): "
                "use pooling='cls'"
            )
        if dropout is None:
            dropout = float(getattr(encoder.config, "hidden_dropout_prob", 0.1))
        self.encoder = encoder
        self.pooling = pooling
        self.max_length = max_length
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.config.hidden_size, 1)

    def pooled(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        """The pair's vector fed to the head (see ``pooling``)."""
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        out = self.encoder(**kwargs)
        return out.pooler_output if self.pooling == "pooler" else out.last_hidden_state[:, 0]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        pooled = self.pooled(input_ids, attention_mask, token_type_ids)
        return self.head(self.dropout(pooled)).squeeze(-1)

    # -- construction and storage ------------------------------------------------
    @classmethod
    def from_config(cls, encoder_config, pooling: str = "pooler", dropout: float | None = None,
                    max_length: int = 512) -> VrankModel:
        """Random weights (tests, or training from scratch)."""
        from transformers import AutoModel

        return cls(AutoModel.from_config(encoder_config), pooling, dropout, max_length)

    @classmethod
    def from_base(cls, name_or_path: str = DEFAULT_BASE, pooling: str = "pooler", dropout: float | None = None,
                  max_length: int = 512) -> VrankModel:
        """A pretrained encoder (hub name or local directory) with a new head:
        the starting point for training."""
        from transformers import AutoModel

        from storyrl.models.hub import require_hub_model

        require_hub_model(name_or_path, what="Vrank base encoder")
        return cls(AutoModel.from_pretrained(name_or_path), pooling, dropout, max_length)

    def save_pretrained(self, directory, tokenizer=None) -> None:
        """storyrl's Vrank directory (module docs); ``tokenizer`` too when given."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.encoder.config.save_pretrained(directory)
        meta = {
            "format": _FORMAT,
            "version": 1,
            "pooling": self.pooling,
            "dropout": self.dropout.p,
            "max_length": self.max_length,
            "output": "avg_rank(story1) - avg_rank(story2); negative = story1 better",
        }
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / _WEIGHTS_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    @classmethod
    def from_pretrained(cls, directory) -> tuple[VrankModel, Any]:
        """(model in eval mode, tokenizer) from a :meth:`save_pretrained`
        directory; the tokenizer is None when none was saved."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        directory = Path(directory)
        meta_path = directory / CONFIG_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{directory}: not a storyrl Vrank model (no {CONFIG_FILE}; train one with "
                                    "storyrl train vrank)")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
        model = cls.from_config(
            AutoConfig.from_pretrained(directory), meta.get("pooling", "pooler"), meta.get("dropout"),
            int(meta.get("max_length", 512)),
        )
        model.load_state_dict(load_file(str(directory / _WEIGHTS_FILE)))
        return model.eval(), _load_tokenizer(directory)


def _load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    from storyrl.models.runtime import has_saved_tokenizer

    if not has_saved_tokenizer(directory):  # else transformers 5 builds an empty-vocabulary one
        return None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        return None


def load_vrank_model(model: str, tokenizer: str | None = None):
    """(model, tokenizer) from a storyrl Vrank directory, or a hub repository
    holding one (downloaded through ``huggingface_hub``). The tokenizer is the
    directory's, else ``tokenizer`` (a name or path)."""
    from transformers import AutoTokenizer

    from storyrl.models.hub import require_hub_model

    path = Path(model)
    if not path.is_dir():
        if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise FileNotFoundError(
                f"Vrank model {model!r} not found: give a storyrl Vrank directory (storyrl train vrank) "
                "or a hub repository holding one"
            )
        from huggingface_hub import snapshot_download

        require_hub_model(model, what="Vrank model", hint="set the vrank reward's model option to a local "
                          "Vrank directory (--vrank-model DIR)")
        path = Path(snapshot_download(model))
    net, saved = VrankModel.from_pretrained(path)
    if saved is None:
        if tokenizer is None:
            raise FileNotFoundError(f"{path}: the Vrank directory holds no tokenizer; give the tokenizer option")
        require_hub_model(tokenizer, what="Vrank tokenizer", hint="set the vrank reward's tokenizer option to a local "
                          "copy's directory (--tokenizer DIR)")
        saved = AutoTokenizer.from_pretrained(tokenizer)
    return net, saved
