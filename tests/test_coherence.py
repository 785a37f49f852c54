"""RoViST-C coherence: pairs, truncation, parity with a plain per-pair
computation on a synthetic checkpoint in the authors' format (tiny ALBERT),
batching invariance, loading paths and failures."""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import pytest
import torch
from conftest import shared_path
from tiny_models import albert_tokenizer, coherence_model

import storyrl  # noqa: F401  (before transformers on CPU-only torchvision)
from storyrl.models.coherence import CoherenceModel, encode_pairs
from storyrl.rewards import create_reward
from storyrl.rewards.coherence import sentence_pairs
from storyrl.text import split_sentences

TEXTS = [
    "The dog ran to the park. A cat sat on the wall. It rained all day. We went home.",
    "The bride smiled. The groom laughed. Everyone danced at the party.",
    "one sentence only .",
    "the dog ran . the dog ran .",
    "We went to the beach. The sky was blue.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny ALBERT coherence model saved in both formats."""
    root = tmp_path_factory.mktemp("coherence")
    tokenizer = albert_tokenizer(TEXTS)
    # A head that separates the classes a little, so scores vary.
    model = coherence_model(seed=0, size="small", head_scale=20).eval()
    config = model.albert_model.config
    model.save_pretrained(root / "storyrl", tokenizer)
    base = root / "base"  # stands in for albert-large-v1: config + tokenizer
    config.save_pretrained(base)
    tokenizer.save_pretrained(base)
    authors = root / "rovist_c.pt"
    torch.save({"epoch": 7, "model": model.state_dict(), "valid_loss": 0.3, "valid_acc": 0.9, "train_loss": 0.2,
                "train_acc": 0.95, "opt": argparse.Namespace(hidden_dim=32, dropout_prob=0.4)}, authors)
    return {"model": model, "tokenizer": tokenizer, "dir": root / "storyrl", "base": base, "authors": authors}


def reference_scores(model, tokenizer, text, mode="prefix"):
    """The authors' way: one forward pass per pair, the tokenizer's own pair encoding."""
    sents = split_sentences(text)
    if len(sents) < 2:
        return math.nan
    scores = []
    for i in range(1, len(sents)):
        first = " ".join(sents[:i]) if mode == "prefix" else sents[i - 1]
        if first.strip() == sents[i].strip():
            scores.append(0.0)
            continue
        enc = tokenizer(first, sents[i], return_tensors="pt")
        with torch.no_grad():
            logits = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
        scores.append(torch.softmax(logits, -1)[0, 1].item())
    return float(np.mean(scores))


def test_sentence_pairs():
    s = ["A.", "B.", "C."]
    assert sentence_pairs(s, "prefix") == [("A.", "B."), ("A. B.", "C.")]
    assert sentence_pairs(s, "adjacent") == [("A.", "B."), ("B.", "C.")]
    assert sentence_pairs(["A."]) == []
    with pytest.raises(ValueError):
        sentence_pairs(s, "random")


def test_encoding_and_truncation(tiny):
    tok = tiny["tokenizer"]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, second = "the dog ran to the park . a cat sat on the wall .", "it rained all day ."
    full = encode_pairs(tok, [(first, second)], max_length=512)
    reference = tok(first, second, return_tensors="pt")
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(full[key], reference[key])
    cut = encode_pairs(tok, [(first, second)], max_length=12)["input_ids"][0].tolist()
    # 12 = [CLS] + 4 prefix tokens + [SEP] + 5 sentence tokens + [SEP]: the END of the prefix survives.
    assert cut == [tok.cls_token_id, *ids(first)[-4:], tok.sep_token_id, *ids(second), tok.sep_token_id]
    # A prefix longer than half the room but within the limit stays whole.
    long_first = " ".join(["the dog ran to the park ."] * 10)  # 70 tokens
    kept = encode_pairs(tok, [(long_first, second)], max_length=100)
    assert torch.equal(kept["input_ids"], tok(long_first, second, return_tensors="pt")["input_ids"])
    alone = encode_pairs(tok, [("a cat", "the dog ran to the park . it rained all day .")], max_length=8)
    assert alone["input_ids"][0].tolist() == [tok.cls_token_id, tok.sep_token_id, *ids("the dog ran to the park")[:5], tok.sep_token_id]
    assert alone["token_type_ids"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("source", ["authors", "storyrl"])
@pytest.mark.parametrize("mode", ["prefix", "adjacent"])
def test_matches_per_pair_reference(tiny, source, mode):
    if source == "authors":
        reward = create_reward("coherence", model=str(tiny["authors"]), base_model=str(tiny["base"]),
                               trust_checkpoint=True, mode=mode, batch_size=3)
    else:
        reward = create_reward("coherence", model=str(tiny["dir"]), mode=mode, batch_size=3)
    scores = reward.score(TEXTS)
    expected = [reference_scores(tiny["model"], tiny["tokenizer"], t, mode) for t in TEXTS]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert np.isnan(scores[2]) and scores[3] == 0.0  # one sentence; prefix equals the sentence
    finite = scores[np.isfinite(scores)]
    assert ((finite >= 0) & (finite <= 1)).all() and len(set(np.round(finite, 6))) > 2


def test_batched_equals_one_by_one(tiny):
    reward = create_reward("coherence", model=str(tiny["dir"]), batch_size=64)
    batch = reward.score(TEXTS)
    single = [reward.score([t])[0] for t in TEXTS]
    np.testing.assert_allclose(batch, single, atol=1e-5)
    assert reward.stats["reasons"]["fewer than 2 sentences"] == 2


def test_save_load_round_trip(tiny, tmp_path):
    model, tokenizer = CoherenceModel.from_pretrained(tiny["dir"])
    model.save_pretrained(tmp_path / "again", tokenizer)
    a = create_reward("coherence", model=str(tiny["dir"])).score(TEXTS)
    b = create_reward("coherence", model=str(tmp_path / "again")).score(TEXTS)
    np.testing.assert_array_equal(a, b)


def test_loading_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="trust_checkpoint=True"):
        create_reward("coherence", model=str(tiny["authors"]), base_model=str(tiny["base"])).score(TEXTS[:1])
    with pytest.raises(ValueError, match="needs a trained model"):
        create_reward("coherence").score(TEXTS[:2])
    with pytest.raises(FileNotFoundError, match="not found"):
        create_reward("coherence", model=str(tmp_path / "nope")).score(TEXTS[:1])
    bogus = tmp_path / "bogus.pt"
    torch.save({"model": {"x": torch.zeros(1)}}, bogus)
    with pytest.raises(ValueError, match="not a RoViST-C checkpoint"):
        create_reward("coherence", model=str(bogus), base_model=str(tiny["base"])).score(TEXTS[:1])
    with pytest.raises(ValueError, match="mode"):
        create_reward("coherence", mode="sideways")


def test_vwp_parity_with_the_authors_checkpoint():
    """The published d_HM coherence scores. Needs the authors' RoViST-C
    checkpoint (STORYRL_ROVIST_C_CHECKPOINT) and albert-large-v1 (hub cache)."""
    import csv
    import json

    checkpoint = os.environ.get("STORYRL_ROVIST_C_CHECKPOINT")
    if not checkpoint:
        pytest.skip("needs the authors' RoViST-C checkpoint (STORYRL_ROVIST_C_CHECKPOINT) and albert-large-v1")
    reward = create_reward("coherence", model=checkpoint, trust_checkpoint=True)
    for name in ("gt_test", "llava_vc_p3"):
        stories = json.loads(shared_path("dhm", "vwp", f"{name}.json").read_text())
        with open(shared_path("dhm", "vwp", f"{name}_C.csv")) as fh:
            published = {row["story_id"]: float(row["C_score"]) for row in csv.DictReader(fh) if row["C_score"]}
        ids = list(published)
        scores = reward.score([stories[i] for i in ids])
        np.testing.assert_allclose(scores, [published[i] for i in ids], atol=1e-4)
