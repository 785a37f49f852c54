"""GROOViST: formula, full pipeline against an independent in-test computation
with a tiny random CLIP, batching/caching invariance, failures and ablations."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from conftest import shared_path

import storyrl  # noqa: F401  (torchvision fallback before open_clip)
from storyrl.rewards import create_reward
from storyrl.rewards.groovist import (
    THETA_PRESETS,
    calibrate_theta,
    groovist_phrase_scores,
    groovist_score,
    resolve_theta,
)


@pytest.fixture(scope="session")
def ratings_path():
    return str(shared_path("groovist", "concreteness_ratings.csv"))


@pytest.fixture(scope="session")
def pronouns_path():
    return str(shared_path("groovist", "all_pronouns.txt"))


def make(tiny_clip, ratings_path, pronouns_path, **options):
    options = {"theta": 0.5, "concreteness": ratings_path, "pronouns": pronouns_path, **options}
    return create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, **options)


# -- formula -------------------------------------------------------------------


def test_phrase_scores_by_hand():
    # s = 2.5 cos: 0.75 >= 0.6 kept; 0.5 < 0.6 becomes -(0.6 - 0.5) = -0.1; then weights.
    scores = groovist_phrase_scores(np.array([0.3, 0.2]), np.array([4.0, 1.0]), theta=0.6)
    assert scores == pytest.approx([3.0, -0.1])
    assert groovist_score(np.array([0.3, 0.2]), np.array([4.0, 1.0]), 0.6) == pytest.approx(1.45)
    assert groovist_score(np.array([0.3, 0.2]), np.array([4.0, 1.0]), 0.6, penalize=False) == pytest.approx(1.75)
    assert groovist_score(np.array([0.3, 0.2]), np.array([4.0, 1.0]), 0.6, bounded=True) == pytest.approx(math.tanh(1.45))
    assert math.isnan(groovist_score(np.array([]), np.array([]), 0.6))


def test_theta_presets():
    assert resolve_theta("VIST") == 0.6159241924121119
    assert resolve_theta("vwp") == THETA_PRESETS["vwp"] == 0.6193549522736276
    assert resolve_theta("0.61") == 0.61 and resolve_theta(0.5) == 0.5
    with pytest.raises(ValueError, match="presets"):
        resolve_theta("imagenet")


def test_thresholds_match_authors_file():
    import configparser

    ini = configparser.ConfigParser()
    ini.read(shared_path("groovist", "thresholds.ini"))
    for section in ini.sections():
        assert THETA_PRESETS[section.lower()] == ini[section].getfloat("theta")


# -- full pipeline vs an independent computation -----------------------------------


def _ratings(path):
    with open(path, encoding="utf-8-sig") as fh:
        rows = list(csv.reader(fh, delimiter=";"))
    return {w: float(v) for w, v in rows[1:]}


def independent_groovist(model_dir, phrases, boxes_per_image, theta, ratings):
    """The published algorithm, step by step, with open_clip used directly."""
    import open_clip
    import torch
    from PIL import Image

    model, _, preprocess = open_clip.create_model_and_transforms(model_dir)
    tokenizer = open_clip.get_tokenizer(model_dir)
    model.eval()
    with torch.no_grad():
        t = model.encode_text(tokenizer(phrases))
        t = t / t.norm(dim=-1, keepdim=True)
        crops = []
        for path, boxes in boxes_per_image:
            img = Image.open(path).convert("RGB")
            crops += [preprocess(img if box is None else img.crop(tuple(round(v) for v in box))) for box in boxes]
        v = model.encode_image(torch.stack(crops))
        v = v / v.norm(dim=-1, keepdim=True)
    best = (t @ v.T).max(dim=1).values.double().numpy()
    total = 0.0
    for phrase, cos in zip(phrases, best):
        # WordNet lemmas, annotated by hand for the words of this test.
        words = [{"bottles": "bottle"}.get(w, w) if w not in ratings else w for w in phrase.split(" ")]
        found = [ratings[w] for w in words if w in ratings]
        weight = sum(found) / len(found) if found else 1.0
        s = 2.5 * cos
        s = s if s >= theta else -(theta - s)
        total += s * weight
    return total / len(phrases), best


@pytest.mark.parametrize("pipeline", ["exact", "fast"])
def test_full_pipeline_matches_hand_computation(tiny_clip, images, ratings_path, pronouns_path, tmp_path, pipeline):
    # A detector-style region table: 2 boxes for image 0, 3 for image 1, in file order.
    table = tmp_path / "regions.csv"
    boxes = {"img0": [[0.0, 0.0, 20.0, 20.0], [10.5, 5.2, 40.0, 38.0]], "img1": [[1, 2, 30, 30], [0, 0, 48, 40], [20, 10, 47, 39]]}
    with table.open("w") as fh:
        fh.write("image_name,image_id,bbox,object,score\n")
        for iid, bs in boxes.items():
            for b in bs:
                fh.write(f'{iid}.png,{iid},"[{b[0]}, {b[1]}, {b[2]}, {b[3]}]",thing,0.9\n')
    reward = make(tiny_clip, ratings_path, pronouns_path, region_table=str(table), theta=0.4,
                  image_pipeline=pipeline)
    assert reward.regions == "table"
    # NPs in the authors' file format: repeats and pronouns are dropped before scoring.
    raw = ["the church", "a dog", "it", "the church", "old bottles"]
    score = reward.score(["x"], images=[images[:2]], noun_phrases=[raw])[0]
    expected, _ = independent_groovist(
        tiny_clip, ["the church", "a dog", "old bottles"],
        [(images[0], boxes["img0"]), (images[1], boxes["img1"])], 0.4, _ratings(ratings_path),
    )
    # The fast pipeline's pixels differ from PIL's by a level or two in ~1% of the values: unit
    # embeddings move by ~1e-4 (tests/test_image_pipeline.py), 2.5 * cosine x weight (< 5) by < 5e-3.
    assert score == pytest.approx(expected, abs=1e-5 if pipeline == "exact" else 5e-3)


def test_batched_equals_one_by_one(tiny_clip, images, ratings_path, pronouns_path):
    reward = make(tiny_clip, ratings_path, pronouns_path)
    nps = [["the dog", "a red car"], ["the sky", "the dog", "trees"], ["people"], ["a church", "the sky"]]
    seqs = [images, images[:2], images[1:], images]
    batch = reward.score(["s"] * 4, images=seqs, noun_phrases=nps)
    from storyrl.models.runtime import release_models

    release_models()  # cold caches for the one-by-one pass
    single = [make(tiny_clip, ratings_path, pronouns_path).score(["s"], images=[s], noun_phrases=[n])[0] for s, n in zip(seqs, nps)]
    assert np.all(np.isfinite(batch))
    np.testing.assert_allclose(batch, single, atol=1e-5, rtol=0)


def test_every_region_and_phrase_embedded_once(tiny_clip, images, ratings_path, pronouns_path):
    from storyrl.models.runtime import release_models

    release_models()
    reward = make(tiny_clip, ratings_path, pronouns_path)
    nps = [["the dog", "a cat"]] * 8  # 8 GRPO candidates of one image sequence
    reward.score(["s"] * 8, images=[images] * 8, noun_phrases=nps)
    stats = reward.embedder.stats
    assert stats["regions_embedded"] == 3 * 10  # 3 images x (3x3 grid + whole)
    assert stats["texts_embedded"] == 2
    reward.score(["s"], images=[images], noun_phrases=[["the dog"]])
    assert stats["regions_embedded"] == 30 and stats["texts_embedded"] == 2


def test_disk_cache_reused(tiny_clip, images, ratings_path, pronouns_path, tmp_path):
    from storyrl.models.runtime import release_models

    release_models()
    reward = make(tiny_clip, ratings_path, pronouns_path, cache_dir=str(tmp_path / "cache"))
    first = reward.score(["s"], images=[images], noun_phrases=[["the dog"]])
    release_models()  # a new process: empty memory caches, same disk cache
    again = make(tiny_clip, ratings_path, pronouns_path, cache_dir=str(tmp_path / "cache"))
    second = again.score(["s"], images=[images], noun_phrases=[["the dog"]])
    assert again.embedder.stats["regions_from_disk"] == 30 and again.embedder.stats["regions_embedded"] == 0
    np.testing.assert_allclose(first, second, atol=1e-6)


def test_trimmed_text_encoder_equals_open_clip(tiny_clip):
    import open_clip
    import torch

    from storyrl.models.clip import _encode_text_trimmed

    model = open_clip.create_model(tiny_clip).eval()
    tokens = open_clip.get_tokenizer(tiny_clip)(["a dog", "the big old church near the lake", "x"])
    with torch.no_grad():
        np.testing.assert_allclose(_encode_text_trimmed(model, tokens), model.encode_text(tokens), atol=1e-5)


# -- failures ---------------------------------------------------------------------


def test_missing_image_makes_only_that_story_unscorable(tiny_clip, images, ratings_path, pronouns_path, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    reward = make(tiny_clip, ratings_path, pronouns_path)
    scores = reward.score(
        ["a", "b", "c", "d"],
        images=[images, [str(tmp_path / "missing.png")], [str(broken)], images],
        noun_phrases=[["the dog"], ["the dog"], ["the dog"], []],
    )
    assert np.isfinite(scores[0]) and np.isnan(scores[1:]).all()
    reasons = reward.stats["reasons"]
    assert reasons["images"] == 2 and reasons["no noun phrases"] == 1
    zero = make(tiny_clip, ratings_path, pronouns_path, on_failure="zero")
    assert zero.score(["a"], images=[[str(tmp_path / "missing.png")]], noun_phrases=[["dog"]])[0] == 0.0


def test_explain_lists_every_phrase(tiny_clip, images, ratings_path, pronouns_path):
    reward = make(tiny_clip, ratings_path, pronouns_path, theta=0.0)
    (details,) = reward.explain(["s"], images=[images], noun_phrases=[["the dog", "that", "the dog", "a red car"]])
    assert [p["phrase"] for p in details["phrases"]] == ["the dog", "a red car"]
    ratings = _ratings(ratings_path)
    for p in details["phrases"]:
        assert p["score"] == pytest.approx(2.5 * p["cosine"] * p["weight"])  # theta 0: no penalty
        assert 0 <= p["image_index"] < 3 and p["region"]
    assert details["phrases"][0]["weight"] == pytest.approx((ratings["the"] + ratings["dog"]) / 2)
    assert details["score"] == pytest.approx(np.mean([p["score"] for p in details["phrases"]]))


# -- ablations and options -------------------------------------------------------------


def test_ablations(tiny_clip, images, ratings_path, pronouns_path, tmp_path):
    nps = [["the dog", "a red car", "sky"]]
    base = make(tiny_clip, ratings_path, pronouns_path).explain(["s"], images=[images], noun_phrases=nps)[0]
    no_c = make(tiny_clip, ratings_path, pronouns_path, weighting="none").explain(["s"], images=[images], noun_phrases=nps)[0]
    assert [p["weight"] for p in no_c["phrases"]] == [1.0, 1.0, 1.0]
    no_p = make(tiny_clip, ratings_path, pronouns_path, penalty=False).explain(["s"], images=[images], noun_phrases=nps)[0]
    for a, b in zip(base["phrases"], no_p["phrases"]):
        assert b["score"] == pytest.approx(2.5 * a["cosine"] * a["weight"])
    corpus = tmp_path / "corpus.json"
    corpus.write_text('{"1": "the dog ran .", "2": "the sky was blue .", "3": "a dog and a car ."}')
    idf = make(tiny_clip, ratings_path, pronouns_path, weighting="idf", idf_corpus=str(corpus))
    (res,) = idf.explain(["s"], images=[images], noun_phrases=nps)
    # idf = log(N / (1 + df)), averaged over the phrase's words; N = 3.
    expected_dog = (math.log(3 / 3) + math.log(3 / 3)) / 2  # "the" in 2 stories, "dog" in 2
    assert res["phrases"][0]["weight"] == pytest.approx(expected_dog)
    assert res["phrases"][2]["weight"] == pytest.approx(math.log(3 / 2))  # "sky" in 1
    with pytest.raises(ValueError, match="idf_corpus"):
        make(tiny_clip, ratings_path, pronouns_path, weighting="idf")


def test_region_sources_and_bounded(tiny_clip, images, ratings_path, pronouns_path):
    whole = make(tiny_clip, ratings_path, pronouns_path, regions="whole")
    grid = make(tiny_clip, ratings_path, pronouns_path, regions="grid")
    nps = [["the dog", "a car"]]
    w = whole.explain(["s"], images=[images], noun_phrases=nps)[0]
    g = grid.explain(["s"], images=[images], noun_phrases=nps)[0]
    # The grid includes the whole image, so its best cosines can only be higher.
    for a, b in zip(w["phrases"], g["phrases"]):
        assert b["cosine"] >= a["cosine"] - 1e-6
    bounded = make(tiny_clip, ratings_path, pronouns_path, regions="whole", bounded=True)
    assert bounded.score(["s"], images=[images], noun_phrases=nps)[0] == pytest.approx(math.tanh(w["score"]), abs=1e-6)
    assert bounded.value_range == (-1.0, 1.0)


def test_image_ids_against_root(tiny_clip, images, ratings_path, pronouns_path):
    from pathlib import Path

    root = str(Path(images[0]).parent)
    by_path = make(tiny_clip, ratings_path, pronouns_path)
    by_id = make(tiny_clip, ratings_path, pronouns_path, image_root=root)
    a = by_path.score(["s"], images=[images], noun_phrases=[["the dog"]])
    b = by_id.score(["s"], image_ids=[["img0", "img1", "img2"]], noun_phrases=[["the dog"]])
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_pil_images_from_a_trl_dataset(tiny_clip, images, ratings_path, pronouns_path):
    from PIL import Image

    reward = make(tiny_clip, ratings_path, pronouns_path)
    pil = [Image.open(p).convert("RGB") for p in images]
    by_path = reward.score(["s"], images=[images], noun_phrases=[["the dog"]])
    by_pil = reward.score(["s"], images=[pil], noun_phrases=[["the dog"]])
    np.testing.assert_allclose(by_path, by_pil, atol=1e-6)


def test_spacy_extraction_path_with_a_fake_pipeline(tiny_clip, images, ratings_path, pronouns_path):
    """Without ``noun_phrases`` context the reward parses the story with spaCy;
    a hand-annotated Doc stands in for the (uninstallable) English pipeline."""
    import spacy
    from spacy.tokens import Doc

    from storyrl.noun_phrases import PhraseExtractor

    vocab = spacy.blank("en").vocab

    class FakeNlp:
        def pipe(self, texts, batch_size=64):
            for text in texts:
                assert text == "the dog saw a cat ."
                yield Doc(vocab, words=["the", "dog", "saw", "a", "cat", "."],
                          pos=["DET", "NOUN", "VERB", "DET", "NOUN", "PUNCT"],
                          heads=[1, 2, 2, 4, 2, 2], deps=["det", "nsubj", "ROOT", "det", "dobj", "punct"])

    reward = make(tiny_clip, ratings_path, pronouns_path)
    reward._extractor = PhraseExtractor(nlp=FakeNlp())
    parsed = reward.explain(["the dog saw a cat ."], images=[images])[0]
    assert [p["phrase"] for p in parsed["phrases"]] == ["the dog", "a cat"]
    given = reward.explain(["x"], images=[images], noun_phrases=[["the dog", "a cat"]])[0]
    assert parsed["score"] == pytest.approx(given["score"])


def test_calibrate_theta_is_mean_scaled_cosine(tiny_clip, images, ratings_path, pronouns_path):
    reward = make(tiny_clip, ratings_path, pronouns_path)
    nps = [["the dog", "a car"], ["the sky"], []]
    result = calibrate_theta(reward, ["a", "b", "c"], images=[images] * 3, noun_phrases=nps)
    cos = [p["cosine"] for d in reward.explain(["a", "b"], images=[images] * 2, noun_phrases=nps[:2]) for p in d["phrases"]]
    assert result["theta"] == pytest.approx(2.5 * np.mean(cos))
    assert result["n_phrases"] == 3 and result["n_unscorable"] == 1


def test_bad_configuration():
    with pytest.raises(ValueError, match="units"):
        create_reward("groovist", units="verbs")
    with pytest.raises(ValueError, match="regions"):
        create_reward("groovist", regions="detector")
    with pytest.raises(ValueError, match="on_failure"):
        create_reward("groovist", on_failure="skip")


def test_authors_noun_phrases_for_the_sample_stories(tiny_clip, images, ratings_path, pronouns_path):
    """The authors' NP file feeds the reward directly: story-level repeats
    ("many stalls") and pronouns ("that", "one", "this") are dropped."""
    import json

    nps = json.loads(shared_path("groovist", "sample_nphrases.json").read_text())
    reward = make(tiny_clip, ratings_path, pronouns_path)
    details = reward.explain(list(nps), images=[images] * 2, noun_phrases=list(nps.values()))
    phrases = [[p["phrase"] for p in d["phrases"]] for d in details]
    assert len(phrases[0]) == 17 - 1 - 2 and "many stalls" in phrases[0] and "that" not in phrases[0]
    assert phrases[1][0] == "the church" and "this" not in phrases[1]


def test_published_sample_scores_when_the_authors_assets_exist():
    """Parity with the authors' ``sample_scores.json``: needs their VIST region
    crops and CLIP ViT-B/32 OpenAI weights, neither of which can be fetched
    here. Set STORYRL_VIST_REGIONS to a folder holding ``vist_entities.csv``,
    ``vist-entities/`` and ``vist_sid_2_iids.json`` to run it."""
    import json
    import os
    from pathlib import Path

    folder = os.environ.get("STORYRL_VIST_REGIONS")
    if not folder:
        pytest.skip("needs the authors' VIST region crops (STORYRL_VIST_REGIONS) and CLIP ViT-B/32 OpenAI weights")
    folder = Path(folder)
    nps = json.loads(shared_path("groovist", "sample_nphrases.json").read_text())
    published = json.loads(shared_path("groovist", "sample_scores.json").read_text())
    sid_2_iids = json.loads((folder / "vist_sid_2_iids.json").read_text())
    reward = create_reward(
        "groovist", theta="vist", regions="crops", image_pipeline="exact",
        region_table=str(folder / "vist_entities.csv"),
        crops_dir=str(folder / "vist-entities"),
        concreteness=str(shared_path("groovist", "concreteness_ratings.csv")),
        pronouns=str(shared_path("groovist", "all_pronouns.txt")),
    )
    ids = list(published)
    scores = reward.score(ids, image_ids=[sid_2_iids[i] for i in ids], noun_phrases=[nps[i] for i in ids])
    # The authors ran CLIP in fp16 on GPU; fp32 on CPU differs in the 4th decimal at most.
    np.testing.assert_allclose(scores, [published[i] for i in ids], atol=2e-3)
