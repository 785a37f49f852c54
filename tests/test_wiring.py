"""Wiring that a formula test cannot see: which chat messages a reward reads,
that command-line model options reach the right reward, that each GROOViST
ablation config changes what the reward computes, and that the GROOViST reward
runs the tested ``groovist_score``. Each test here fails when its wiring is
broken (see the break named in each docstring)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO
from tiny_models import albert_tokenizer, save_coherence_model, write_glove

import storyrl  # noqa: F401  (torchvision fallback before open_clip / transformers)
from storyrl.rewards import create_reward, load_reward_config
from storyrl.rewards.base import completion_text

CONFIGS = REPO / "configs" / "rewards"
# Word;Conc.M ratings and a pronoun list written here, so no shared data is needed.
RATINGS = {"the": 1.5, "a": 1.4, "dog": 4.9, "red": 3.8, "car": 4.9, "sky": 4.6, "cat": 4.9, "old": 2.2}
PRONOUNS = ["it", "that", "this"]


# -- (a) which messages completion_text reads ---------------------------------------


def test_completion_text_reads_assistant_messages_only_when_there_are_any():
    """Break tried: ``replies = messages`` (no role filter) and filtering on
    "user" instead of "assistant"."""
    chat = [
        {"role": "system", "content": "You write stories."},
        {"role": "user", "content": "Tell a story about a dog."},
        {"role": "assistant", "content": "The dog ran. The dog slept."},
    ]
    assert completion_text(chat) == "The dog ran. The dog slept."
    # Several replies are joined in order; the prompt between them stays out.
    chat2 = [
        {"role": "assistant", "content": "First part."},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Second part."},
    ]
    assert completion_text(chat2) == "First part.\nSecond part."
    # An assistant message without text: the prompt is still never scored as the story.
    assert not completion_text([{"role": "user", "content": "prompt"}, {"role": "assistant", "content": ""}])
    assert not completion_text([{"role": "user", "content": "prompt"}, {"role": "assistant", "content": []}])


def test_completion_text_reads_every_message_without_an_assistant_one():
    """Break tried: dropping the ``or messages`` fallback."""
    assert completion_text([{"role": "user", "content": "U."}, {"role": "tool", "content": "T."}]) == "U.\nT."
    assert completion_text([{"content": "no role at all"}]) == "no role at all"
    assert completion_text({"role": "assistant", "content": "one message, not a list"}) == "one message, not a list"
    assert completion_text("plain text") == "plain text"
    assert completion_text([]) is None and completion_text(None) is None


def test_completion_text_reads_text_parts():
    """Break tried: reading only string contents (parts ignored)."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "prompt"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A dog."}, {"type": "image"}, {"type": "text", "text": "A cat."}]},
    ]
    assert completion_text(parts) == "A dog.\nA cat."


def test_reward_call_scores_the_assistant_reply_not_the_prompt():
    """The TRL entry point goes through completion_text: a repetitive prompt
    must not change the reply's repetition score. Break tried: no role filter."""
    reward = create_reward("repetition")
    reply = "The dog ran to the park. A cat sat on the wall. We went home."
    prompt = "the the the the. the the the the. the the the the."
    chat = [{"role": "system", "content": prompt}, {"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    expected = reward.score([reply])[0]
    assert math.isfinite(expected)
    assert reward(prompts=[prompt], completions=[chat])[0] == pytest.approx(expected)
    assert reward.score([prompt + "\n" + prompt + "\n" + reply])[0] != pytest.approx(expected)  # so the test can tell


# -- (b) command-line model options reach the right reward ---------------------------


STORIES = [
    ("s1", "The dog ran to the park. A cat sat on the wall. It rained all day.", ["the dog", "a cat", "the wall"]),
    ("s2", "The sky was blue. We saw a red car. The car was old.", ["the sky", "a red car", "the car"]),
]


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory, images, rovist_vg_dir):
    root = tmp_path_factory.mktemp("wiring_cli")
    stories = root / "stories.jsonl"
    stories.write_text("".join(json.dumps({"story_id": i, "story": s, "images": images}) + "\n" for i, s, _ in STORIES))
    nps = root / "nps.json"
    nps.write_text(json.dumps({i: p for i, _, p in STORIES}))
    glove = write_glove(root / "glove.txt", ["dog", "cat", "wall", "sky", "car", "the", "a", "red"], seed=0)
    # Two tiny ALBERTs, seeds 0 and 1, with heads that spread the probabilities: they score visibly differently.
    tokenizer = albert_tokenizer([s for _, s, _ in STORIES], vocab_size=64)
    coh = [save_coherence_model(root / f"coh_{k}", tokenizer, seed=k, size="tiny", head_scale=20) for k in (0, 1)]
    return {
        "stories": stories, "nps": nps, "glove": glove, "images": images,
        "coh_a": coh[0], "coh_b": coh[1], "vg": rovist_vg_dir,
    }


def _cli_scores(*args) -> dict[str, list[float]]:
    """Run ``storyrl score`` and read its CSV (empty cell = NaN)."""
    from storyrl.cli import main

    out = Path(args[args.index("-o") + 1])
    result = CliRunner().invoke(main, ["score", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with out.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["story_id"] for r in rows] == [i for i, _, _ in STORIES]
    return {k: [float(r[k]) if r[k] else math.nan for r in rows] for k in rows[0] if k != "story_id"}


def test_coherence_and_rovist_vg_model_options_reach_their_own_reward(cli_setup, tmp_path, one_thread):
    """Break tried (issue 8): swapping the two entries of the then hand-kept
    renaming table, and mapping ``coherence_model`` to the rovist_vg reward.
    The options are generated now; tests/test_cli_options.py checks every one."""
    s = cli_setup
    texts = [t for _, t, _ in STORIES]
    nps = [p for _, _, p in STORIES]
    scores = _cli_scores(
        s["stories"], "-m", "coherence,rovist_vg", "-o", tmp_path / "scores.csv", "--device", "cpu", "-q",
        "--coherence-model", s["coh_b"], "--rovist-vg-model", s["vg"], "--glove", s["glove"],
        "--noun-phrases", s["nps"], "--regions", "whole",
    )
    with_b = create_reward("coherence", model=s["coh_b"], device="cpu").score(texts)
    with_a = create_reward("coherence", model=s["coh_a"], device="cpu").score(texts)
    assert np.all(np.isfinite(with_b)) and not np.allclose(with_a, with_b, atol=1e-4)  # the model matters
    np.testing.assert_allclose(scores["coherence"], with_b, atol=1e-6)
    vg = create_reward("rovist_vg", model=s["vg"], glove=s["glove"], device="cpu", regions="whole")
    expected_vg = vg.score(texts, images=[s["images"]] * len(texts), noun_phrases=nps)
    assert np.all(np.isfinite(expected_vg))
    np.testing.assert_allclose(scores["rovist_vg"], expected_vg, atol=1e-6)


def test_coherence_model_option_overrides_the_config_file(cli_setup, tmp_path, one_thread):
    """``--config coherence.yaml --coherence-model PATH`` replaces the file's
    ``model``. Break tried: mapping ``coherence_model`` to rovist_vg."""
    s = cli_setup
    texts = [t for _, t, _ in STORIES]
    scores = _cli_scores(
        s["stories"], "--config", CONFIGS / "coherence.yaml", "-o", tmp_path / "scores.csv", "--device", "cpu", "-q",
        "--coherence-model", s["coh_a"],
    )
    expected = create_reward("coherence", model=s["coh_a"], device="cpu").score(texts)
    np.testing.assert_allclose(scores["coherence"], expected, atol=1e-6)


# -- (c) each GROOViST ablation config changes the reward as its name says ------------


@pytest.fixture(scope="module")
def word_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wiring_words")
    ratings = root / "ratings.csv"
    ratings.write_text("Word;Conc.M\n" + "".join(f"{w};{v}\n" for w, v in RATINGS.items()), encoding="utf-8")
    pronouns = root / "pronouns.txt"
    pronouns.write_text("\n".join(PRONOUNS) + "\n", encoding="utf-8")
    corpus = root / "corpus.json"
    corpus.write_text(json.dumps({"1": "the dog ran .", "2": "the sky was blue .", "3": "a dog and a car ."}))
    return {"concreteness": str(ratings), "pronouns": str(pronouns), "corpus": str(corpus)}


def _from_config(name, tiny_clip, word_files, **extra):
    # Only what the test machine needs (tiny CLIP, word files) is overridden:
    # every ablation option comes from the file itself.
    overrides = {"clip_model": tiny_clip, "clip_pretrained": None, "device": "cpu",
                 "concreteness": word_files["concreteness"], "pronouns": word_files["pronouns"], **extra}
    return load_reward_config(CONFIGS / name, overrides=overrides)


#: Ablation file -> the options it must change relative to groovist.yaml.
ABLATIONS = {
    "groovist_ablation_no_penalty.yaml": {"penalty": False},
    "groovist_ablation_no_concreteness.yaml": {"weighting": "none"},
    "groovist_ablation_idf.yaml": {"weighting": "idf", "idf_corpus": "<corpus>"},
    "groovist_ablation_nouns.yaml": {"units": "nouns"},
}
NPS = [["the dog", "a red car", "sky", "it"]]


def test_every_ablation_config_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("groovist_ablation_*.yaml")) == sorted(ABLATIONS)


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_config_options_reach_the_reward(name, tiny_clip, word_files):
    """The reward built from the file differs from groovist.yaml's in exactly
    the ablated options. Break tried: ``penalty: true`` back in the no_penalty
    file (and ``weighting: concreteness`` in no_concreteness)."""
    extra = {"idf_corpus": word_files["corpus"]} if "idf" in name else {}
    base = _from_config("groovist.yaml", tiny_clip, word_files).config()
    ablated = _from_config(name, tiny_clip, word_files, **extra).config()
    expected = {k: word_files["corpus"] if v == "<corpus>" else v for k, v in ABLATIONS[name].items()}
    assert {k: v for k, v in ablated.items() if base.get(k) != v} == expected


def _explain(reward, images, **context):
    (details,) = reward.explain(["s"], images=[images], **context)
    return details


def test_no_penalty_config_does_not_penalise(tiny_clip, images, word_files, one_thread):
    """Below θ, the default scores (2.5c - θ)·w and -P scores 2.5c·w: θ·w more.
    Break tried: ``penalty: true`` back in groovist_ablation_no_penalty.yaml."""
    base = _explain(_from_config("groovist.yaml", tiny_clip, word_files), images, noun_phrases=NPS)
    no_p_reward = _from_config("groovist_ablation_no_penalty.yaml", tiny_clip, word_files)
    no_p = _explain(no_p_reward, images, noun_phrases=NPS)
    theta = no_p_reward.theta
    below = [p for p in base["phrases"] if 2.5 * p["cosine"] < theta]
    assert below, "the tiny CLIP should leave some phrase below θ, or this test shows nothing"
    for a, b in zip(base["phrases"], no_p["phrases"]):
        assert b["score"] == pytest.approx(2.5 * b["cosine"] * b["weight"])
        if 2.5 * a["cosine"] < theta:
            assert b["score"] - a["score"] == pytest.approx(theta * a["weight"])
            assert a["score"] < 0  # the default penalises it
    assert no_p["score"] > base["score"]


def test_no_concreteness_config_weights_every_phrase_one(tiny_clip, images, word_files, one_thread):
    """Break tried: ``weighting: concreteness`` in the -C file."""
    base = _explain(_from_config("groovist.yaml", tiny_clip, word_files), images, noun_phrases=NPS)
    no_c = _explain(_from_config("groovist_ablation_no_concreteness.yaml", tiny_clip, word_files), images, noun_phrases=NPS)
    assert [p["weight"] for p in no_c["phrases"]] == [1.0, 1.0, 1.0]
    # The default weights by the ratings written above (mean over the phrase's words).
    assert [p["weight"] for p in base["phrases"]] == pytest.approx([(1.5 + 4.9) / 2, (1.4 + 3.8 + 4.9) / 3, 4.6])
    assert no_c["score"] == pytest.approx(np.mean([p["score"] / p["weight"] for p in base["phrases"]]))


def test_idf_config_weights_by_idf(tiny_clip, images, word_files, one_thread):
    """idf = log(N / (1 + df)) over the corpus, averaged over the phrase's
    words. Break tried: ``weighting: none`` in the -C +idf file."""
    reward = _from_config("groovist_ablation_idf.yaml", tiny_clip, word_files, idf_corpus=word_files["corpus"])
    idf = _explain(reward, images, noun_phrases=NPS)
    n = 3  # corpus stories; df: the 2, dog 2, a 1, red 0, car 1, sky 1
    expected = [
        (math.log(n / 3) + math.log(n / 3)) / 2,
        (math.log(n / 2) + math.log(n / 1) + math.log(n / 2)) / 3,
        math.log(n / 2),
    ]
    assert [p["weight"] for p in idf["phrases"]] == pytest.approx(expected)


def test_nouns_config_scores_nouns(tiny_clip, images, word_files, monkeypatch, one_thread):
    """Without precomputed phrases the reward parses the story; a hand-parsed
    spaCy Doc stands in for the English pipeline the config names. Break
    tried: ``units: noun_phrases`` in the -NPs +Ns file."""
    import spacy
    from spacy.tokens import Doc

    import storyrl.noun_phrases

    vocab = spacy.blank("en").vocab

    class FakeNlp:
        def pipe(self, texts, batch_size=64):
            for _ in texts:
                yield Doc(vocab, words=["the", "dog", "saw", "a", "cat", "."],
                          pos=["DET", "NOUN", "VERB", "DET", "NOUN", "PUNCT"],
                          heads=[1, 2, 2, 4, 2, 2], deps=["det", "nsubj", "ROOT", "det", "dobj", "punct"])

    monkeypatch.setattr(storyrl.noun_phrases, "load_pipeline", lambda *a, **k: FakeNlp())
    base = _explain(_from_config("groovist.yaml", tiny_clip, word_files), images)
    nouns = _explain(_from_config("groovist_ablation_nouns.yaml", tiny_clip, word_files), images)
    assert [p["phrase"] for p in base["phrases"]] == ["the dog", "a cat"]
    assert [p["phrase"] for p in nouns["phrases"]] == ["dog", "cat"]


# -- (d) the GROOViST reward runs groovist_score --------------------------------------


def _groovist(tiny_clip, word_files, **options):
    return create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, device="cpu",
                         concreteness=word_files["concreteness"], pronouns=word_files["pronouns"], **options)


def test_analyse_scores_equal_groovist_score_by_hand(tiny_clip, images, word_files, one_thread):
    """The story score is the (tanh of the) mean of its phrase scores, hand
    computed from each phrase's cosine and weight; θ sits between the phrases'
    scaled cosines so both branches of the penalty are used. Break tried:
    dropping the tanh and the penalty branch in groovist_score."""
    from storyrl.rewards.groovist import groovist_score

    probe = _groovist(tiny_clip, word_files, theta=0.0).analyse(["s"], images=[images], noun_phrases=NPS)[0]
    scaled = sorted(2.5 * p.cosine for p in probe.phrases)
    theta = (scaled[0] + scaled[1]) / 2
    for bounded in (False, True):
        for penalty in (True, False):
            reward = _groovist(tiny_clip, word_files, theta=theta, bounded=bounded, penalty=penalty)
            (result,) = reward.analyse(["s"], images=[images], noun_phrases=NPS)
            cos = np.array([p.cosine for p in result.phrases])
            weights = np.array([p.weight for p in result.phrases])
            by_hand = []
            for c, w, p in zip(cos, weights, result.phrases):
                s = 2.5 * c
                if penalty and s < theta:
                    s = -(theta - s)
                assert p.score == pytest.approx(s * w)
                by_hand.append(s * w)
            mean = sum(by_hand) / len(by_hand)
            expected = math.tanh(mean) if bounded else mean
            assert result.score == pytest.approx(expected, abs=1e-12)
            assert result.score == groovist_score(cos, weights, theta, penalty, bounded)
            assert reward.score(["s"], images=[images], noun_phrases=NPS)[0] == result.score


def test_reward_goes_through_groovist_score(tiny_clip, images, word_files, monkeypatch, one_thread):
    """Replacing groovist_score changes what the reward returns, so the tested
    function is the one the reward runs. Break tried: the old analyse, which
    took the mean and tanh itself."""
    import storyrl.rewards.groovist as groovist

    calls = []

    def untanhed(max_cos, weights, theta, penalize=True, bounded=False):
        calls.append((len(max_cos), bounded))
        return float(groovist.groovist_phrase_scores(max_cos, weights, theta, penalize).mean())  # tanh dropped

    reward = _groovist(tiny_clip, word_files, theta=0.0, bounded=True)
    honest = reward.score(["s"], images=[images], noun_phrases=NPS)[0]
    monkeypatch.setattr(groovist, "groovist_score", untanhed)
    broken = reward.score(["s"], images=[images], noun_phrases=NPS)[0]
    assert calls == [(3, True)]
    assert broken != pytest.approx(honest) and honest == pytest.approx(math.tanh(broken))
    (details,) = reward.explain(["s"], images=[images], noun_phrases=NPS)
    assert details["score"] == broken  # --explain reports the same path
