"""RoViST-C coherence (Wang et al., 2022), as computed for d_HM (Surikuchi et
al., 2024): an ALBERT sentence-order-prediction model scores how likely each
sentence is to follow what came before it.

For sentence i >= 1 of a story (storyrl's NLTK-compatible splitter), the
model reads ``[CLS] first [SEP] sentence_i [SEP]`` (token types 0 for
``[CLS] first [SEP]``, 1 for ``sentence_i [SEP]``) and the pair's score is
P(class 1 = "follows") from a linear head on ALBERT's pooled output. ``first``
is all earlier sentences joined by spaces (``mode="prefix"``, the d_HM
variant, default) or only the previous sentence (``mode="adjacent"``, the
original RoViST). As in the authors' scorer, a pair whose first segment
equals the sentence scores 0. Story score = mean over its pairs; a story with
fewer than 2 sentences is unscorable (NaN).

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
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from storyrl.rewards.base import Reward

MODES = ("prefix", "adjacent")
DEFAULT_BASE = "albert-large-v1"
_CONFIG_FILE = "storyrl_coherence.json"
_WEIGHTS_FILE = "model.safetensors"


def sentence_pairs(sentences: list[str], mode: str = "prefix") -> list[tuple[str, str]]:
    """(first segment, sentence) for every sentence after the first."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "prefix":
        return [(" ".join(sentences[:i]), sentences[i]) for i in range(1, len(sentences))]
    return [(sentences[i - 1], sentences[i]) for i in range(1, len(sentences))]


def story_coherence(pair_scores: list[float]) -> float:
    """Mean over the story's pair scores; NaN without pairs."""
    return float(np.mean(pair_scores)) if len(pair_scores) else math.nan


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
        return model.eval(), _load_tokenizer(directory, required=False)

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
    path = Path(model)
    if path.is_dir():
        net, tokenizer = CoherenceModel.from_pretrained(path)
    elif path.is_file():
        net, tokenizer = CoherenceModel.from_authors_checkpoint(path, base_model, trust_checkpoint), None
    else:
        raise FileNotFoundError(
            f"coherence model {model!r} not found: give a storyrl coherence directory "
            "(storyrl train coherence) or the authors' RoViST-C checkpoint file"
        )
    return net, tokenizer if tokenizer is not None else _load_tokenizer(base_model)


class Coherence(Reward):
    """RoViST-C coherence as a reward: mean P(sentence follows), in [0, 1].

    Args:
        model: a storyrl coherence directory or the authors' checkpoint file.
        base_model: ALBERT config/tokenizer source for the authors' checkpoint
            (default albert-large-v1).
        trust_checkpoint: allow unpickling the authors' checkpoint.
        mode: "prefix" (d_HM, default) or "adjacent" (original RoViST).
        device, precision: as for the CLIP rewards ("auto": fp16 on CUDA).
        batch_size: at most this many sentence pairs per forward pass
            (pairs are sorted by length).
        max_length: token limit of a pair (ALBERT: 512).
        max_batch_tokens: padded tokens per forward pass (default 512 on
            CPU, where big batches are slower, 32768 on CUDA).
    """

    name = "coherence"
    higher_is_better = True
    value_range = (0.0, 1.0)

    def __init__(
        self,
        model: str | None = None,
        base_model: str = DEFAULT_BASE,
        trust_checkpoint: bool = False,
        mode: str = "prefix",
        device: str | None = None,
        precision: str = "auto",
        batch_size: int = 64,
        max_length: int = 512,
        max_batch_tokens: int | None = None,
    ) -> None:
        super().__init__()
        from storyrl.models import check_run_options

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_run_options(precision, batch_size)
        if max_length < 8:
            raise ValueError(f"max_length must be at least 8, got {max_length}")
        self.model, self.base_model, self.trust_checkpoint = model, base_model, trust_checkpoint
        self.mode, self.device, self.precision = mode, device, precision
        self.batch_size, self.max_length, self.max_batch_tokens = batch_size, max_length, max_batch_tokens

    def config(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "base_model": self.base_model,
            "trust_checkpoint": self.trust_checkpoint,
            "mode": self.mode,
            "device": self.device,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "max_batch_tokens": self.max_batch_tokens,
        }

    def _loaded(self):
        """(model, tokenizer, device, dtype), loaded once per process."""
        from storyrl.models import resolve_device, resolve_precision, shared_model

        if self.model is None:
            raise ValueError(
                "coherence needs a trained model: model=<storyrl coherence directory> "
                "(storyrl train coherence) or the authors' checkpoint with trust_checkpoint=True"
            )
        device = resolve_device(self.device)
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            resolve_precision(self.precision, device)
        ]

        def load():
            net, tokenizer = load_coherence_model(self.model, self.base_model, self.trust_checkpoint)
            return net.to(device).eval(), tokenizer

        key = ("coherence", self.model, self.base_model, self.trust_checkpoint, str(device))
        net, tokenizer = shared_model(key, load)
        return net, tokenizer, device, dtype

    def _setup(self) -> None:
        self._loaded()

    def pair_probabilities(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """P("follows") for each (first segment, sentence) pair, batched:
        distinct pairs only, sorted by length to limit padding."""
        net, tokenizer, device, dtype = self._loaded()
        unique = list(dict.fromkeys(pairs))
        lengths = [len(a) + len(b) for a, b in unique]
        order = sorted(range(len(unique)), key=lengths.__getitem__)
        probs = np.empty(len(unique))
        # Token budget per batch (~4 characters a token): on CPU large padded
        # batches are memory-bound and slower than small ones (measured in
        # benchmarks/coherence.py); GPUs want them big.
        budget = self.max_batch_tokens or (32768 if device.type == "cuda" else 512)
        batches, start = [], 0
        while start < len(order):
            end = start + 1
            while end < len(order) and end - start < self.batch_size and (end - start + 1) * lengths[order[end]] <= 4 * budget:
                end += 1
            batches.append(order[start:end])
            start = end
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        with torch.inference_mode(), autocast:
            for index in batches:
                batch = encode_pairs(tokenizer, [unique[k] for k in index], self.max_length)
                logits = net(**{k: v.to(device) for k, v in batch.items()}).float()
                probs[index] = torch.softmax(logits, dim=-1)[:, 1].cpu().numpy()
        row = {p: k for k, p in enumerate(unique)}
        return probs[[row[p] for p in pairs]] if pairs else probs

    def _score_batch(self, stories: list[str], **_: Any) -> np.ndarray:
        from storyrl.text import split_sentences

        story_pairs = [sentence_pairs(split_sentences(s), self.mode) for s in stories]
        # The authors' scorer gives 0 to a pair whose first segment is the sentence itself.
        to_score = [p for pairs in story_pairs for p in pairs if p[0].strip() != p[1].strip()]
        probs = dict(zip(to_score, self.pair_probabilities(to_score))) if to_score else {}
        out = np.empty(len(stories))
        for i, pairs in enumerate(story_pairs):
            if not pairs:
                out[i] = self._unscorable("fewer than 2 sentences")
                continue
            out[i] = story_coherence([0.0 if a.strip() == b.strip() else probs[(a, b)] for a, b in pairs])
        return out
