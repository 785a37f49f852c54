"""The RoViST-C sentence-order model (Wang et al., 2022) behind the
``coherence`` reward: ALBERT with dropout and a linear head on its pooled
output. It reads a pair ``[CLS] first [SEP] sentence [SEP]`` (token types 0
for ``[CLS] first [SEP]``, 1 for ``sentence [SEP]``; :func:`encode_pairs`)
and class 1 of its output means "``sentence`` follows ``first``". Which pairs
a story gives and how their scores make the story's are the metric's, in
:mod:`storyrl.rewards.coherence`; training is :mod:`storyrl.training.judges.coherence`.

Inputs longer than ``max_length`` tokens keep the whole sentence and the END
of the first segment (the context nearest the sentence); a sentence that alone
exceeds the limit keeps its beginning and no context.

Models: storyrl's own directories (``CoherenceModel.save_pretrained``), or the
authors' released checkpoint (a pickle of ``{"model": state_dict, "opt":
argparse.Namespace, ...}``), which is only unpickled with
``trust_checkpoint=True`` because unpickling can run code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from storyrl.models.runtime import has_saved_tokenizer

DEFAULT_BASE = "albert-large-v1"
_CONFIG_FILE = "storyrl_coherence.json"
_WEIGHTS_FILE = "model.safetensors"


def encode_pairs(tokenizer, pairs: list[tuple[str, str]], max_length: int = 512) -> dict[str, torch.Tensor]:
    """Batch tensors for ``[CLS] a [SEP] b [SEP]`` with token types 0/1,
    padded to the longest pair; over-long pairs keep the end of ``a`` and all
    of ``b`` (see module docs)."""
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    firsts = tokenizer([a for a, _ in pairs], add_special_tokens=False)["input_ids"]
    seconds = tokenizer([b for _, b in pairs], add_special_tokens=False)["input_ids"]
    rows, types = [], []
    for a, b in zip(firsts, seconds):
        b = b[: max_length - 3]
        room = max_length - 3 - len(b)
        a = a[max(0, len(a) - room) :] if room > 0 else []
        rows.append([cls_id, *a, sep_id, *b, sep_id])
        types.append([0] * (len(a) + 2) + [1] * (len(b) + 1))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, (row, typ) in enumerate(zip(rows, types)):
        input_ids[k, : len(row)] = torch.tensor(row)
        token_type_ids[k, : len(typ)] = torch.tensor(typ)
        attention_mask[k, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


class CoherenceModel(nn.Module):
    """ALBERT + dropout + ``Linear(hidden, 2)`` on the pooled output. The
    attribute names match the authors' state dict (``albert_model.*``,
    ``linear.*``)."""

    def __init__(self, albert_model, dropout: float = 0.4) -> None:
        super().__init__()
        self.albert_model = albert_model
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(albert_model.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        pooled = self.albert_model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).pooler_output
        return self.linear(self.dropout(pooled))

    # -- construction and storage ------------------------------------------------
    @classmethod
    def from_config(cls, albert_config, dropout: float = 0.4) -> CoherenceModel:
        """Random weights (tests, or training from scratch)."""
        from transformers import AlbertModel

        return cls(AlbertModel(albert_config), dropout)

    @classmethod
    def from_base(cls, name_or_path: str = DEFAULT_BASE, dropout: float = 0.4) -> CoherenceModel:
        """Pretrained ALBERT (hub name or local directory) with a new head: the
        starting point for training."""
        from transformers import AlbertModel

        from storyrl.models.hub import require_hub_model

        require_hub_model(name_or_path, what="ALBERT base model")
        return cls(AlbertModel.from_pretrained(name_or_path), dropout)

    def save_pretrained(self, directory, tokenizer=None) -> None:
        """storyrl's format: ALBERT config, head settings, safetensors weights
        and (optionally) the tokenizer, all in ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.albert_model.config.save_pretrained(directory)
        meta = {"format": "storyrl-coherence", "version": 1, "dropout": self.dropout.p}
        (directory / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / _WEIGHTS_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    @classmethod
    def from_pretrained(cls, directory) -> tuple[CoherenceModel, Any]:
        """A directory written by :meth:`save_pretrained`: (model, tokenizer
        or None when none was saved)."""
        from safetensors.torch import load_file
        from transformers import AlbertConfig

        directory = Path(directory)
        meta_path = directory / _CONFIG_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{directory}: not a storyrl coherence model (no {_CONFIG_FILE})")
        meta = json.loads(meta_path.read_text())
        model = cls.from_config(AlbertConfig.from_pretrained(directory), meta.get("dropout", 0.4))
        model.load_state_dict(load_file(str(directory / _WEIGHTS_FILE)))
        return model.eval(), _load_tokenizer(directory, required=False) if has_saved_tokenizer(directory) else None

    @classmethod
    def from_authors_checkpoint(
        cls, path, base_model: str = DEFAULT_BASE, trust_checkpoint: bool = False
    ) -> CoherenceModel:
        """The authors' released RoViST-C checkpoint. ``base_model`` gives the
        ALBERT config (``albert-large-v1`` for theirs). The file holds an
        ``argparse.Namespace``, so it is unpickled only with
        ``trust_checkpoint=True``."""
        from transformers import AlbertConfig

        checkpoint = _load_authors_file(path, trust_checkpoint)
        state = checkpoint.get("model") if isinstance(checkpoint, dict) else None
        if not isinstance(state, dict) or not any(k.startswith("albert_model.") for k in state):
            raise ValueError(f"{path}: not a RoViST-C checkpoint (expected {{'model': state_dict with albert_model.*}})")
        opt = checkpoint.get("opt")
        dropout = float(getattr(opt, "dropout_prob", 0.4))
        model = cls.from_config(AlbertConfig.from_pretrained(base_model), dropout)
        # Older transformers kept a position_ids buffer in the state dict.
        state = {k: v for k, v in state.items() if not k.endswith("position_ids")}
        model.load_state_dict(state)
        return model.eval()


def _load_authors_file(path, trust: bool):
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        if trust:
            raise
        raise ValueError(
            f"{path}: the checkpoint contains pickled Python objects (the authors' argparse.Namespace); "
            "unpickling can run code, so storyrl loads it only with trust_checkpoint=True "
            "(coherence reward option / --trust-checkpoint) for files you trust"
        ) from exc


def _load_tokenizer(name_or_path, required: bool = True):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError):
        if required:
            raise
        return None


def load_coherence_model(model: str, base_model: str = DEFAULT_BASE, trust_checkpoint: bool = False):
    """(model, tokenizer) from a storyrl directory or the authors' checkpoint
    file; the tokenizer comes from the directory, else from ``base_model``."""
    from storyrl.models.hub import require_hub_model

    path = Path(model)
    hint = "set the coherence reward's base_model option to a local copy's directory (--base-model DIR)"
    if path.is_dir():
        net, tokenizer = CoherenceModel.from_pretrained(path)
    elif path.is_file():
        require_hub_model(base_model, what="ALBERT config", hint=hint)
        net, tokenizer = CoherenceModel.from_authors_checkpoint(path, base_model, trust_checkpoint), None
    else:
        raise FileNotFoundError(
            f"coherence model {model!r} not found: give a storyrl coherence directory "
            "(storyrl train coherence) or the authors' RoViST-C checkpoint file"
        )
    if tokenizer is None:
        require_hub_model(base_model, what="ALBERT tokenizer", hint=hint)
        tokenizer = _load_tokenizer(base_model)
    return net, tokenizer
