"""Issue 30: PPO at 7B "stopped at step 1" in the GPU suite.

The suite's random (unfitted) 7B policies write one-"sentence" word soup
(``w4967 w3921 w16585 ...``): ``dhm`` cannot score it (NaN for every story)
while ``bleu`` scores every story (0.0). PPO counts a story only when every
reward with a non-zero weight scores it; GRPO/RLOO sum the rewards that did
score. So GRPO ran on ``bleu`` alone and PPO masked every story, and its
error named both rewards ("dhm, bleu returned None/NaN for every
completion"), pointing at bleu and at PPO's fp16/bf16 path instead of at
dhm. These tests rebuild that situation with a tiny random policy: the
message must name only the reward at fault and say what to do, and the
suite's remedy (the never-scoring reward at weight 0, logged only) must
train.
"""

from __future__ import annotations

import math

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers)
import tiny_models

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_ppo import CORPUS, lora_config, ppo_args, snapshot, text_dataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class ScoresNone:
    """dhm on word soup: no story is scorable."""

    __name__ = "soup_dhm"

    def __call__(self, prompts, completions, **kwargs):
        return [None] * len(completions)


class ScoresEvery:
    """Scores the stories whose index has parity ``parity`` (None: all of them)."""

    def __init__(self, name, parity=None) -> None:
        self.__name__, self.parity = name, parity

    def __call__(self, prompts, completions, **kwargs):
        return [0.0 if self.parity is None or i % 2 == self.parity else None for i in range(len(completions))]


def _trainer(tmp_path, rewards, weights=None):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    model = tiny_models.tiny_llama(tokenizer)
    return PPOTrainer(model, rewards, ppo_args(tmp_path, max_steps=1, gradient_checkpointing=True), text_dataset(),
                      processing_class=tokenizer, peft_config=lora_config(), reward_weights=weights)


def test_the_failure_names_only_the_reward_that_scored_nothing(tmp_path):
    from storyrl.rewards import create_reward
    from storyrl.training.runs import RunFailedError

    trainer = _trainer(tmp_path, [ScoresNone(), create_reward("bleu")])
    with pytest.raises(RunFailedError) as failed:
        trainer.train(progress=False)
    message = str(failed.value)
    # was: "step 1: no story was scorable: soup_dhm, bleu returned None/NaN for every completion ..."
    assert message.startswith("step 1: no story was scorable: soup_dhm returned None/NaN for every completion, "
                              "and PPO scores a story only when every reward with a non-zero weight scores it")
    assert "(bleu did score;" in message and "give soup_dhm weight 0" in message
    assert "\n" not in message


def test_rewards_that_each_score_some_stories_but_no_story_fully(tmp_path):
    from storyrl.training.runs import RunFailedError

    trainer = _trainer(tmp_path, [ScoresEvery("even", 0), ScoresEvery("odd", 1)])
    with pytest.raises(RunFailedError, match=r"^step 1: no story was scorable: every reward scored some stories "
                                             r"but none scored all of even, odd"):
        trainer.train(progress=False)


def test_every_reward_failing_keeps_the_old_message(tmp_path):
    from storyrl.training.runs import RunFailedError

    trainer = _trainer(tmp_path, [ScoresNone(), ScoresEvery("half", 0)], weights=[1.0, 0.0])
    with pytest.raises(RunFailedError, match=r"^step 1: no story was scorable: soup_dhm returned None/NaN for every "
                                             r"completion \(nothing to learn from\)"):
        trainer.train(progress=False)


def test_the_suites_remedy_weight_zero_logs_the_reward_and_trains(tmp_path):
    """What benchmarks/gpu_suite_rl.py does for its random 7B policies: dhm
    at weight 0 (still computed and logged), bleu drives the update."""
    from storyrl.rewards import create_reward

    trainer = _trainer(tmp_path, [ScoresNone(), create_reward("bleu")], weights=[0.0, 1.0])
    before = {k: v for k, v in snapshot(trainer.policy).items() if "lora_B" in k}
    result = trainer.train(progress=False)
    record = result.history[0]
    assert record["ppo/masked_frac"] == 0.0 and math.isfinite(record["reward"])
    assert record["rewards/soup_dhm/mean"] is None and math.isfinite(record["rewards/bleu/mean"])  # NaN logs as null
    assert math.isfinite(record["loss/policy"]) and math.isfinite(record["loss/value"])
    after = {k: v for k, v in snapshot(trainer.policy).items() if "lora_B" in k}
    assert before and all(not torch.equal(before[k], after[k]) for k in before)  # the adapters trained
