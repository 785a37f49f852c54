"""The reward contract's guards (failure streaks, setup errors, completion
parsing, composite NaN handling, weighted options), each pinned by a test
that fails when the guard is broken on purpose."""

from __future__ import annotations

import math

import numpy as np
import pytest

from storyrl.rewards import Reward, create_reward
from storyrl.rewards.base import MAX_ERRORS_IN_A_ROW, FatalRewardError, RewardError, clean_text, completion_text
from storyrl.rewards.composite import unique_names


class Flaky(Reward):
    """Scores len(story); a batch holding "boom" raises (so the base class
    retries it one story at a time); counts its _score_batch calls."""

    name = "test_guard_flaky"

    def __init__(self):
        super().__init__()
        self.calls = []

    def _score_batch(self, stories, **context):
        self.calls.append((list(stories), context))
        if any("boom" in s for s in stories):
            raise RuntimeError("boom")
        return np.array([float(len(s)) for s in stories])


class FromReference(Reward):
    """Scores each story by its own ``reference`` entry; "bad" breaks a batch."""

    name = "test_guard_from_reference"

    def __init__(self):
        super().__init__()
        self.seen = []

    def _score_batch(self, stories, reference=None, **context):
        self.seen.append((list(stories), list(reference)))
        if "bad" in stories:
            raise RuntimeError("bad story")
        return np.array([float(r) for r in reference])


class CannotLoad(Reward):
    """A reward whose _setup raises the given exception."""

    name = "test_guard_cannot_load"

    def __init__(self, exc=None):
        super().__init__()
        self.exc = exc if exc is not None else OSError("model file missing: /nowhere/model.bin")
        self.scored = 0

    def _setup(self):
        raise self.exc

    def _score_batch(self, stories, **context):
        self.scored += len(stories)
        return np.ones(len(stories))


class Constant(Reward):
    """Returns the given per-story values whatever the story."""

    name = "test_guard_constant"

    def __init__(self, values):
        super().__init__()
        self.values = values

    def _score_batch(self, stories, **context):
        return np.array(self.values[: len(stories)], dtype=float)


class Length(Reward):
    name = "test_guard_length"

    def _score_batch(self, stories, **context):
        return np.array([float(len(s)) for s in stories])


def weighted_with(component, **term):
    """A weighted reward whose single component (log name ``repetition``)
    is ``component``: the weighted reward keys its terms by log name."""
    reward = create_reward("weighted", components=[{"reward": "repetition", **term}])
    reward.component_rewards["repetition"] = component
    return reward


# -- failure streaks (base.py) -----------------------------------------------------------


def test_a_successful_batch_resets_the_failure_streak():
    reward = Flaky()
    reward.score(["fine"])
    for _ in range(MAX_ERRORS_IN_A_ROW - 1):
        assert np.isnan(reward.score(["boom"])[0])
    # A good batch scored in one call (not the one-by-one retry) ends the streak.
    assert reward.score(["ab", "abc"]).tolist() == [2.0, 3.0]
    assert reward.calls[-1][0] == ["ab", "abc"]
    assert np.isnan(reward.score(["boom"])[0])  # one failure after the reset: no RewardError


def test_a_two_story_batch_failing_whole_is_an_error_even_after_successes():
    # The rule: a whole batch of more than one story failing is a broken
    # reward, whatever came before; a single failing story is not.
    reward = Flaky()
    assert reward.score(["ok", "fine"]).tolist() == [2.0, 4.0]
    assert np.isnan(reward.score(["boom"])[0])
    reward = Flaky()
    reward.score(["ok"])
    with pytest.raises(RewardError, match=r"test_guard_flaky.*2 stories in a row: RuntimeError: boom"):
        reward.score(["boom 1", "boom 2"])
    # Half of a batch failing stays NaN.
    reward = Flaky()
    reward.score(["ok"])
    out = reward.score(["boom", "abc"])
    assert np.isnan(out[0]) and out[1] == 3.0


def test_exactly_max_errors_in_a_row_raise():
    assert MAX_ERRORS_IN_A_ROW == 16
    reward = Flaky()
    reward.score(["fine"])  # a success first: the "every story so far failed" rule is out of play
    for _ in range(15):
        assert np.isnan(reward.score(["boom"])[0])
    with pytest.raises(RewardError, match="16 stories in a row"):
        reward.score(["boom"])


def test_one_by_one_retry_gives_each_story_its_own_context():
    reward = FromReference()
    out = reward.score([None, "bad", "good"], reference=[0, 10, 20])
    assert np.isnan(out[0]) and np.isnan(out[1]) and out[2] == 20.0
    # the batch call, then one call per text story with its own entry
    assert reward.seen == [(["bad", "good"], [10, 20]), (["bad"], [10]), (["good"], [20])]


# -- setup and loading errors ------------------------------------------------------------


@pytest.mark.parametrize("exc", [FatalRewardError("server rejected the token"), RewardError("server down")])
def test_reward_errors_from_setup_come_out_unchanged(exc):
    reward = CannotLoad(exc)
    with pytest.raises(RewardError) as info:
        reward.setup()
    assert info.value is exc and type(info.value) is type(exc)
    assert str(info.value) == str(exc)


def test_other_setup_errors_become_one_line_reward_errors():
    reward = CannotLoad(OSError("model file\nmissing"))
    with pytest.raises(RewardError) as info:
        reward.setup()
    assert type(info.value) is RewardError
    assert str(info.value) == "reward 'test_guard_cannot_load': cannot load: model file missing"


@pytest.mark.parametrize("stories", [["one story"], ["one", "two"]])
def test_score_raises_the_loading_error_itself(stories):
    reward = CannotLoad()
    with pytest.raises(OSError) as info:
        reward.score(stories)
    assert type(info.value) is OSError and str(info.value) == "model file missing: /nowhere/model.bin"
    assert reward.scored == 0 and reward.stats["unscorable"] == 0


# -- text and completions --------------------------------------------------------------------


# chr(): ruff reads distinct lone-surrogate literals as duplicates
@pytest.mark.parametrize(("text", "want"), [(chr(0xD800), "\ufffd"), (chr(0xDFFF), "\ufffd"), ("é", "é"),
                                            ("a" + chr(0xDC80), "a\ufffd"), ("ok", "ok")])
def test_clean_text_replaces_lone_surrogates_in_short_strings(text, want):
    assert clean_text(text) == want


def test_chat_completion_scores_only_the_assistant_text():
    completion = [{"role": "user", "content": "a long user turn"}, {"role": "assistant", "content": "abc"}]
    assert completion_text(completion) == "abc"
    assert Length()(prompts=["p"], completions=[completion]) == [3.0]


def test_a_bare_assistant_message_is_read():
    assert completion_text({"role": "assistant", "content": "abcd"}) == "abcd"
    assert Length()(prompts=["p"], completions=[{"role": "assistant", "content": "abcd"}]) == [4.0]


@pytest.mark.parametrize("n_prompts", [1, 3])
def test_prompts_and_completions_must_pair_up(n_prompts):
    reward = create_reward("weighted", components=[{"reward": "repetition"}])
    with pytest.raises(ValueError, match=f"weighted: {n_prompts} prompts for 2 completions"):
        reward(prompts=["p"] * n_prompts, completions=["The cat sat.", "The dog ran."])


# -- composites (composite.py) -------------------------------------------------------------


def test_reset_failure_streak_resets_the_components():
    flaky = Flaky()
    reward = weighted_with(flaky)
    reward.score(["fine"])
    for _ in range(MAX_ERRORS_IN_A_ROW - 1):
        assert np.isnan(reward.score(["boom"])[0])
    reward.reset_failure_streak()
    assert flaky._errors_in_a_row == 0
    assert np.isnan(reward.score(["boom"])[0])  # no RewardError: the streak started afresh


@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_an_infinite_component_value_is_unscorable(bad):
    reward = weighted_with(Constant([1.5, bad]))
    assert reward(prompts=["p", "p"], completions=["a", "b"]) == [1.5, None]
    out = reward.score(["a", "b"])
    assert out[0] == 1.5 and np.isnan(out[1])
    assert out.dtype == np.float64 and not np.isinf(out).any()
    np.testing.assert_array_equal(reward.last_components["repetition"], [1.5, np.nan])


def test_a_batch_without_text_still_fills_every_column():
    reward = create_reward("weighted", components=[{"reward": "repetition", "normalize": "batch"},
                                                   {"reward": "repetition", "options": {"chunk_size": 2}}])
    reward.score(["The cat sat. The cat sat.", "The dog ran home."])  # columns from an earlier batch
    out = reward.score([None, 3, None])
    assert np.isnan(out).all()
    assert set(reward.last_components) == {"repetition", "repetition/normalized", "repetition_2"}
    for column in reward.last_components.values():
        assert len(column) == 3 and np.isnan(column).all()


def test_composite_setup_sets_up_its_components():
    broken = CannotLoad()
    reward = weighted_with(broken)
    with pytest.raises(RewardError, match="reward 'test_guard_cannot_load': cannot load: model file missing"):
        reward.setup()
    assert broken.scored == 0


def test_fixed_names_are_reserved_before_default_ones():
    assert unique_names(["repetition_2", "repetition", "repetition"], [True, False, False]) == [
        "repetition_2", "repetition", "repetition_3"]
    reward = create_reward("weighted", components=[{"name": "repetition_2", "reward": "repetition"},
                                                   {"reward": "repetition"}, {"reward": "repetition"}])
    assert list(reward.component_rewards) == ["repetition_2", "repetition", "repetition_3"]
    assert len({id(r) for r in reward.component_rewards.values()}) == 3
    assert reward.score(["The cat sat. The cat sat."])[0] == pytest.approx(
        3 * create_reward("repetition").score(["The cat sat. The cat sat."])[0])


# -- weighted options and groups (weighted.py) -----------------------------------------------


def test_a_component_name_with_a_slash_is_refused():
    with pytest.raises(ValueError) as info:
        create_reward("weighted", components=[{"reward": "repetition", "name": "rep/2"}])
    message = str(info.value)
    assert "\n" not in message
    assert "components[0]" in message and "name must be a non-empty name without '/', got 'rep/2'" in message


@pytest.mark.parametrize("bounds", [[1, 1], [0.5, 0.5]])
def test_an_empty_range_is_refused(bounds):
    with pytest.raises(ValueError, match=r"components\[0\].*range must be finite \[lo, hi\] with lo < hi"):
        create_reward("weighted", components=[{"reward": "repetition", "normalize": "range", "range": bounds}])


class Image:
    """A stand-in for a PIL image: not JSON, distinct per instance."""

    def __init__(self, pixels):
        self.pixels = pixels


def chat(text):
    return [{"role": "user", "content": [{"type": "image", "image": Image(text)}, {"type": "text", "text": text}]}]


def test_equal_chat_prompts_with_different_images_share_a_group():
    reward = weighted_with(Length(), normalize="group")
    # two rows of the same prompt (each with its own image object), then another prompt
    prompts = [chat("Tell"), chat("Tell"), chat("Write"), chat("Write")]
    got = reward(prompts=prompts, completions=["a", "abc", "ab", "abcd"])
    assert got == [-1.0, 1.0, -1.0, 1.0]
