"""storyrl train sft: the RL prompt, loss on the story only, final/ as an RL policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
STORIES = [" ".join(TAPM_TEXTS[0:2]), " ".join(TAPM_TEXTS[2:4])]


@pytest.fixture(autouse=True)
def _quiet_and_offline(monkeypatch):
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": images}) + "\n"
                            for k, s in enumerate(STORIES)), encoding="utf-8")
    return {"data": str(data), "chat": save_tiny_llama(root / "llama", TEXTS),
            "plain": save_tiny_llama(root / "plain", TEXTS, chat=False)}


def options(assets, out, model="chat", **extra):
    return {"model": assets[model], "data": assets["data"], "output_dir": str(out), "prompt": "P1",
            "max_steps": 1, "batch_size": 2, "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, **extra}


def hand_labels(tokenizer, story: str, chat: bool) -> tuple[list[int], list[int]]:
    """Input ids and labels built by hand: the prompt (as RL sends it) masked,
    the story (and what closes it) kept."""
    prompt = P1.format(n="three")
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        ids = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": story}], tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + " " + story)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[:len(prompt_ids)] == prompt_ids
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids):]


@pytest.mark.parametrize("model", ["chat", "plain"])
def test_labels_mask_the_prompt_and_keep_the_story(assets, tmp_path, model):
    from storyrl.training.sft import SFTRunConfig, build_trainer

    trainer = build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path, model)), progress=False)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = hand_labels(trainer.processing_class, STORIES[0], chat=model == "chat")
    assert batch["input_ids"][0].tolist() == ids
    assert batch["labels"][0].tolist() == labels
    story_ids = trainer.processing_class(STORIES[0], add_special_tokens=False)["input_ids"]
    kept = [x for x in labels if x != -100]
    assert kept[:len(story_ids)] == story_ids and len(kept) <= len(story_ids) + 3  # the story, then its end


def test_one_step_loss_is_cross_entropy_over_story_tokens(assets, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.training.sft import SFTRunConfig, train

    tokenizer = AutoTokenizer.from_pretrained(assets["chat"])
    model = AutoModelForCausalLM.from_pretrained(assets["chat"]).eval()
    total, count = 0.0, 0
    for story in STORIES:
        ids, labels = hand_labels(tokenizer, story, chat=True)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        for t in range(1, len(ids)):
            if labels[t] != -100:
                total -= torch.log_softmax(logits[t - 1].double(), -1)[labels[t]].item()
                count += 1
    result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "out")), progress=False)
    assert result.steps == 1
    assert result.summary()["last_loss"] == pytest.approx(total / count, abs=1e-4)
    # The step changed the weights.
    trained = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not torch.equal(trained.lm_head.weight, model.lm_head.weight)


def test_cli_writes_a_final_model_that_rl_accepts(assets, tmp_path):
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from storyrl.cli import main
    from storyrl.training.rl.config import RLConfig
    from storyrl.training.rl.policy import load_policy

    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(options(assets, tmp_path / "out", max_steps=5)), encoding="utf-8")
    result = CliRunner().invoke(main, ["train", "sft", "--config", str(config), "--max-steps", "2", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    final = tmp_path / "out" / "final"
    assert summary["steps"] == 2 and summary["final"] == str(final)
    AutoModelForCausalLM.from_pretrained(final)
    rl = RLConfig.from_mapping({"model": str(final), "data": assets["data"], "output_dir": str(tmp_path / "rl"),
                                "rewards": ["repetition"], "prompt": "P1"})
    assert rl.policy_kind() == "causal_lm"
    policy = load_policy(rl)
    assert policy.tokenizer.padding_side == "left"
    losses = [e["loss"] for e in map(json.loads, (tmp_path / "out" / "history.jsonl").read_text().splitlines())
              if "loss" in e]
    assert len(losses) == 2


def test_lora_saves_adapters_and_merge_saves_full_weights(assets, tmp_path):
    from storyrl.training.sft import SFTRunConfig, train

    lora = {"enabled": True, "r": 4, "alpha": 8}
    adapters = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "a", lora=lora)), progress=False)
    assert (Path(adapters.final_dir) / "adapter_config.json").is_file()
    merged = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "m", lora={**lora, "merge": True})),
                   progress=False)
    assert not (Path(merged.final_dir) / "adapter_config.json").exists()
    assert (Path(merged.final_dir) / "config.json").is_file()


@pytest.mark.parametrize("lora, message", [({"rr": 3}, "unknown key 'rr'"), ("yes", "key 'lora': expected LoraOptions")])
def test_bad_lora_keys_are_one_line_errors(assets, tmp_path, lora, message):
    from storyrl.training.sft import SFTRunConfig

    with pytest.raises(ValueError, match=message):
        SFTRunConfig.from_mapping(options(assets, tmp_path, lora=lora))


# -- exact resume ---------------------------------------------------------------------


def _losses(history) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in history if "loss" in e]


def test_resume_after_an_interruption_equals_an_uninterrupted_run(assets, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from storyrl.training import sft

    # Three stories, two per batch: an epoch is 2 steps, so 4 steps reshuffle the data once.
    data = tmp_path / "three.jsonl"
    rows = [json.loads(line) for line in Path(assets["data"]).read_text().splitlines()]
    rows.append({**rows[0], "story_id": "s2", "story": TAPM_TEXTS[4]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def config(out):
        return sft.SFTRunConfig.from_mapping(options(assets, out, data=str(data), max_steps=4, save_steps=1,
                                                     lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1}))

    whole = sft.train(config(tmp_path / "whole"), progress=False)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt("killed after checkpoint-2")

    build = sft.build_trainer
    monkeypatch.setattr(sft, "build_trainer", lambda c, p=True, callbacks=None: build(c, p, [Kill()]))
    with pytest.raises(KeyboardInterrupt):
        sft.train(config(tmp_path / "cut"), progress=False)
    assert not (tmp_path / "cut" / "checkpoint-3").exists()
    class Count(TrainerCallback):
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    monkeypatch.setattr(sft, "build_trainer", lambda c, p=True, callbacks=None: build(c, p, [Count()]))
    resumed = sft.train(config(tmp_path / "cut"), resume=True, progress=False)
    assert Count.steps == [3, 4]  # it went on from checkpoint-2, not from the start

    assert resumed.steps == whole.steps == 4
    assert _losses(resumed.history) == _losses(whole.history) and len(_losses(whole.history)) == 4
    a = load_file(Path(whole.final_dir) / "adapter_model.safetensors")
    b = load_file(Path(resumed.final_dir) / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    history = [json.loads(line) for line in (tmp_path / "cut" / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]
