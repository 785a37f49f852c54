"""CLIPScore over an image sequence: the formula, the full reward against an
independent in-test computation with a tiny random CLIP, sentence/image
alignment, batching, failures, the TRL contract and the shared embedder."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import shared_path

import storyrl  # noqa: F401  (torchvision fallback before open_clip)
from storyrl.rewards import create_reward
from storyrl.rewards.clipscore import PREFIX, WEIGHT, clipscore_from_cosines, with_prefix
from storyrl.text import split_sentences

STORY = "A dog runs. The sky is blue. A car."


@pytest.fixture(scope="session")
def reference(tiny_clip):
    """open_clip used directly: model, preprocess and tokenizer of the tiny CLIP."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(tiny_clip)
    return model.eval(), preprocess, open_clip.get_tokenizer(tiny_clip)


def make(tiny_clip, **options):
    """The reward on the exact image pipeline (PIL and the model's transform, as the independent
    computations below and the authors do) unless ``image_pipeline`` says otherwise."""
    options = {"image_pipeline": "exact", **options}
    return create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, **options)


#: Score tolerance of the fast image pipeline against the PIL computation: its pixels differ by a
#: uint8 level or two in ~1% of the values, which moves the tiny CLIP's unit image embeddings by
#: ~1e-4 (tests/test_image_pipeline.py), a cosine by ~2e-4 and 2.5 * cosine by ~5e-4.
FAST_TOLERANCE = 1e-3


def pair_cosines(reference, texts, paths):
    """cos(text k, image k) for k < min(len(texts), len(paths)), straight from open_clip."""
    import torch
    from PIL import Image

    model, preprocess, tokenizer = reference
    m = min(len(texts), len(paths))
    with torch.no_grad():
        t = model.encode_text(tokenizer(list(texts[:m])))
        t = t / t.norm(dim=-1, keepdim=True)
        v = model.encode_image(torch.stack([preprocess(Image.open(p).convert("RGB")) for p in paths[:m]]))
        v = v / v.norm(dim=-1, keepdim=True)
    return (t * v).sum(dim=-1).double().numpy()


def independent_clipscore(reference, sentences, paths, prefix=PREFIX):
    """Hessel et al.'s CLIPScore per (sentence i, image i), mean over the images."""
    texts = [f"{prefix} {s}" if prefix else s for s in sentences]
    cos = pair_cosines(reference, texts, paths)
    return sum(2.5 * max(c, 0.0) for c in cos) / len(paths)


# -- formula ---------------------------------------------------------------------


def test_clipscore_from_cosines_by_hand():
    assert clipscore_from_cosines(np.array([0.2, -0.1]), 3) == pytest.approx(2.5 * 0.2 / 3)
    assert clipscore_from_cosines(np.array([0.2, 0.4, 0.1]), 3) == pytest.approx(2.5 * 0.7 / 3)
    assert clipscore_from_cosines(np.array([-0.3, -0.1]), 2) == 0.0
    assert clipscore_from_cosines(np.array([1.0, 1.0]), 2) == pytest.approx(WEIGHT)  # the maximum
    assert clipscore_from_cosines(np.array([]), 4) == 0.0  # images without a sentence score 0
    assert clipscore_from_cosines(np.array([0.5]), 1, w=1.0) == pytest.approx(0.5)
    assert math.isnan(clipscore_from_cosines(np.array([]), 0))


def test_prefix_joined_with_one_space():
    assert with_prefix("A dog runs.", PREFIX) == "A photo depicts A dog runs."
    assert with_prefix("A dog runs.", "A photo depicts  ") == "A photo depicts A dog runs."
    assert with_prefix("A dog runs.", None) == "A dog runs."
    assert with_prefix("A dog runs.", "") == "A dog runs."


# -- full reward vs an independent computation -----------------------------------------


@pytest.mark.parametrize("prefix", [PREFIX, None])
@pytest.mark.parametrize("pipeline", ["exact", "fast"])
def test_matches_independent_computation(tiny_clip, images, reference, prefix, pipeline):
    sentences = split_sentences(STORY)
    assert sentences == ["A dog runs.", "The sky is blue.", "A car."]
    options = {"image_pipeline": pipeline}
    reward = make(tiny_clip, prefix=prefix, **options) if prefix is None else make(tiny_clip, **options)
    assert reward.prefix == prefix
    score = reward.score([STORY], images=[images])[0]
    expected = independent_clipscore(reference, sentences, images, prefix)
    assert score == pytest.approx(expected, abs=1e-5 if pipeline == "exact" else FAST_TOLERANCE)
    assert 0.0 < score <= 2.5
    # The random tiny CLIP gives both signs here, so the max(cos, 0) clip is exercised.
    texts = [f"{prefix} {s}" if prefix else s for s in sentences]
    cos = pair_cosines(reference, texts, images)
    assert (cos < 0).any() and (cos > 0).any()


def test_prefix_changes_the_text_embedded(tiny_clip, images, reference):
    with_p = make(tiny_clip).score([STORY], images=[images])[0]
    without = make(tiny_clip, prefix=None).score([STORY], images=[images])[0]
    cos_p = pair_cosines(reference, [f"{PREFIX} {s}" for s in split_sentences(STORY)], images)
    cos_n = pair_cosines(reference, split_sentences(STORY), images)
    assert not np.allclose(cos_p, cos_n)  # the prefix does reach the text encoder
    assert with_p == pytest.approx(2.5 * np.maximum(cos_p, 0).sum() / 3, abs=1e-5)
    assert without == pytest.approx(2.5 * np.maximum(cos_n, 0).sum() / 3, abs=1e-5)


def test_fewer_sentences_than_images_missing_pairs_count_zero(tiny_clip, images, reference):
    reward = make(tiny_clip)
    seq = images[::-1]  # with this tiny CLIP the first pair has a positive cosine here
    one = reward.score(["A dog runs."], images=[seq])[0]
    cos = pair_cosines(reference, [f"{PREFIX} A dog runs."], seq)
    assert len(cos) == 1 and cos[0] > 0
    assert one == pytest.approx(2.5 * cos[0] / 3, abs=1e-5)  # divided by 3 images, not 1
    two = reward.score(["A dog runs. The sky is blue."], images=[seq])[0]
    cos2 = pair_cosines(reference, [f"{PREFIX} A dog runs.", f"{PREFIX} The sky is blue."], seq)
    assert two == pytest.approx(2.5 * np.maximum(cos2, 0).sum() / 3, abs=1e-5)
    # Saying less never helps: the 1-sentence story is at most the 2-sentence one.
    assert one <= two + 1e-9


def test_more_sentences_than_images_extras_ignored(tiny_clip, images, reference):
    reward = make(tiny_clip)
    long = STORY + " Birds sing loudly. The end."
    assert len(split_sentences(long)) == 5
    s_long = reward.score([long], images=[images])[0]
    s_three = reward.score([STORY], images=[images])[0]
    assert s_long == pytest.approx(s_three, abs=1e-6)
    s_two_imgs = reward.score([STORY], images=[images[:2]])[0]
    cos = pair_cosines(reference, [f"{PREFIX} {s}" for s in split_sentences(STORY)[:2]], images[:2])
    assert s_two_imgs == pytest.approx(2.5 * np.maximum(cos, 0).sum() / 2, abs=1e-5)


def test_sentence_i_pairs_with_image_i(tiny_clip, images, reference):
    """Order matters: reversing the images re-pairs the sentences."""
    reward = make(tiny_clip)
    rev = images[::-1]
    forward, backward = reward.score([STORY, STORY], images=[images, rev])
    assert backward == pytest.approx(independent_clipscore(reference, split_sentences(STORY), rev), abs=1e-5)
    assert abs(forward - backward) > 1e-4


# -- batching and failures ----------------------------------------------------------------


def test_batched_equals_one_by_one(tiny_clip, images):
    from storyrl.models.runtime import release_models

    stories = [STORY, "A dog runs.", "The sky is blue. A car. A dog runs. More.", STORY, "A cat sleeps. It dreams."]
    seqs = [images, images, images[1:], images[::-1], images[:1]]
    batch = make(tiny_clip).score(stories, images=seqs)
    release_models()  # cold caches for the one-by-one pass
    single = [make(tiny_clip).score([s], images=[q])[0] for s, q in zip(stories, seqs)]
    assert np.all(np.isfinite(batch))
    np.testing.assert_allclose(batch, single, atol=1e-5, rtol=0)
    assert np.all((batch >= 0.0) & (batch <= 2.5))


def test_unscorable_stories_are_nan_and_counted(tiny_clip, images, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    reward = make(tiny_clip)
    stories = [STORY, "A dog runs.", "A car.", "A car.", "", STORY, None]
    seqs = [images, [], [images[0], str(tmp_path / "missing.png")], [str(broken)], images, images[::-1], images]
    scores = reward.score(stories, images=seqs)
    assert np.isfinite(scores[[0, 5]]).all() and np.isnan(scores[[1, 2, 3, 4, 6]]).all()
    reasons = reward.stats["reasons"]
    assert reasons["images"] == 3  # no images, a missing file, an unreadable file
    assert reasons["no sentences"] == 1 and reasons["not text"] == 1
    assert reward.stats["scored"] == 2 and reward.stats["unscorable"] == 5
    # The good stories get exactly what they get on their own.
    alone = make(tiny_clip).score([STORY, STORY], images=[images, images[::-1]])
    np.testing.assert_allclose(scores[[0, 5]], alone, atol=1e-6)


def test_non_string_story_is_nan(tiny_clip, images):
    reward = make(tiny_clip)
    scores = reward.score([42, None, ["A dog."]], images=[images] * 3)
    assert np.isnan(scores).all() and reward.stats["reasons"]["not text"] == 3


def test_image_ids_and_pil_images_give_the_same_score(tiny_clip, images):
    from pathlib import Path

    from PIL import Image

    by_path = make(tiny_clip).score([STORY], images=[images])[0]
    by_id = make(tiny_clip, image_root=str(Path(images[0]).parent)).score([STORY], image_ids=[["img0", "img1", "img2"]])[0]
    by_pil = make(tiny_clip).score([STORY], images=[[Image.open(p).convert("RGB") for p in images]])[0]
    assert by_id == pytest.approx(by_path, abs=1e-6) and by_pil == pytest.approx(by_path, abs=1e-6)


# -- contract --------------------------------------------------------------------------------


def test_fast_image_pipeline_is_the_default():
    from storyrl.rewards.clipscore import CLIPScoreConfig

    assert CLIPScoreConfig().image_pipeline == "fast"


def test_value_range_and_config(tiny_clip):
    reward = make(tiny_clip, prefix=None)
    assert reward.value_range == (0.0, 2.5) and reward.higher_is_better and reward.__name__ == "clipscore"
    assert reward.config()["prefix"] is None and reward.config()["clip_model"] == tiny_clip
    assert make(tiny_clip).config()["prefix"] == PREFIX


def test_groovist_and_clipscore_share_one_embedder(tiny_clip):
    clip = make(tiny_clip)
    groov = create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, regions="whole")
    assert clip.embedder is groov.embedder
    # A different CLIP setting is a different embedder.
    assert make(tiny_clip, precision="fp32").embedder is not clip.embedder


@pytest.mark.parametrize("pipeline", ["exact", "fast"])
def test_shared_whole_image_embedded_once(tiny_clip, images, pipeline):
    from storyrl.models.runtime import release_models

    release_models()
    clip = make(tiny_clip, image_pipeline=pipeline)
    groov = create_reward(
        "groovist", clip_model=tiny_clip, clip_pretrained=None, regions="whole", theta=0.5,
        concreteness=str(shared_path("groovist", "concreteness_ratings.csv")),
        pronouns=str(shared_path("groovist", "all_pronouns.txt")), image_pipeline=pipeline,
    )
    assert clip.embedder is groov.embedder
    groov.score(["s"], images=[images], noun_phrases=[["the dog"]])
    stats = clip.embedder.stats
    assert stats["regions_embedded"] == 3
    clip.score([STORY], images=[images])
    assert stats["regions_embedded"] == 3  # the whole images were embedded once, by groovist
    assert stats["texts_embedded"] == 1 + 3
    # The other pipeline's vectors are not served: its scores embed the images again.
    make(tiny_clip, image_pipeline="fast" if pipeline == "exact" else "exact").score([STORY], images=[images])
    assert stats["regions_embedded"] == 6
