"""storyrl train dpo: TRL's DPO loss equals a plainly written one, the
reference is the starting policy, the prompt carries no loss, the preferred
story gains, monitoring, resume and the run-directory guards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
STORY_A = " ".join(TAPM_TEXTS[0:2])
STORY_B = " ".join(TAPM_TEXTS[2:4])
FILE_PROMPT = P1.format(n="four")


pytestmark = pytest.mark.usefixtures("trl_offline")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": images}) + "\n"
                            for k, s in enumerate([STORY_A, STORY_B])), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    # Two pairs, both preferring A; the second has them the other way round in
    # length order so that padding is exercised.
    rows = [{"prompt": FILE_PROMPT, "chosen": STORY_A, "rejected": STORY_B, "images": images, "story_id": "s0"},
            {"prompt": FILE_PROMPT, "chosen": TAPM_TEXTS[4], "rejected": STORY_B, "images": images,
             "story_id": "s1"}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"data": str(data), "pairs": str(pairs), "images": images, "root": root,
            "chat": save_tiny_llama(root / "llama", TEXTS), "plain": save_tiny_llama(root / "plain", TEXTS, chat=False)}


def options(assets, out, model="chat", **extra):
    return {"model": assets.get(model, model), "data": assets["data"], "pairs": assets["pairs"], "output_dir": str(out),
            "prompt": "P1", "max_steps": 1, "batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0,
            **extra}


def config(assets, out, **extra):
    from storyrl.training.storyteller.dpo import DPORunConfig

    return DPORunConfig.from_mapping(options(assets, out, **extra))


def hand_ids(tokenizer, prompt: str, story: str, chat: bool) -> tuple[list[int], list[int]]:
    """Prompt ids and completion ids built by hand: the chat template's user
    turn (and generation prompt) vs the whole conversation, or the text and
    the text + ' ' + story + EOS."""
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        # The tiny template closes no assistant turn, so the story ends with EOS (storyteller.turn_end).
        ids = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": story + "[EOS]"}],
                                            tokenize=True, return_dict=True)["input_ids"]
        assert ids.count(tokenizer.eos_token_id) == 1
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + " " + story + tokenizer.eos_token)["input_ids"]
    assert ids[:len(prompt_ids)] == prompt_ids
    return prompt_ids, ids[len(prompt_ids):]


def completion_logp(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """Sum of log p(completion token | everything before it), one forward pass."""
    import torch

    ids = prompt_ids + completion_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(len(prompt_ids), len(ids)))


def plain_loss(loss_type: str, beta: float, margins: list[float]) -> float:
    """The DPO losses written out: margin = (pc - rc) - (pr - rr) per pair."""
    if loss_type == "sigmoid":
        per = [-math.log(1 / (1 + math.exp(-beta * m))) for m in margins]
    else:  # hinge
        per = [max(0.0, 1 - beta * m) for m in margins]
    return sum(per) / len(per)


def pair_stories():
    return [(STORY_A, STORY_B), (TAPM_TEXTS[4], STORY_B)]


def batch_loss(trainer) -> float:
    import torch

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    trainer.model.eval()  # no dropout: the hand forward passes have none
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 2.0), ("hinge", 0.5)])
def test_loss_equals_a_plain_dpo_loss_against_the_starting_policy(assets, tmp_path, lora, loss_type, beta):
    import torch
    from transformers import AutoModelForCausalLM

    from storyrl.training.storyteller.dpo import build_trainer

    extra = {"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}
    trainer = build_trainer(config(assets, tmp_path, loss_type=loss_type, beta=beta, **extra), progress=False)
    assert (trainer.ref_model is None) == lora  # LoRA: no copy, the adapters are switched off
    # Move the policy away from its start (the adapters with LoRA).
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if param.requires_grad and (not lora or "lora_B" in name):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    start = AutoModelForCausalLM.from_pretrained(assets["chat"]).eval()
    tokenizer = trainer.processing_class
    prompt = P1.format(n="three")  # the template prompt of a 3-image pair
    margins = []
    for chosen, rejected in pair_stories():
        p, c = hand_ids(tokenizer, prompt, chosen, chat=True)
        _, r = hand_ids(tokenizer, prompt, rejected, chat=True)
        trainer.model.eval()
        pc, pr = completion_logp(trainer.model, p, c), completion_logp(trainer.model, p, r)
        rc, rr = completion_logp(start, p, c), completion_logp(start, p, r)
        margins.append((pc - rc) - (pr - rr))
    assert any(abs(m) > 0.05 for m in margins)  # the check has teeth
    assert batch_loss(trainer) == pytest.approx(plain_loss(loss_type, beta, margins), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_at_the_start_the_policy_is_its_reference(assets, tmp_path, lora):
    from storyrl.training.storyteller.dpo import build_trainer

    extra = {"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}} if lora else {}
    trainer = build_trainer(config(assets, tmp_path, **extra), progress=False)
    assert batch_loss(trainer) == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize("model, prompts", [("chat", "template"), ("plain", "template"), ("chat", "pairs")])
def test_prompt_tokens_carry_no_loss_and_follow_the_prompt_source(assets, tmp_path, model, prompts):
    from storyrl.training.storyteller.dpo import build_trainer

    trainer = build_trainer(config(assets, tmp_path, model=model, prompts=prompts), progress=False)
    tokenizer = trainer.processing_class
    chat = model == "chat" and prompts == "template"
    prompt = P1.format(n="three") if prompts == "template" else FILE_PROMPT  # the file's prompt as is
    row = trainer.train_dataset[0]
    p, c = hand_ids(tokenizer, prompt, STORY_A, chat=chat)
    _, r = hand_ids(tokenizer, prompt, STORY_B, chat=chat)
    assert (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) == (p, c, r)
    batch = trainer.data_collator([row])
    mask = batch["completion_mask"].tolist()
    assert mask[0][:len(p) + len(c)] == [0] * len(p) + [1] * len(c)
    assert mask[1][:len(p) + len(r)] == [0] * len(p) + [1] * len(r)
    assert sum(mask[0]) == len(c) and sum(mask[1]) == len(r)  # padding carries none either


def test_training_on_a_over_b_raises_the_margin_of_a(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.training.storyteller.dpo import train

    result = train(config(assets, tmp_path / "out", max_steps=8, learning_rate=5e-3, beta=0.5), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(result.final_dir)
    p, a = hand_ids(tokenizer, P1.format(n="three"), STORY_A, chat=True)
    _, b = hand_ids(tokenizer, P1.format(n="three"), STORY_B, chat=True)

    def margin(path):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        return completion_logp(model, p, a) - completion_logp(model, p, b)

    assert margin(result.final_dir) > margin(assets["chat"]) + 1.0
    losses = [e["loss"] for e in result.history if "loss" in e]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5) and losses[-1] < 0.5


class _WordCount:
    """A stand-in storyrl reward (words per story) that remembers its context."""

    def __init__(self):
        from storyrl.rewards.base import Reward

        class WordCount(Reward):
            name = "words"

            def _score_batch(inner, stories, **context):
                self.contexts.append(context)
                return np.array([float(len(s.split())) for s in stories])

        self.contexts: list[dict] = []
        self.reward = WordCount()


def test_monitoring_logs_each_reward_at_the_sample_steps(assets, tmp_path, monkeypatch):
    from storyrl.training.storyteller.dpo import DPORunConfig, train

    stand_in = _WordCount()
    monkeypatch.setattr(DPORunConfig, "build_rewards", lambda self: [stand_in.reward])
    result = train(config(assets, tmp_path / "out", max_steps=4, sample_steps=2, rewards=["repetition"],
                          sample_prompts=2, sample_max_new_tokens=6), progress=False)
    out = Path(result.output_dir)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    sampled = {e["step"]: e for e in history if "rewards/words/mean" in e}
    assert sorted(sampled) == [2, 4]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4]
    for line in samples:
        stories = [s["story"] for s in line["samples"]]
        assert len(stories) == 2
        words = [len(s.split()) for s in stories]
        assert [s["rewards"]["words"] for s in line["samples"]] == words
        entry = sampled[line["step"]]
        assert entry["rewards/words/mean"] == pytest.approx(sum(words) / 2)
        assert entry["story/words_mean"] >= 0 and "loss" in entry
    # Context as RL gives it: the human stories and each sequence's images.
    assert stand_in.contexts[0]["reference"] == [STORY_A, STORY_B]
    assert [list(map(str, x)) for x in stand_in.contexts[0]["images"]] == [assets["images"]] * 2


def test_samples_off_the_logging_steps_log_at_their_own_step(assets, tmp_path, monkeypatch):
    """sample_steps 2, logging_steps 3: the samples of steps 2 and 4 get
    entries of their own (the monitor asks for a log), step 6 shares the
    regular one."""
    from storyrl.training.storyteller.dpo import DPORunConfig, train

    stand_in = _WordCount()
    monkeypatch.setattr(DPORunConfig, "build_rewards", lambda self: [stand_in.reward])
    result = train(config(assets, tmp_path / "out", max_steps=6, logging_steps=3, sample_steps=2,
                          rewards=["repetition"], sample_prompts=1, sample_max_new_tokens=3), progress=False)
    history = [json.loads(line) for line in (Path(result.output_dir) / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in history if "rewards/words/mean" in e] == [2, 4, 6]
    samples = [json.loads(line) for line in (Path(result.output_dir) / "samples.jsonl").read_text().splitlines()]
    means = {e["step"]: e["rewards/words/mean"] for e in history if "rewards/words/mean" in e}
    assert means == {s["step"]: s["samples"][0]["rewards"]["words"] for s in samples}


def test_resume_equals_an_uninterrupted_run(assets, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    from storyrl.training.storyteller import dpo
    from storyrl.training.storyteller.dpo import build_trainer, train

    common = {"max_steps": 4, "save_steps": 2, "batch_size": 1, "sample_steps": 1, "sample_max_new_tokens": 4}
    whole = train(config(assets, tmp_path / "whole", **common), progress=False)

    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    build_trainer(config(assets, tmp_path / "cut", **common), progress=False, callbacks=[StopAt2()]).train()
    assert (tmp_path / "cut" / "checkpoint-2").is_dir() and not (tmp_path / "cut" / "final").exists()

    class Count(TrainerCallback):
        def __init__(self):
            self.start, self.steps = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    count = Count()
    monkeypatch.setattr(dpo, "build_trainer", lambda c, p=True, callbacks=None: build_trainer(c, p, [count]))
    resumed = train(config(assets, tmp_path / "cut", **common), resume=True, progress=False)
    assert resumed.steps == 4
    assert (count.start, count.steps) == (2, [3, 4])  # it went on from checkpoint-2, not from the start
    a = AutoModelForCausalLM.from_pretrained(whole.final_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.final_dir).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not torch.equal(a["lm_head.weight"],
                           AutoModelForCausalLM.from_pretrained(assets["chat"]).state_dict()["lm_head.weight"])
    steps = [json.loads(x)["step"] for x in (tmp_path / "cut" / "history.jsonl").read_text().splitlines()]
    assert steps == [json.loads(x)["step"] for x in (tmp_path / "whole" / "history.jsonl").read_text().splitlines()]
    assert [json.loads(x)["step"] for x in (tmp_path / "cut" / "samples.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4]


def test_cli_final_is_an_rl_policy_and_the_directory_is_guarded(assets, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import load_policy
    from storyrl.training.runs import lock_directory

    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(options(assets, tmp_path / "out", max_steps=5,
                                           lora={"enabled": True, "r": 4, "alpha": 8, "merge": True})),
                    encoding="utf-8")
    args = ["train", "dpo", "--config", str(path), "--max-steps", "1", "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    final = tmp_path / "out" / "final"
    assert summary["steps"] == 1 and summary["final"] == str(final)
    assert not (final / "adapter_config.json").exists()  # merged
    assert yaml.safe_load((final / "dpo_config.yaml").read_text())["pairs"] == assets["pairs"]
    rl = RLConfig.from_mapping({"model": str(final), "data": assets["data"], "output_dir": str(tmp_path / "rl"),
                                "rewards": ["repetition"], "prompt": "P1"})
    assert load_policy(rl).tokenizer.padding_side == "left"
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "overwrite" in again.output
    with lock_directory(tmp_path / "out"):
        locked = CliRunner().invoke(main, [*args, "--overwrite"])
    assert locked.exit_code != 0 and str(tmp_path / "out") in locked.output
    assert CliRunner().invoke(main, [*args, "--overwrite"]).exit_code == 0


@pytest.mark.parametrize("extra, message", [
    ({"loss_type": "dpo"}, "loss_type"),
    ({"prompts": "file"}, "prompts"),
    ({"beta": -1.0}, "beta"),
    ({"rewards": ["repetition"]}, "set sample_steps"),
    ({"rewards": ["no_such_reward"], "sample_steps": 1}, r"rewards\[0\]"),
    ({"pairs": "/nonexistent/pairs.jsonl"}, "pairs: no such file"),
    ({"policy": "tapm"}, "TAPM reads visual features"),
    ({"report_to": "nope"}, "unknown tracker 'nope'"),
    # StorytellerConfig's checks hold for DPO too.
    ({"data": "/nonexistent/data.jsonl"}, "data: no such file"),
    ({"load_in_4bit": True}, "load_in_4bit: a 4-bit base trains through LoRA adapters only"),
    ({"policy": "causal_lm", "setting": "visual"}, "setting visual: a causal_lm policy sees no images"),
])
def test_config_errors_are_one_line(assets, tmp_path, extra, message):
    with pytest.raises((TypeError, ValueError), match=message) as info:
        config(assets, tmp_path, **extra)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "p", "chosen": "a .", "rejected": "b ."}', "{oops"], r"pairs\.jsonl: line 2: invalid JSON"),
    (['{"prompt": "p", "chosen": "", "rejected": "b ."}'], r"pairs\.jsonl: line 1: 'chosen' must be"),
    (['{"prompt": "p", "chosen": "a .", "rejected": "b ."}', '{"prompt": "p", "chosen": " \\t ", "rejected": "b ."}'],
     r"pairs\.jsonl: line 2: 'chosen' must be"),
    (['{"prompt": "p", "chosen": "a .", "rejected": "\\n  "}'], r"pairs\.jsonl: line 1: 'rejected' must be"),
    (['["p", "a", "b"]'], r"pairs\.jsonl: line 1: expected a JSON object"),
    (['{"prompt": "p", "chosen": "a .", "rejected": "b .", "images": "x.png"}'], r": line 1: 'images' must be"),
    (['{"prompt": "p", "chosen": "a .", "rejected": "b ."}'], r": line 1: no images, so no template prompt"),
    ([""], "no preference pairs"),
])
def test_malformed_pairs_name_file_line_and_fault(assets, tmp_path, lines, message):
    from storyrl.training.storyteller.dpo import build_trainer

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        build_trainer(config(assets, tmp_path / "out", pairs=str(pairs)), progress=False)
    assert "\n" not in str(info.value) and str(pairs) in str(info.value)


def test_file_prompts_need_a_prompt_and_template_prompts_do_not(assets, tmp_path):
    from storyrl.training.storyteller.dpo import dpo_dataset

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"chosen": STORY_A, "rejected": STORY_B, "images": ["a.png", "b.png"]}) + "\n",
                     encoding="utf-8")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets["chat"])
    with pytest.raises(ValueError, match=r"pairs\.jsonl: line 1: no 'prompt' to train on"):
        dpo_dataset(config(assets, tmp_path / "a", pairs=str(pairs), prompts="pairs"), "causal_lm", tokenizer)
    rows = dpo_dataset(config(assets, tmp_path / "b", pairs=str(pairs)), "causal_lm", tokenizer)
    assert len(rows) == 1 and isinstance(rows[0]["prompt"], list)  # RL's chat prompt for two images


def test_vlm_policy_sees_the_sequence_image_and_trains(assets, tmp_path):
    from tiny_models import save_tiny_chat_vlm

    from storyrl.training.storyteller.dpo import build_trainer, train
    from storyrl.training.storyteller.rl.data import _Prompter
    from storyrl.training.storyteller.rl.policy import load_policy

    vlm = save_tiny_chat_vlm(tmp_path / "vlm", TEXTS)
    extra = {"model": vlm, "sequence_image_size": "64x32", "sample_steps": 1, "sample_max_new_tokens": 4}
    run = config(assets, tmp_path / "b", **extra)
    trainer = build_trainer(run, progress=False)
    row = trainer.train_dataset[0]
    # The visual setting's sequence image, as RL's prompts show it.
    expected = _Prompter(run, "vlm", trainer.processing_class).images("s0", assets["images"])
    assert len(row["images"]) == 1 and row["images"][0].size == expected[0].size != (64, 32)
    assert np.array_equal(np.asarray(row["images"][0].convert("RGB")), np.asarray(expected[0].convert("RGB")))
    batch = trainer.data_collator([dict(row)])
    assert "pixel_values" in batch
    tokenizer = trainer.processing_class.tokenizer
    image_token = tokenizer.convert_tokens_to_ids(trainer.processing_class.image_token)
    ids, mask = batch["input_ids"][0], batch["completion_mask"][0]
    assert image_token in ids[mask == 0].tolist() and image_token not in ids[mask == 1].tolist()
    story, completion = tokenizer(STORY_A, add_special_tokens=False)["input_ids"], ids[mask == 1].tolist()
    assert any(completion[k:k + len(story)] == story for k in range(len(completion)))
    assert len(completion) <= len(story) + 3  # the story and what closes the turn
    assert batch_loss(trainer) == pytest.approx(math.log(2), abs=1e-6)  # the reference is the start
    result = train(config(assets, tmp_path / "out", max_steps=2, **extra), progress=False)
    losses = [e["loss"] for e in result.history if "loss" in e]
    assert losses[-1] < losses[0]
    assert "story/words_mean" in result.history[0]
    policy = load_policy(config(assets, tmp_path / "rl", **{**extra, "model": result.final_dir}))
    assert policy.kind == "vlm"


def test_vlm_refuses_the_files_prompt(assets, tmp_path):
    with pytest.raises(ValueError, match="prompts: pairs: a VLM policy"):
        config(assets, tmp_path, policy="vlm", prompts="pairs")


# -- issue 31: informative monitoring samples, the finite mean, the frozen reference, identical pairs ---------


def three_sequences(assets, tmp_path) -> str:
    """Three sequences of as many images: a text policy's prompt is the same for each."""
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": TAPM_TEXTS[k], "images": assets["images"]})
                            + "\n" for k in range(3)), encoding="utf-8")
    return str(data)


def test_monitoring_samples_distinct_records_seeded_and_leaves_the_rng(assets, tmp_path):
    """The monitor used to decode greedily: every sequence of a text policy
    has the same prompt, so samples.jsonl held one story thrice. Now each
    sequence gets a story sampled from the run's seed (the same draws at
    every call), and training's random state is left as it was."""
    import torch

    from storyrl.training.storyteller.dpo import SampleMonitor
    from storyrl.training.storyteller.rl.policy import Policy, _generate, load_policy

    run = config(assets, tmp_path / "out", data=three_sequences(assets, tmp_path), sample_steps=1, sample_prompts=3,
                 sample_max_new_tokens=8, seed=3)
    policy = load_policy(run)
    policy.model.train()  # as the trainer holds it
    monitor = SampleMonitor(run, "causal_lm", policy.processing_class, [])
    assert len({json.dumps(r["prompt"]) for r in monitor.rows}) == 1  # one prompt for the three sequences
    torch.manual_seed(123)
    before = torch.get_rng_state()
    stories = monitor.stories(policy.model, policy.processing_class)
    assert torch.equal(torch.get_rng_state(), before)
    assert monitor.stories(policy.model, policy.processing_class) == stories  # seeded: the same draws each time
    assert len(set(stories)) == 3 and all(stories)  # three stories, not one thrice
    assert policy.model.training  # put back in training mode
    torch.manual_seed(3)
    policy.model.eval()
    assert _generate(Policy(policy.model, policy.processing_class, "causal_lm"), monitor.rows, 8,
                     do_sample=True) == stories  # transformers' sampling (temperature 1) from the seed


def test_monitoring_samples_in_a_run_are_three_distinct_stories_with_their_ids(assets, tmp_path):
    from storyrl.training.storyteller.dpo import train

    result = train(config(assets, tmp_path / "out", data=three_sequences(assets, tmp_path), max_steps=2,
                          sample_steps=1, sample_prompts=3, sample_max_new_tokens=8, seed=3), progress=False)
    lines = [json.loads(x) for x in (Path(result.output_dir) / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert [s["story_id"] for s in line["samples"]] == ["s0", "s1", "s2"]
        assert len({s["story"] for s in line["samples"]}) == 3


def test_the_monitors_mean_is_over_the_stories_a_reward_scored(assets, tmp_path):
    """A story the reward cannot score (NaN, None to TRL) is left out of
    rewards/<name>/mean, not counted as 0: (2 + 4) / 2 = 3, not 6 / 3."""
    from transformers import AutoTokenizer

    from storyrl.rewards.base import Reward
    from storyrl.training.storyteller.dpo import SampleMonitor

    class Picky(Reward):
        name = "picky"

        def _score_batch(self, stories, **context):
            return np.array([math.nan if s == "a" else float(len(s.split())) * 2 for s in stories])

    run = config(assets, tmp_path / "out", data=three_sequences(assets, tmp_path), sample_steps=1, sample_prompts=3)
    monitor = SampleMonitor(run, "causal_lm", AutoTokenizer.from_pretrained(assets["chat"]), [Picky()])
    monitor.stories = lambda model, processing_class: ["a", "b", "c d"]
    metrics = monitor.run(None, None, step=1)
    assert metrics["rewards/picky/mean"] == pytest.approx(3.0)
    (line,) = [json.loads(x) for x in monitor.samples_path.read_text().splitlines()]
    assert [s["rewards"]["picky"] for s in line["samples"]] == [None, 2.0, 4.0]


def test_without_lora_the_reference_is_a_frozen_copy_loaded_as_the_policy(assets, tmp_path, monkeypatch):
    """TRL reloads a missing reference from the model's path (no revision,
    no 4-bit); storyrl hands it a second load_policy of the config, frozen."""
    import torch

    from storyrl.training.storyteller import dpo
    from storyrl.training.storyteller.rl import policy as policy_module

    loaded = []
    original = policy_module.load_policy

    def spy(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(policy_module, "load_policy", spy)
    trainer = dpo.build_trainer(config(assets, tmp_path / "out"), progress=False)
    policy, reference = trainer.model, trainer.ref_model
    assert len(loaded) == 2 and policy is loaded[0].model
    assert reference is loaded[1].model and reference is not policy  # storyrl's copy, not TRL's reload
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert all(p.requires_grad for p in policy.parameters())
    a, b = policy.state_dict(), reference.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(policy.parameters(), reference.parameters()))


def test_pairs_whose_chosen_is_the_rejected_are_refused_all_or_warned_some(assets, tmp_path, caplog):
    import logging

    from storyrl.training.storyteller.dpo import build_trainer

    rows = [{"prompt": FILE_PROMPT, "chosen": s, "rejected": s, "images": assets["images"], "story_id": f"s{k}"}
            for k, s in enumerate([STORY_A, STORY_B])]
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(ValueError, match=r"^\S*same.jsonl: chosen equals rejected in all 2 pairs: nothing to learn") \
            as info:
        build_trainer(config(assets, tmp_path / "a", pairs=str(same)), progress=False)
    assert "\n" not in str(info.value)
    some = tmp_path / "some.jsonl"
    some.write_text(Path(assets["pairs"]).read_text() + json.dumps(rows[0]) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        trainer = build_trainer(config(assets, tmp_path / "b", pairs=str(some)), progress=False)
    assert len(trainer.train_dataset) == 3
    assert any(r.getMessage().endswith("some.jsonl: chosen equals rejected in 1 of 3 pairs (line 3); they teach "
                                       "nothing") for r in caplog.records)


def test_a_vlms_pairs_whose_story_holds_the_image_token_are_left_out(assets, tmp_path, caplog):
    """A sampled story may decode to text holding '<image>' (the tiny
    VLM's vocabulary has '%}<image>'); the processor would read it as an
    image and TRL stop with "Found 2 <image> tokens ... but no images"."""
    import logging

    from tiny_models import save_tiny_chat_vlm

    from storyrl.training.storyteller.dpo import build_trainer

    vlm = save_tiny_chat_vlm(tmp_path / "vlm", TEXTS)
    good = {"chosen": STORY_A, "rejected": STORY_B, "images": assets["images"], "story_id": "s0"}
    held = {**good, "rejected": STORY_B + " %}<image> the", "story_id": "s1"}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(good) + "\n" + json.dumps(held) + "\n", encoding="utf-8")
    extra = {"model": vlm, "sequence_image_size": "64x32", "pairs": str(pairs)}
    with caplog.at_level(logging.WARNING):
        trainer = build_trainer(config(assets, tmp_path / "a", **extra), progress=False)
    assert len(trainer.train_dataset) == 1
    assert any(r.getMessage().endswith("pairs.jsonl: 1 of 2 pairs have a story holding the image token '<image>', "
                                       "which the VLM's processor reads as an image (line 2); they are left out")
               for r in caplog.records)
    assert batch_loss(trainer) == pytest.approx(math.log(2), abs=1e-6)
    pairs.write_text(json.dumps(held) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs.jsonl: every pair has a story holding the image token '<image>'.*"
                                         r"\(line 1\); nothing to train on$"):
        build_trainer(config(assets, tmp_path / "b", **extra), progress=False)
