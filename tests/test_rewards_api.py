"""The Reward base class, registry and config loading."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from storyrl.rewards import Reward, create_reward, get_reward_class, list_rewards, load_reward_config, register_reward


@register_reward()
class WordCount(Reward):
    """A toy reward: number of words; empty stories are unscorable; "boom" breaks."""

    name = "test_word_count"
    value_range = (1.0, math.inf)

    def _score_batch(self, stories, **context):
        if any("boom" in s for s in stories):
            raise RuntimeError("boom")
        self.last_context = context
        return np.array([len(s.split()) or math.nan for s in stories], dtype=float)


def test_registry_and_factory():
    assert "repetition" in list_rewards() and "test_word_count" in list_rewards()
    reward = create_reward("test_word_count")
    assert isinstance(reward, WordCount) and get_reward_class("test_word_count") is WordCount
    with pytest.raises(KeyError, match="unknown reward 'nope'; available:"):
        create_reward("nope")


def test_bad_story_in_a_batch_is_isolated():
    reward = create_reward("test_word_count")
    scores = reward.score(["a b", "boom", "", "c"])
    assert scores[0] == 2 and scores[3] == 1 and np.isnan(scores[1:3]).all()
    assert reward.stats == {"scored": 2, "unscorable": 2, "reasons": {"RuntimeError": 1}}


def test_systematic_failure_raises():
    with pytest.raises(RuntimeError, match="boom"):
        create_reward("test_word_count").score(["boom a", "boom b"])


def test_context_is_aligned_with_valid_stories():
    reward = create_reward("test_word_count")
    reward.score(["a", None, "b c"], images=[["1.png"], ["2.png"], ["3.png"]], split="test")
    assert reward.last_context == {"images": [["1.png"], ["3.png"]], "split": "test"}


def test_trl_call_contract():
    reward = create_reward("test_word_count")
    logged = {}
    out = reward(
        prompts=["p"] * 3,
        completions=["a b", [{"role": "assistant", "content": [{"type": "text", "text": "x y z"}]}], ""],
        completion_ids=[[1], [2], [3]],
        trainer_state=None,
        log_metric=logged.__setitem__,
    )
    assert out == [2.0, 3.0, None]
    assert logged == {"test_word_count/unscorable_frac": pytest.approx(1 / 3)}
    assert pickle.loads(pickle.dumps(reward)).__name__ == "test_word_count"


def test_load_reward_config(tmp_path):
    good = tmp_path / "r.yaml"
    good.write_text("reward: repetition\nchunk_size: 3\n")
    assert load_reward_config(good).chunk_size == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("reward: repetition\nchunks: 3\n")
    with pytest.raises(ValueError, match=f"{bad}: .*bad configuration"):
        load_reward_config(bad)
    (tmp_path / "x.yaml").write_text("- just a list\n")
    with pytest.raises(ValueError, match="reward: <name>"):
        load_reward_config(tmp_path / "x.yaml")


# -- contract details found by breaking the code on purpose (issue 8) --------


class AlwaysBroken(Reward):
    """A reward whose scoring raises for every story (e.g. a corrupt model)."""

    name = "test_always_broken"

    def _score_batch(self, stories, **context):
        raise RuntimeError("weights are garbage")


class Recorder(Reward):
    """Records the texts the base class hands to _score_batch."""

    name = "test_recorder"

    def __init__(self):
        super().__init__()
        self.seen = []

    def _score_batch(self, stories, **context):
        for s in stories:
            s.encode("utf-8")  # what every tokenizer and file writer needs
        self.seen.extend(stories)
        return np.ones(len(stories))


def test_a_reward_failing_on_every_story_is_an_error_with_batches_of_one():
    from storyrl.rewards.base import RewardError

    reward = AlwaysBroken()
    assert np.isnan(reward.score(["first story"])[0])  # one failure may be a bad story
    with pytest.raises(RewardError, match="weights are garbage"):
        reward.score(["second story"])
    # a whole multi-story batch failing is an error at once
    with pytest.raises(RewardError, match="test_always_broken"):
        AlwaysBroken().score(["a", "b"])


def test_a_reward_that_breaks_mid_run_is_an_error_with_batches_of_one():
    from storyrl.rewards.base import MAX_ERRORS_IN_A_ROW, RewardError

    reward = create_reward("test_word_count")
    assert reward.score(["fine"])[0] == 1
    for _ in range(MAX_ERRORS_IN_A_ROW - 1):
        assert np.isnan(reward.score(["boom"])[0])
    with pytest.raises(RewardError):
        reward.score(["boom"])


def test_occasional_bad_stories_with_batches_of_one_stay_nan():
    reward = create_reward("test_word_count")
    stories = ["a b", "boom", "c", "boom", "boom", "d e f"] * 3
    scores = np.concatenate([reward.score([s]) for s in stories])
    assert np.isnan(scores[[i for i, s in enumerate(stories) if s == "boom"]]).all()
    assert reward.stats["reasons"]["RuntimeError"] == 9


def test_context_column_of_the_wrong_length_is_an_error():
    reward = create_reward("test_word_count")
    with pytest.raises(ValueError, match="context column 'images' has 2 entries for 3 stories"):
        reward.score(["a", "b", "c"], images=[["1.png"], ["2.png"]])
    with pytest.raises(ValueError, match="'images'"):
        reward(prompts=["p"] * 3, completions=["a", "b", "c"], images=[["1.png"]] * 4)
    with pytest.raises(ValueError, match="'ids'"):
        reward.score(["a", "b"], ids=np.array([1, 2, 3]))
    reward.score(["a", "b"], split="test", weights={"x": 1})  # non-column values pass through


@pytest.mark.parametrize("value", ["a story. another.", b"bytes", {"a": "b"}, 3])
def test_stories_and_completions_must_be_lists(value):
    reward = create_reward("test_word_count")
    with pytest.raises(TypeError, match="must be a list"):
        reward.score(value)
    with pytest.raises(TypeError, match="completions must be a list"):
        reward(prompts=["p"], completions=value)
    assert reward.score(s for s in ["a b"])[0] == 2  # any other iterable is fine


def test_lone_surrogates_are_replaced_before_scoring():
    reward = Recorder()
    assert reward.score(["bad \ud800 text", "fine", "pair \ud83d\ude00 ok"]).tolist() == [1, 1, 1]
    assert reward.seen == ["bad \ufffd text", "fine", "pair \ufffd\ufffd ok"]
    # a real reward scores such a story instead of failing the batch
    rep = create_reward("repetition")
    assert rep.score(["The dog ran \udc80 home. The cat sat on the mat."])[0] == pytest.approx(
        rep.score(["The dog ran \ufffd home. The cat sat on the mat."])[0]
    )
