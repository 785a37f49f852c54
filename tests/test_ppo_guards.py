"""Guards for storyrl's PPO trainer (storyrl.training.storyteller.rl.ppo) found by a
break review: masked samples in samples.jsonl, the summary's last reward,
resuming with changed settings and telling a peft-wrapped TAPM policy.
Tiny random-weight policies from test_ppo.py / tiny_models.py, on CPU."""

from __future__ import annotations

import json
import logging

import pytest
import tiny_models

import storyrl  # noqa: F401  (torchvision fallback before transformers)

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_ppo import CORPUS, ppo_args, text_dataset

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


def text_trainer(tmp_path, reward, **options):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    return PPOTrainer(tiny_models.tiny_llama(tokenizer), reward, ppo_args(tmp_path, **options), text_dataset(),
                      processing_class=tokenizer)


def test_a_masked_sample_shows_a_null_reward_in_samples_jsonl(tmp_path):
    def none_for_s1(prompts, completions, story_id, log_extra, **kwargs):
        log_extra("story_id", list(story_id))  # to tell which sample is which
        return [None if s == "s1" else 0.5 for s in story_id]

    none_for_s1.__name__ = "none_for_s1"
    result = text_trainer(tmp_path, none_for_s1, max_steps=1, num_sample_stories=4).train(progress=False)
    with open(f"{result.output_dir}/samples.jsonl", encoding="utf-8") as f:
        [line] = [json.loads(x) for x in f]
    samples = line["samples"]
    assert sorted(s["story_id"] for s in samples) == ["s0", "s1", "s2", "s3"]
    # the masked story's raw weighted sum (0.0) is no score: it shows null
    assert {s["story_id"]: s["reward"] for s in samples} == {"s0": 0.5, "s1": None, "s2": 0.5, "s3": 0.5}
    assert samples == result.history[0]["samples"]


def test_summary_last_reward_skips_a_final_step_with_every_sample_masked(tmp_path):
    calls = []

    def scores_once(prompts, completions, **kwargs):
        calls.append(1)  # step 1 scores every story 0.75, step 2 none
        return [0.75] * len(completions) if len(calls) == 1 else [None] * len(completions)

    result = text_trainer(tmp_path, scores_once, max_steps=2).train(progress=False)
    assert [r["step"] for r in result.history] == [1, 2]
    assert result.history[0]["reward"] == pytest.approx(0.75)
    assert result.history[1]["reward"] is None and result.history[1]["ppo/masked_frac"] == 1.0
    summary = result.summary()
    assert summary["last_reward"] == pytest.approx(0.75) and summary["steps"] == 2


def test_resume_warns_only_about_settings_ppo_may_not_change(tmp_path, caplog):
    def words(prompts, completions, **kwargs):
        return [len(c[0]["content"].split()) / 10 for c in completions]

    first = {"max_steps": 1, "save_steps": 1, "report_to": "none", "num_sample_stories": 2, "logging_steps": 1}
    text_trainer(tmp_path, words, **first).train(progress=False)
    # every one of these is PPO's to change on resume (report_to: none and [] alike mean no tracker)
    allowed = {"max_steps": 2, "save_steps": 2, "report_to": [], "num_sample_stories": 1, "logging_steps": 2}
    with caplog.at_level(logging.WARNING, logger="storyrl.training"):
        result = text_trainer(tmp_path, words, **allowed).train(resume=True, progress=False)
    assert result.steps == 2
    assert "changed settings" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="storyrl.training"):
        text_trainer(tmp_path, words, **{**allowed, "max_steps": 3, "learning_rate": 5e-4}).train(
            resume=True, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "changed settings" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].endswith(": learning_rate")


def test_a_peft_wrapped_tapm_model_is_a_tapm_policy(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.model import TapmModel
    from storyrl.training.storyteller.rl.ppo.rollout import is_tapm_policy

    directory = tiny_models.save_tiny_decoder(tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    decoder = AutoModelForCausalLM.from_pretrained(directory)
    model = TapmModel.from_decoder(decoder, tokenizer, {"resnet": 8}, {"resnet": 1}, seed=0)
    assert is_tapm_policy(model) and not is_tapm_policy(decoder)
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                               fan_in_fan_out=True))
    assert type(wrapped).__name__ != "TapmModel"  # wrapped indeed
    assert is_tapm_policy(wrapped)
    # and a peft-wrapped plain decoder is not one
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(directory),
                           LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    assert not is_tapm_policy(plain)
