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
