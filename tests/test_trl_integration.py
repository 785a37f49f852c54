"""storyrl rewards as TRL reward functions.

The slow tests run real ``trl.GRPOTrainer`` steps on CPU with a tiny random
LLaMA and a tokenizer trained on the test's texts (tests/tiny_models.py), so
nothing is downloaded. Random weights produce junk, so most completions are
unscorable: TRL must accept ``None``.
The fast tests call the reward TRL-style without a trainer.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from tiny_models import chat_tokenizer, tiny_llama

import storyrl  # noqa: F401  (installs the torchvision fallback before trl/transformers import it)
from storyrl.rewards import create_reward

STORIES = [
    "The cat sat on the mat. The cat sat on the mat again.",
    "A dog ran to the park. It played with a red ball. Then it slept.",
    "We went to the beach. The sun was warm and the sea was blue.",
]
UNSCORABLE = ["One sentence only.", ""]

# Words the tiny tokenizer knows (it adds its chat template's own).
CORPUS = [
    *STORIES,
    "Tell me a story about a cat.",
    "Write a short story about the sea.",
]
PROMPTS = ["Tell me a story about a cat.", "Write a short story about the sea."]
MAX_STEPS = 2


# -- helpers -------------------------------------------------------------------
def reward_call(reward, completions, **kwargs):
    """Call a reward exactly as TRL's GRPOTrainer does (keyword arguments only)."""
    return reward(prompts=["p"] * len(completions), completions=completions, **kwargs)


def as_chat(text, *, parts=False):
    content = [{"type": "text", "text": text}] if parts else text
    return [{"role": "assistant", "content": content}]


def expected(reward, texts):
    """``reward.score`` converted to TRL's convention (None for NaN)."""
    return [None if math.isnan(s) else float(s) for s in reward.score(texts)]


def build_dataset(conversational):
    from datasets import Dataset

    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else PROMPTS
    # story_id is an extra column: TRL passes it to the reward as a keyword argument.
    return Dataset.from_dict({"prompt": prompts * 4, "story_id": list(range(len(prompts) * 4))})


@pytest.fixture
def offline(monkeypatch):
    """No network: huggingface_hub reads its offline flag at import, so patch both."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def spy_on_score(monkeypatch, reward):
    """Record what the reward's TRL entry point hands to ``score``."""
    calls = []
    score = reward.score

    def recording_score(stories, **context):
        calls.append({"stories": list(stories), "context": context})
        return score(stories, **context)

    monkeypatch.setattr(reward, "score", recording_score)
    return calls


def spy_on_completions(monkeypatch):
    """Record the raw completions TRL passes (before storyrl extracts their text)."""
    from storyrl.rewards import base

    seen = []
    extract = base.completion_text

    def recording_completion_text(completion):
        seen.append(completion)
        return extract(completion)

    monkeypatch.setattr(base, "completion_text", recording_completion_text)
    return seen


def train_grpo(tmp_path, reward, conversational):
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = chat_tokenizer(CORPUS)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=MAX_STEPS,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=tiny_llama(tokenizer),
        reward_funcs=[reward],
        args=args,
        train_dataset=build_dataset(conversational),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer


# -- real GRPO training ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("conversational", [False, True], ids=["plain", "chat"])
def test_grpo_trains_with_reward(tmp_path, offline, monkeypatch, conversational):
    reward = create_reward("repetition")
    calls = spy_on_score(monkeypatch, reward)
    completions = spy_on_completions(monkeypatch)

    trainer = train_grpo(tmp_path, reward, conversational)

    assert trainer.state.global_step == MAX_STEPS
    assert trainer.reward_func_names == ["repetition"]

    # TRL passed completions of the dataset's kind; storyrl read their text.
    assert calls and completions
    if conversational:
        assert all(
            isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
            for c in completions
        )
    else:
        assert all(isinstance(c, str) for c in completions)
    for call in calls:
        assert all(isinstance(s, str) for s in call["stories"])
        # Dataset columns reach score() as context; TRL's own kwargs do not.
        assert set(call["context"]) == {"story_id"}
        assert len(call["context"]["story_id"]) == len(call["stories"])
    n_completions = sum(len(c["stories"]) for c in calls)
    assert reward.stats["scored"] + reward.stats["unscorable"] == n_completions

    # Logged: TRL's per-reward mean, and our unscorable fraction via log_metric.
    logs = [entry for entry in trainer.state.log_history if "rewards/repetition/mean" in entry]
    assert len(logs) == MAX_STEPS
    for entry in logs:
        frac = entry["repetition/unscorable_frac"]
        assert 0.0 <= frac <= 1.0
        # TRL logs None (not NaN) for a mean over a window where every reward was None.
        mean = entry["rewards/repetition/mean"]
        assert (mean is None) == (frac == 1.0)
        assert mean is None or mean <= 1.0
    assert np.mean([e["repetition/unscorable_frac"] for e in logs]) == pytest.approx(
        reward.stats["unscorable"] / n_completions
    )


# -- the TRL calling convention, without a trainer --------------------------------
def test_name_is_trl_column_name():
    reward = create_reward("repetition")
    assert reward.__name__ == "repetition"
    from trl.trainer.utils import get_callable_name

    assert get_callable_name(reward) == "repetition"


@pytest.mark.parametrize(
    "wrap",
    [lambda t: t, as_chat, lambda t: as_chat(t, parts=True)],
    ids=["plain", "chat-string", "chat-parts"],
)
def test_trl_call_matches_score(wrap):
    reward = create_reward("repetition")
    texts = STORIES + UNSCORABLE
    got = reward_call(reward, [wrap(t) for t in texts])
    want = expected(reward, texts)
    assert got == want
    assert all(isinstance(v, float) for v in got[: len(STORIES)])
    assert got[len(STORIES) :] == [None, None]


def test_unscorable_is_none_not_nan():
    reward = create_reward("repetition")
    completions = [
        "One sentence only.",
        "",
        None,
        42,
        [{"role": "assistant", "content": None}],
        [{"role": "assistant", "content": [{"type": "image"}]}],
        STORIES[0],
    ]
    got = reward_call(reward, completions)
    assert got[:-1] == [None] * (len(completions) - 1)
    assert isinstance(got[-1], float) and not math.isnan(got[-1])


def test_log_metric_reports_unscorable_fraction():
    reward = create_reward("repetition")
    logged = []
    reward_call(reward, STORIES + UNSCORABLE, log_metric=lambda name, value: logged.append((name, value)))
    assert logged == [("repetition/unscorable_frac", pytest.approx(2 / 5))]


def test_extra_kwargs_are_accepted():
    reward = create_reward("repetition")
    n = len(STORIES)
    got = reward_call(
        reward,
        STORIES,
        images=[object()] * n,
        story_id=list(range(n)),
        trainer_state=None,
        completion_ids=[[1, 2, 3]] * n,
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: None,
    )
    assert got == expected(reward, STORIES)


def test_pickle_roundtrip_scores_identically():
    reward = create_reward("repetition")
    clone = pickle.loads(pickle.dumps(reward))
    assert type(clone) is type(reward)
    assert clone.__name__ == "repetition"
    assert clone.config() == reward.config()
    completions = [as_chat(t) for t in STORIES + UNSCORABLE]
    assert reward_call(clone, completions) == reward_call(reward, completions)


def test_empty_batch():
    reward = create_reward("repetition")
    logged = []
    assert reward(prompts=[], completions=[], log_metric=lambda *a: logged.append(a)) == []
    assert logged == []
