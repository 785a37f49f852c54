"""PPO's one score per story (storyrl.training.storyteller.rl.ppo.rewards.combine_scores):
a story one weighted reward could not score (None, NaN in the values) is
masked (valid False, score 0), never scored as if the missing term were 0;
a term at weight 0 never masks. Checked against hand computations, and
through call_rewards with a reward that returns None."""

from __future__ import annotations

import math

import pytest
import torch

from storyrl.training.storyteller.rl.ppo.rewards import call_rewards, combine_scores

NAN = math.nan


def test_a_missing_weighted_term_masks_the_story_a_scored_one_is_the_weighted_sum():
    # stories x rewards; weights 0.5, 2, 0 (the third only monitored)
    values = torch.tensor([[1.0, 3.0, 7.0],     # both weighted terms: 0.5 * 1 + 2 * 3 = 6.5
                           [NAN, 3.0, 7.0],     # the first weighted term missing: masked, not 2 * 3 = 6
                           [4.0, NAN, 7.0],     # the second missing: masked, not 0.5 * 4 = 2
                           [-2.0, 0.25, NAN]])  # only the weight-0 term missing: 0.5 * -2 + 2 * 0.25 = -0.5
    scores, valid = combine_scores(values, torch.tensor([0.5, 2.0, 0.0]))
    assert valid.tolist() == [True, False, False, True]
    assert scores.tolist() == pytest.approx([6.5, 0.0, 0.0, -0.5])
    assert torch.isfinite(scores).all()  # no NaN leaks into the advantages


def test_none_from_a_reward_function_masks_that_story_only():
    def length(completions, **_):
        return [float(len(c.split())) for c in completions]

    def picky(completions, **_):  # cannot score the second story
        return [None if c == "b c" else 10.0 for c in completions]

    rows = [{"prompt": "p", "story_id": str(k)} for k in range(3)]
    completions = ["a", "b c", "d e f"]
    batch = call_rewards([length, picky], ["length", "picky"], rows, ["p"] * 3, completions, [[1], [2], [3]])
    assert torch.isnan(batch.values[1, 1]) and not torch.isnan(batch.values[[0, 2]]).any()
    scores, valid = combine_scores(batch.values, torch.tensor([1.0, 0.5]))
    assert valid.tolist() == [True, False, True]
    assert scores.tolist() == pytest.approx([1 + 5.0, 0.0, 3 + 5.0])
    # At weight 0 the picky reward is only logged: every story is scored by length alone.
    scores, valid = combine_scores(batch.values, torch.tensor([1.0, 0.0]))
    assert valid.tolist() == [True, True, True] and scores.tolist() == pytest.approx([1.0, 2.0, 3.0])
