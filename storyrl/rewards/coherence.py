"""RoViST-C coherence (Wang et al., 2022), as computed for d_HM (Surikuchi et
al., 2024): an ALBERT sentence-order-prediction model scores how likely each
sentence is to follow what came before it.

For sentence i >= 1 of a story (storyrl's NLTK-compatible splitter), the
model reads ``[CLS] first [SEP] sentence_i [SEP]`` and the pair's score is
P(class 1 = "follows"); the model, its input encoding (token types, how
over-long pairs are cut) and its checkpoint formats are in
:mod:`storyrl.models.coherence`. ``first`` is all earlier sentences joined by
spaces (``mode="prefix"``, the d_HM variant, default) or only the previous
sentence (``mode="adjacent"``, the original RoViST). As in the authors'
scorer, a pair whose first segment equals the sentence scores 0. Story score
= mean over its pairs; a story with fewer than 2 sentences is unscorable
(NaN).

Models: storyrl's own directories (``CoherenceModel.save_pretrained``, written
by ``storyrl train coherence``), or the authors' released checkpoint, which is
only unpickled with ``trust_checkpoint=True`` because unpickling can run code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.config import option
from storyrl.rewards.base import ModelConfig, Reward

MODES = ("prefix", "adjacent")


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


@dataclass
class CoherenceConfig(ModelConfig):
    model: str | None = option(None, "RoViST-C model: a storyrl coherence directory (storyrl train coherence) or "
                               "the authors' checkpoint file.", path="any")
    # = storyrl.models.coherence.DEFAULT_BASE, not imported: that module loads torch
    base_model: str = option("albert-large-v1", "ALBERT config/tokenizer source for the authors' checkpoint.")
    trust_checkpoint: bool = option(False, "Allow unpickling the authors' RoViST-C checkpoint (only for files you "
                                    "trust).")
    mode: str = option("prefix", "Sentence pairs: prefix (d_HM) or adjacent (original RoViST).", choices=MODES)
    batch_size: int = option(64, "At most this many sentence pairs per forward pass (sorted by length).", min=1)
    max_length: int = option(512, "Token limit of a pair (ALBERT: 512).", min=8)
    max_batch_tokens: int | None = option(None, "Padded tokens per forward pass (default 512 on CPU, where big "
                                          "batches are slower, 32768 on CUDA).", min=1)


class Coherence(Reward):
    """RoViST-C coherence as a reward: mean P(sentence follows), in [0, 1].
    Options: :class:`CoherenceConfig`."""

    name = "coherence"
    higher_is_better = True
    value_range = (0.0, 1.0)
    config_class = CoherenceConfig

    def _loaded(self):
        """(model, tokenizer, device, dtype), loaded once per process."""
        from storyrl.models.coherence import encode_pairs, load_coherence_model
        from storyrl.models.runtime import (autocast_forward, check_runs, resolve_device, resolve_dtype,
                                            resolve_precision, shared_model)

        if self.model is None:
            raise ValueError(
                "coherence needs a trained model: model=<storyrl coherence directory> "
                "(storyrl train coherence) or the authors' checkpoint with trust_checkpoint=True"
            )
        device = resolve_device(self.device)
        precision = resolve_precision(self.precision, device)
        dtype = resolve_dtype(precision, device)

        def load():
            net, tokenizer = load_coherence_model(self.model, self.base_model, self.trust_checkpoint)
            # The weights are held in the precision's dtype (what really runs;
            # half the memory at fp16/bf16), and the forward pass runs under
            # autocast too, which keeps its fp32 ops (softmax, layer norm on
            # CUDA) in fp32.
            net = net.to(device, dtype).eval()
            check_runs(lambda: autocast_forward(net, encode_pairs(tokenizer, [("a b.", "c d.")]), device, dtype),
                       f"coherence model {self.model}", precision, device)
            return net, tokenizer

        key = ("coherence", self.model, self.base_model, self.trust_checkpoint, str(device), precision)
        net, tokenizer = shared_model(key, load)
        return net, tokenizer, device, dtype

    def _setup(self) -> None:
        self._loaded()

    def pair_probabilities(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """P("follows") for each (first segment, sentence) pair, batched:
        distinct pairs only, sorted by length to limit padding."""
        import torch

        from storyrl.models.coherence import encode_pairs
        from storyrl.models.runtime import autocast_forward, check_finite, resolve_precision

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
        for index in batches:
            batch = encode_pairs(tokenizer, [unique[k] for k in index], self.max_length)
            logits = autocast_forward(net, batch, device, dtype)
            check_finite(logits, f"coherence model {self.model}", resolve_precision(self.precision, device))
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
