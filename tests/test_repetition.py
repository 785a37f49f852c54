"""RoViST-NR parity with the authors' published scores and robustness."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nltk_reference as ref
from conftest import load_story_json, shared_path
from storyrl.rewards import create_reward
from storyrl.rewards.repetition import repetition_from_tokens, repetition_score
from storyrl.text import tokenize_story


def _authors_scores(name: str) -> dict[str, float]:
    with shared_path("dhm", "vwp", f"{name}_R.csv").open(newline="") as fh:
        return {row["story_id"]: float(row["R_score"]) if row["R_score"] else math.nan for row in csv.DictReader(fh)}


@pytest.mark.parametrize("name", ["gt_test", "llava_vc_p3"])
def test_parity_with_authors_vwp(name):
    stories = load_story_json("dhm", "vwp", f"{name}.json")
    expected = _authors_scores(name)
    assert set(stories) == set(expected)
    ids = list(stories)
    got = create_reward("repetition").score([stories[i] for i in ids])
    want = np.array([expected[i] for i in ids])
    assert np.array_equal(np.isnan(got), np.isnan(want))  # identical unscorable set
    finite = ~np.isnan(want)
    assert np.max(np.abs(got[finite] - want[finite])) < 1e-9


@pytest.mark.parametrize("name", ["gt_test", "llava_vc_p3"])
def test_matches_pair_loop_reference_vist(name):
    stories = load_story_json("dhm", "vist", f"{name}.json")
    got = create_reward("repetition").score(list(stories.values()))
    want = np.array([ref.repetition(s) for s in stories.values()])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.nanmax(np.abs(got - want)) < 1e-12


def _ref_words(story: str) -> list[list[str]]:
    """Per-sentence tokens minus the last one, by the independent NLTK splitter."""
    return [ref.word_tokenize(s)[:-1] for s in ref.sent_tokenize(story)]


def test_vist_human_unscorable_set_and_skipped_comparisons():
    stories = load_story_json("dhm", "vist", "gt_test.json")
    ids = list(stories)
    reward = create_reward("repetition")
    got = dict(zip(ids, reward.score([stories[i] for i in ids])))
    # reference-notes.md: unscorable = no inter-sentence comparison left; on
    # the VIST human stories exactly those with fewer than two sentences.
    few = {i for i in ids if len(ref.sent_tokenize(stories[i])) < 2}
    assert len(few) == 156
    assert {i for i in ids if math.isnan(got[i])} == few
    assert reward.stats["reasons"] == {"fewer than 2 sentences": 156}
    # Stories with a comparison of two token-less sentences ("great ! ! !"):
    # the authors skip it and score the rest (these were NaN before).
    skipped = {i for i in ids if sum(not w for w in _ref_words(stories[i])) >= 2}
    assert skipped == {"45575", "45691", "48729", "48768", "48854"}
    for i in skipped:
        want = ref.repetition(stories[i])
        assert math.isfinite(want) and abs(got[i] - want) < 1e-12, i


def test_hand_computed():
    sentences = [["x", "y", "."], ["x", "x", "z", "."], ["w", "."]]
    # tokens: [x,y], [x,x,z], [w]; inter pairs: (1,0): 2 pairs / |{x,y,z}|=3,
    # (2,0): 0/3, (2,1): 0/3 -> mean 2/9; no intra chunks -> 0
    assert repetition_from_tokens(sentences) == pytest.approx(1 - (2 / 9) / 2)
    # intra: chunks [a,a,b,c] vs [a,d]: pairs 2 (a,a x a) / |{a,b,c,d}|=4
    sentences = [["a", "a", "b", "c", "a", "d", "."], ["e", "."]]
    inter = 0 / len({"a", "b", "c", "d", "e"})
    assert repetition_from_tokens(sentences) == pytest.approx(1 - (inter + 2 / 4) / 2)


def test_empty_union_comparison_is_skipped_not_counted():
    # tokens: [The,dog,ran], [], [], [The,cat,ran]. Inter: (1,0) 0/3, (2,0) 0/3,
    # (2,1) union empty -> skipped, (3,0) 2 pairs / |{The,dog,ran,cat}|=4,
    # (3,1) 0/3, (3,2) 0/3 -> mean (1/2)/5 = 1/10 (1/12 if the skipped one
    # counted as 0); no intra chunks -> 0.
    story = "The dog ran. ! ! The cat ran."
    sentences = [["The", "dog", "ran", "."], ["!"], ["!"], ["The", "cat", "ran", "."]]
    assert tokenize_story(story) == sentences
    assert repetition_from_tokens(sentences) == pytest.approx(1 - (1 / 10) / 2, abs=1e-15)
    assert repetition_score(story) == pytest.approx(1 - (1 / 10) / 2, abs=1e-15)
    assert ref.repetition(story) == pytest.approx(1 - (1 / 10) / 2, abs=1e-15)
    # Intra chunks still count when a sentence pair is skipped: chunks
    # [a,a,b,c] vs [a,d] -> 2/4; inter (1,0) 0/4, (2,0) 0/4, (2,1) skipped.
    sentences = [["a", "a", "b", "c", "a", "d", "."], ["!"], ["!"]]
    assert repetition_from_tokens(sentences) == pytest.approx(1 - (0 + 2 / 4) / 2, abs=1e-15)


def test_pair_counting_can_exceed_one_and_go_negative():
    # Kept for parity: equal token PAIRS are counted, not a set intersection.
    assert repetition_score("the the the the. the the the the.") < 0


@pytest.mark.parametrize("story", ["", "   ", "One sentence only.", "no period at all", "! !", "! ! !", "..."])
def test_unscorable_is_nan(story):
    assert math.isnan(repetition_score(story))
    assert math.isnan(ref.repetition(story))


def test_unscorable_reasons_counted():
    reward = create_reward("repetition")
    stories = ["A dog ran. A cat sat.", "One sentence only.", "", "! !", "! ! !", "Hi. ! !", None]
    scores = reward.score(stories)
    assert math.isfinite(scores[0]) and math.isfinite(scores[5]) and np.isnan(scores[[1, 2, 3, 4, 6]]).all()
    assert reward.stats == {
        "scored": 2,
        "unscorable": 5,
        "reasons": {"fewer than 2 sentences": 2, "no inter-sentence comparison": 2, "not text": 1},
    }
    reward.score(["Only one."])  # counts add up across calls
    assert reward.stats["reasons"]["fewer than 2 sentences"] == 3


def test_reward_metadata_and_bad_input():
    reward = create_reward("repetition")
    assert reward.name == reward.__name__ == "repetition"
    assert reward.higher_is_better
    scores = reward.score(["A dog ran. A cat sat.", None, 3, "single"])
    assert math.isfinite(scores[0]) and np.isnan(scores[1:]).all()
    assert reward.stats == {
        "scored": 1,
        "unscorable": 3,
        "reasons": {"not text": 2, "fewer than 2 sentences": 1},
    }


def test_chunk_size_config():
    with pytest.raises(TypeError, match="bad configuration"):
        create_reward("repetition", ngram=3)
    with pytest.raises(ValueError):
        create_reward("repetition", chunk_size=0)
    story = "a b c d a b c d . e f g ."
    assert create_reward("repetition", chunk_size=3).score([story])[0] != create_reward("repetition").score([story])[0]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_unicode_never_raises(story):
    value = repetition_score(story)
    assert math.isnan(value) or math.isfinite(value)


def test_ten_thousand_words():
    story = " ".join(f"word{i % 97}" + ("." if i % 13 == 0 else "") for i in range(10_000))
    value = create_reward("repetition").score([story, "x " * 10_000])
    assert math.isfinite(value[0]) and math.isnan(value[1])
