"""The reference-based baselines, ``bleu`` and ``rouge_l``, against sacreBLEU
and rouge-score called directly, and the VHED paper's reference-absent rule
(Eq. 3) against a hand computation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics import BLEU as SacreBLEU

from conftest import REPO
from storyrl.cli import main
from storyrl.data import read_scores
from storyrl.rewards import create_reward, load_reward_config

STORY = "we went to the park . the kids played on the swings . we had a great day ."
REFS = [
    "we went to the park today . the kids played on the swings . it was a great day .",
    "the family visited a park . children loved the swings . everyone had fun .",
    "a day at the beach . the water was cold .",
]


def sacre(story, refs, **options):
    return SacreBLEU(effective_order=True, **options).sentence_score(story, refs).score / 100


def rouge(story, ref, measure="fmeasure", stem=False):
    return getattr(RougeScorer(["rougeL"], use_stemmer=stem).score(ref, story)["rougeL"], measure)


def test_bleu_equals_sacrebleu_single_and_multi_reference():
    bleu = create_reward("bleu")
    assert bleu.score([STORY], reference=[REFS[0]])[0] == pytest.approx(sacre(STORY, REFS[:1]), abs=1e-12)
    # Several references: sacreBLEU's joint multi-reference count, not a max.
    multi = bleu.score([STORY], references=[REFS])[0]
    assert multi == pytest.approx(sacre(STORY, REFS), abs=1e-12)
    assert multi != pytest.approx(max(sacre(STORY, [r]) for r in REFS))


def test_bleu_options_reach_sacrebleu():
    options = {"smooth_method": "none", "max_ngram_order": 2, "lowercase": True, "tokenize": "intl"}
    bleu = create_reward("bleu", **options)
    story = STORY.upper()
    assert bleu.score([story], references=[REFS])[0] == pytest.approx(sacre(story, REFS, **options), abs=1e-12)
    # Unsmoothed BLEU-4 is 0 for a story without a matching 4-gram (VHED's ~80% zeros).
    assert create_reward("bleu", smooth_method="none").score([REFS[2]], reference=[REFS[1]])[0] == 0.0


def test_rouge_l_equals_rouge_score():
    for measure in ("fmeasure", "precision", "recall"):
        reward = create_reward("rouge_l", measure=measure, use_stemmer=True)
        single = reward.score([STORY], reference=[REFS[1]])[0]
        assert single == pytest.approx(rouge(STORY, REFS[1], measure, stem=True), abs=1e-12)
    # Several references: the best one (rouge-score's score_multi).
    best = max(rouge(STORY, r) for r in REFS)
    assert create_reward("rouge_l").score([STORY], references=[REFS])[0] == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("name", ["bleu", "rouge_l"])
def test_reference_absent_drops_the_story_itself_and_takes_the_max(name):
    single = (lambda s, r: sacre(s, [r])) if name == "bleu" else rouge
    plain, absent = create_reward(name), create_reward(name, reference_absent=True)
    # The story is one of the references (a human story in a VHED pair), in
    # another case and spacing: without the rule it matches itself.
    assert plain.score([STORY], references=[[STORY, *REFS]])[0] == pytest.approx(1.0)
    refs = ["  " + STORY.upper().replace(" . ", " .  "), *REFS]
    expected = max(single(STORY, r) for r in REFS)
    assert absent.score([STORY], references=[refs])[0] == pytest.approx(expected, abs=1e-12)
    # Only the story itself as reference: nothing left, unscorable and counted.
    assert math.isnan(absent.score([STORY], references=[[STORY]])[0])
    assert absent.stats["reasons"]["no reference"] == 1


@pytest.mark.parametrize("name", ["bleu", "rouge_l"])
def test_reference_and_references_are_both_used(name):
    reward = create_reward(name)
    both = reward.score([STORY], reference=[REFS[0]], references=[REFS[1:]])[0]
    assert both == pytest.approx(reward.score([STORY], references=[REFS])[0], abs=1e-12)
    # A references entry may be one string.
    assert reward.score([STORY], references=[REFS[0]])[0] == pytest.approx(
        reward.score([STORY], reference=[REFS[0]])[0], abs=1e-12)


@pytest.mark.parametrize("name", ["bleu", "rouge_l"])
def test_missing_or_bad_references_are_nan_and_counted(name):
    reward = create_reward(name)
    scores = reward.score([STORY, STORY, STORY, STORY, 3],
                          references=[REFS, None, ["", "  "], [1, 2], REFS])
    assert not math.isnan(scores[0]) and np.isnan(scores[1:]).all()
    assert reward.stats["reasons"] == {"no reference": 2, "reference is not text": 1, "not text": 1}
    # Without any reference context at all.
    assert math.isnan(reward.score([STORY])[0])


def test_option_types_are_validated():
    with pytest.raises(TypeError, match="reference_absent"):
        create_reward("bleu", reference_absent="yes")
    with pytest.raises(ValueError, match="smooth_method"):
        create_reward("bleu", smooth_method="laplace")
    with pytest.raises(TypeError, match="max_ngram_order"):
        create_reward("bleu", max_ngram_order=4.0)
    with pytest.raises(ValueError, match="measure"):
        create_reward("rouge_l", measure="f1")


def test_shipped_configs_load():
    vhed = load_reward_config(REPO / "configs/rewards/bleu_vhed.yaml")
    assert vhed.name == "bleu" and vhed.reference_absent and vhed.smooth_method == "none"
    assert load_reward_config(REPO / "configs/rewards/bleu.yaml").smooth_method == "exp"
    assert load_reward_config(REPO / "configs/rewards/rouge_l.yaml").name == "rouge_l"


def test_storyrl_score_reads_references_from_jsonl(tmp_path):
    stories = tmp_path / "stories.jsonl"
    stories.write_text("\n".join(json.dumps(r) for r in [
        {"story_id": "a", "story": STORY, "references": REFS},
        {"story_id": "b", "story": STORY, "reference": REFS[1]},
    ]) + "\n")
    out = tmp_path / "scores.csv"
    result = CliRunner().invoke(main, ["score", str(stories), "-m", "bleu,rouge_l", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    table = read_scores(out)
    assert table.scores["bleu"]["a"] == pytest.approx(sacre(STORY, REFS), abs=1e-6)
    assert table.scores["rouge_l"]["b"] == pytest.approx(rouge(STORY, REFS[1]), abs=1e-6)
