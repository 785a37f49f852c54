"""GROOViST paper criterion 1 (original story vs k random stories of other
sequences): deltas by hand with a fake reward, partner sampling, summary,
NaN handling, story-bound context, and one end-to-end run with groovist."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import shared_path

import storyrl  # noqa: F401  (torchvision fallback before open_clip)
from storyrl.eval import OriginalVsRandom, original_vs_random
from storyrl.rewards import Reward, create_reward

SUMMARY_KEYS = {
    "n", "k", "n_excluded", "delta_mean", "delta_std", "delta_quantiles",
    "frac_original_higher", "original_mean", "random_max_mean",
}


class Match(Reward):
    """1.0 when the story was written for the sequence ("story for <image>"),
    else len(story) / 100; NaN for a story containing "NaN". Records every
    (story, image, noun_phrases) it is asked to score."""

    name = "match"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def _score_batch(self, stories, images=None, noun_phrases=None, **_):
        out = []
        for i, story in enumerate(stories):
            nps = noun_phrases[i] if noun_phrases is not None else None
            self.seen.append((story, images[i], nps))
            if "NaN" in story:
                out.append(math.nan)
            else:
                out.append(1.0 if story == f"story for {images[i]}" else len(story) / 100)
        return np.asarray(out, dtype=float)


def own(seqs):
    return [f"story for {s}" for s in seqs]


def hand_deltas(stories, seqs, partners):
    def score(story, seq):
        return 1.0 if story == f"story for {seq}" else len(story) / 100

    return np.array([
        score(stories[j], seqs[j]) - max(score(stories[i], seqs[j]) for i in partners[j])
        for j in range(len(seqs))
    ])


# -- deltas by hand ----------------------------------------------------------------


def test_deltas_by_hand_all_partners():
    # n = 3, k = 2: every other story is a partner, whatever the seed.
    seqs = ["a", "bb", "ccc"]  # stories of 11, 12 and 13 characters
    result = original_vs_random(Match(), own(seqs), k=2, images=seqs)
    assert isinstance(result, OriginalVsRandom) and result.k == 2
    assert [sorted(p) for p in result.partners] == [[1, 2], [0, 2], [0, 1]]
    np.testing.assert_allclose(result.original, [1.0, 1.0, 1.0])
    np.testing.assert_allclose(result.random_max, [0.13, 0.13, 0.12])
    np.testing.assert_allclose(result.deltas, [0.87, 0.87, 0.88])


def test_deltas_by_hand_sampled_partners():
    seqs = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
    stories = own(seqs)
    result = original_vs_random(Match(), stories, k=2, seed=3, images=seqs)
    assert result.k == 2
    np.testing.assert_allclose(result.deltas, hand_deltas(stories, seqs, result.partners))
    # Own story scores 1; a random one scores its length / 100 (10 + len(seq) characters).
    for j, partners in enumerate(result.partners):
        assert result.deltas[j] == pytest.approx(1.0 - max(10 + len(seqs[i]) for i in partners) / 100)


def test_batch_size_does_not_change_results():
    seqs = ["a", "bb", "ccc", "dddd", "eeeee"]
    big = original_vs_random(Match(), own(seqs), k=3, seed=1, images=seqs)
    small = original_vs_random(Match(), own(seqs), k=3, seed=1, batch_size=4, images=seqs)
    assert small.partners == big.partners
    np.testing.assert_allclose(small.original, big.original)
    np.testing.assert_allclose(small.random_max, big.random_max)


# -- partners -----------------------------------------------------------------------


def test_partners_exclude_self_and_are_distinct():
    n = 12
    seqs = [f"s{j}" for j in range(n)]
    for seed in range(5):
        result = original_vs_random(Match(), own(seqs), k=5, seed=seed, images=seqs)
        assert len(result.partners) == n
        for j, partners in enumerate(result.partners):
            assert len(partners) == 5 and len(set(partners)) == 5
            assert j not in partners and all(0 <= i < n for i in partners)


def test_k_capped_at_n_minus_one():
    seqs = ["a", "bb", "ccc"]
    result = original_vs_random(Match(), own(seqs), k=5, images=seqs)
    assert result.k == 2 and all(len(p) == 2 for p in result.partners)
    assert result.summary()["k"] == 2
    two = original_vs_random(Match(), own(seqs[:2]), images=seqs[:2])
    assert two.k == 1 and two.partners == [[1], [0]]


def test_same_seed_same_partners():
    seqs = [f"s{j}" for j in range(20)]
    a = original_vs_random(Match(), own(seqs), k=4, seed=7, images=seqs)
    b = original_vs_random(Match(), own(seqs), k=4, seed=7, images=seqs)
    c = original_vs_random(Match(), own(seqs), k=4, seed=8, images=seqs)
    assert a.partners == b.partners
    assert a.partners != c.partners
    np.testing.assert_array_equal(a.deltas, b.deltas)


def test_every_pair_scored_once_with_the_sequence_context():
    seqs = ["a", "bb", "ccc", "dddd", "eeeee"]
    stories = own(seqs)
    reward = Match()
    result = original_vs_random(reward, stories, k=2, seed=0, images=seqs)
    expected = [(stories[j], seqs[j]) for j in range(5)]
    expected += [(stories[i], seqs[j]) for j in range(5) for i in result.partners[j]]
    assert [(s, im) for s, im, _ in reward.seen] == expected


# -- summary ------------------------------------------------------------------------------


def test_summary_keys_and_values():
    seqs = ["a", "bb", "ccc", "dddd", "eeeee"]
    result = original_vs_random(Match(), own(seqs), k=2, seed=2, images=seqs)
    d = result.deltas
    s = result.summary()
    assert set(s) == SUMMARY_KEYS
    assert s["n"] == 5 and s["k"] == 2 and s["n_excluded"] == 0
    assert s["delta_mean"] == pytest.approx(d.mean())
    assert s["delta_std"] == pytest.approx(d.std(ddof=1))
    assert set(s["delta_quantiles"]) == {"p05", "p25", "p50", "p75", "p95"}
    assert s["delta_quantiles"]["p50"] == pytest.approx(np.median(d))
    assert s["delta_quantiles"]["p05"] <= s["delta_quantiles"]["p50"] <= s["delta_quantiles"]["p95"]
    assert s["frac_original_higher"] == 1.0
    assert s["original_mean"] == pytest.approx(1.0)
    assert s["random_max_mean"] == pytest.approx(result.random_max.mean())
    assert s["delta_mean"] == pytest.approx(s["original_mean"] - s["random_max_mean"])


def test_frac_original_higher_counts_strict_wins():
    # Stories that do not match their sequence: the longest random story wins.
    seqs = ["a", "b", "c"]
    stories = ["x" * 10, "x" * 20, "x" * 30]  # 0.1, 0.2, 0.3 on any sequence
    result = original_vs_random(Match(), stories, k=2, images=seqs)
    np.testing.assert_allclose(result.deltas, [0.1 - 0.3, 0.2 - 0.3, 0.3 - 0.2])
    s = result.summary()
    assert s["frac_original_higher"] == pytest.approx(1 / 3)
    assert s["delta_std"] == pytest.approx(np.std(result.deltas, ddof=1))


# -- NaN handling ---------------------------------------------------------------------------


def test_nan_original_is_excluded():
    seqs = ["a", "bb", "ccc"]
    stories = ["story for a", "NaN story", "story for ccc"]
    result = original_vs_random(Match(), stories, k=2, images=seqs)
    assert math.isnan(result.original[1]) and math.isnan(result.deltas[1])
    # Story 1 is NaN as a partner too: the max is over the finite partners only.
    np.testing.assert_allclose(result.random_max[[0, 2]], [len("story for ccc") / 100, len("story for a") / 100])
    np.testing.assert_allclose(result.deltas[[0, 2]], [1 - 0.13, 1 - 0.11])
    s = result.summary()
    assert s["n"] == 2 and s["n_excluded"] == 1
    assert s["delta_mean"] == pytest.approx(np.mean([0.87, 0.89]))


def test_all_random_nan_is_excluded():
    result = original_vs_random(Match(), ["story for a", "NaN"], k=3, images=["a", "b"])
    assert result.k == 1
    assert result.original[0] == 1.0 and math.isnan(result.random_max[0])
    assert np.isnan(result.deltas).all()
    s = result.summary()
    assert s["n"] == 0 and s["k"] == 1 and math.isnan(s["delta_mean"])


def test_non_string_story_is_nan_not_an_error():
    seqs = ["a", "bb", "ccc"]
    result = original_vs_random(Match(), ["story for a", None, "story for ccc"], k=2, images=seqs)
    assert math.isnan(result.deltas[1]) and np.isfinite(result.deltas[[0, 2]]).all()
    assert result.summary()["n_excluded"] == 1


# -- context ---------------------------------------------------------------------------------


def test_noun_phrases_follow_the_story_not_the_sequence():
    seqs = ["a", "bb", "ccc", "dddd"]
    stories = own(seqs)
    nps = [[f"np of story {i}"] for i in range(4)]
    reward = Match()
    result = original_vs_random(reward, stories, k=3, seed=0, images=seqs, noun_phrases=nps)
    assert len(reward.seen) == 4 + 4 * 3
    for story, image, phrases in reward.seen:
        assert phrases == nps[stories.index(story)]  # the story's own phrases ...
    # ... while the images are those of the sequence being scored.
    pairs = {(stories.index(s), seqs.index(im)) for s, im, _ in reward.seen}
    assert pairs == {(j, j) for j in range(4)} | {(i, j) for j in range(4) for i in result.partners[j]}
    assert any(i != j for i, j in pairs)


def test_none_context_is_dropped():
    seqs = ["a", "bb"]
    reward = Match()
    original_vs_random(reward, own(seqs), images=seqs, noun_phrases=None)
    assert all(nps is None for _, _, nps in reward.seen)


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_stories_raises(n):
    with pytest.raises(ValueError, match="at least 2"):
        original_vs_random(Match(), own(["a"])[:n], images=["a"][:n])


# -- end to end with groovist ---------------------------------------------------------------------


def test_end_to_end_with_groovist(tiny_clip, images):
    reward = create_reward(
        "groovist", clip_model=tiny_clip, clip_pretrained=None, regions="whole", theta=0.5,
        concreteness=str(shared_path("groovist", "concreteness_ratings.csv")),
        pronouns=str(shared_path("groovist", "all_pronouns.txt")),
    )
    seqs = [images, images[::-1], images[1:]]
    stories = ["The dog ran to the car.", "The sky was blue over the church.", "People walked past old bottles."]
    nps = [["the dog", "the car"], ["the sky", "the church"], ["people", "old bottles"]]
    result = original_vs_random(reward, stories, k=5, seed=0, images=seqs, noun_phrases=nps)
    assert result.k == 2
    assert np.isfinite(result.deltas).all()
    s = result.summary()
    assert s["n"] == 3 and s["n_excluded"] == 0 and set(s) == SUMMARY_KEYS
    # The originals are the reward's own scores of (story j, sequence j).
    np.testing.assert_allclose(result.original, reward.score(stories, images=seqs, noun_phrases=nps), atol=1e-6)
    # A random partner of sequence 0 is scored with sequence 0's images but its own phrases.
    i = result.partners[0][0]
    partner = reward.score([stories[i]], images=[seqs[0]], noun_phrases=[nps[i]])[0]
    assert partner <= result.random_max[0] + 1e-9


def test_bad_k_and_empty_summary():
    with pytest.raises(ValueError, match="k and batch_size"):
        original_vs_random(Match(), ["a", "b"], k=0, images=["a", "b"])
    empty = OriginalVsRandom(2, np.array([np.nan]), np.array([1.0]), [[0]]).summary()
    assert empty["n"] == 0 and empty["n_excluded"] == 1 and math.isnan(empty["delta_mean"])
    assert set(empty) == {"n", "k", "n_excluded", "delta_mean", "delta_std", "delta_quantiles",
                          "frac_original_higher", "original_mean", "random_max_mean"}
