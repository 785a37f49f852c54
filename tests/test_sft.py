"""storyrl train sft: the RL prompt, loss on the story only, final/ as an RL policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
STORIES = [" ".join(TAPM_TEXTS[0:2]), " ".join(TAPM_TEXTS[2:4])]


pytestmark = pytest.mark.usefixtures("trl_offline")


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
        # The tiny template closes no assistant turn, so the story ends with EOS (storyteller.turn_end).
        ids = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": story + "[EOS]"}],
                                            tokenize=True, return_dict=True)["input_ids"]
        assert ids.count(tokenizer.eos_token_id) == 1
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + " " + story)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[:len(prompt_ids)] == prompt_ids
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids):]


@pytest.mark.parametrize("model", ["chat", "plain"])
def test_labels_mask_the_prompt_and_keep_the_story(assets, tmp_path, model):
    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

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

    from storyrl.training.storyteller.sft import SFTRunConfig, train

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
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import load_policy

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
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    lora = {"enabled": True, "r": 4, "alpha": 8}
    adapters = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "a", lora=lora)), progress=False)
    assert (Path(adapters.final_dir) / "adapter_config.json").is_file()
    merged = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "m", lora={**lora, "merge": True})),
                   progress=False)
    assert not (Path(merged.final_dir) / "adapter_config.json").exists()
    assert (Path(merged.final_dir) / "config.json").is_file()


@pytest.mark.parametrize("lora, message", [({"rr": 3}, "unknown key 'rr'"), ("yes", "key 'lora': expected LoraOptions")])
def test_bad_lora_keys_are_one_line_errors(assets, tmp_path, lora, message):
    from storyrl.training.storyteller.sft import SFTRunConfig

    with pytest.raises(ValueError, match=message):
        SFTRunConfig.from_mapping(options(assets, tmp_path, lora=lora))


# -- exact resume ---------------------------------------------------------------------


def _losses(history) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in history if "loss" in e]


def test_resume_after_an_interruption_equals_an_uninterrupted_run(assets, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from storyrl.training.storyteller import sft

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
        steps: ClassVar[list[int]] = []

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


# -- VLM policies ----------------------------------------------------------------------

#: LLaVA 1.5's template with an assistant turn (the tiny LLaVA's own renders every turn as USER).
VLM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% else %} ASSISTANT: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}[EOS]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tiny_models import save_tiny_vlm
    from transformers import AutoProcessor

    directory = save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "llava", "llava", [*TEXTS, "USER: ASSISTANT:"])
    processor = AutoProcessor.from_pretrained(directory)
    processor.chat_template = VLM_TEMPLATE
    processor.save_pretrained(directory)
    return directory


def test_vlm_batch_has_rl_images_and_masks_the_whole_prompt(assets, vlm, tmp_path):
    import torch
    from transformers import AutoProcessor

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.data import load_data, prompt_rows
    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

    config = SFTRunConfig.from_mapping(options(assets, tmp_path) | {"model": vlm})
    trainer = build_trainer(config, progress=False)
    batch = trainer.data_collator([trainer.train_dataset[k] for k in range(2)])
    # The image RL's prompts carry (the sequence as one image), processed as RL's sampler does.
    processor = AutoProcessor.from_pretrained(vlm)
    rl = RLConfig.from_mapping({"model": vlm, "data": assets["data"], "output_dir": str(tmp_path / "rl"),
                                "rewards": ["repetition"], "prompt": "P1"})
    rows = prompt_rows(rl, load_data(rl), "vlm", processor)
    pixels = processor.image_processor([r["images"][0] for r in rows], return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"], pixels)
    # By hand: "USER: <image>\n<P1> ASSISTANT:" expanded, then " <story>[EOS]"; only the latter is learnt.
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    eos = processor.tokenizer.eos_token_id
    for k, story in enumerate(STORIES):
        text = "USER: <image>\n" + P1.format(n="three") + " ASSISTANT:"
        prompt = processor(images=rows[k]["images"], text=text, add_special_tokens=False)["input_ids"][0]
        prompt = list(prompt)
        story_ids = processor.tokenizer(" " + story, add_special_tokens=False)["input_ids"] + [eos]
        n = len(prompt) + len(story_ids)
        mask = batch["attention_mask"][k].tolist()
        assert mask[:n] == [1] * n and sum(mask) == n  # flushed left, padding after
        assert batch["input_ids"][k, :n].tolist() == prompt + story_ids
        assert batch["labels"][k, :n].tolist() == [-100] * len(prompt) + story_ids
        assert prompt.count(image) > 1  # the image's tokens are in the masked part
        assert (batch["labels"][k, n:] == -100).all()


def test_vlm_max_length_cuts_the_story_end(assets, vlm, tmp_path):
    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

    full = build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path / "a") | {"model": vlm}),
                         progress=False)
    ids = full.data_collator([full.train_dataset[0]])["input_ids"][0].tolist()
    cut = build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path / "b")
                                                  | {"model": vlm, "max_length": len(ids) - 3}), progress=False)
    batch = cut.data_collator([cut.train_dataset[0]])
    assert batch["input_ids"][0].tolist() == ids[:-3]


@pytest.mark.parametrize("freeze", [True, False])
def test_vlm_step_trains_the_language_model_and_the_vision_tower_only_when_asked(assets, vlm, tmp_path, freeze):
    import torch
    from transformers import AutoModelForImageTextToText

    from storyrl.training.storyteller.rl.policy import detect_policy, vision_parameter_names
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    before = AutoModelForImageTextToText.from_pretrained(vlm)
    result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "out")
                                             | {"model": vlm, "learning_rate": 1e-2, "freeze_vision_tower": freeze}),
                   progress=False)
    assert detect_policy(result.final_dir, read_hub=False) == "vlm"
    after = dict(AutoModelForImageTextToText.from_pretrained(result.final_dir).named_parameters())
    vision = set(vision_parameter_names(before))
    assert vision
    changed = {n for n, p in before.named_parameters() if not torch.equal(p, after[n])}
    assert changed - vision  # the language side learnt
    assert bool(changed & vision) is not freeze


def test_vlm_lora_final_is_an_rl_policy_and_generates(assets, vlm, tmp_path):
    import json as _json

    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.data import load_data
    from storyrl.training.storyteller.rl.policy import generate_stories
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    lora = {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"}
    result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "out")
                                             | {"model": vlm, "lora": lora}), progress=False)
    final = Path(result.final_dir)
    adapters = _json.loads((final / "adapter_config.json").read_text())
    assert "vision_tower" in adapters["exclude_modules"]  # frozen tower: no adapters on it
    rl = RLConfig.from_mapping({"model": vlm, "data": assets["data"], "output_dir": str(tmp_path / "rl"),
                                "rewards": ["repetition"], "prompt": "P1", "lora": lora})
    stories = generate_stories(rl, str(final), load_data(rl), max_new_tokens=4, device="cpu")
    assert set(stories) == {"s0", "s1"} and all(isinstance(s, str) for s in stories.values())
    # Merged weights are a model `storyrl generate` runs.
    merged = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "m")
                                             | {"model": vlm, "lora": {**lora, "merge": True}}), progress=False)
    out = tmp_path / "stories.json"
    run = CliRunner().invoke(main, ["generate", "--model", merged.final_dir, "--data", assets["data"], "--prompt", "P1",
                                    "--out", str(out), "--device", "cpu", "--max-new-tokens", "3", "--quiet"])
    assert run.exit_code == 0, run.output
    assert set(_json.loads(out.read_text())) == {"s0", "s1"}


def test_tapm_is_refused_in_one_line(assets, tmp_path):
    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

    config = SFTRunConfig.from_mapping(options(assets, tmp_path, policy="tapm"))
    with pytest.raises(ValueError, match=r"a TAPM model; storyrl train sft fine-tunes causal LMs and VLMs only") as err:
        build_trainer(config, progress=False)
    assert "\n" not in str(err.value)


# -- data formats and prompt options ------------------------------------------------------


def _write_vist(path: Path, image_root: Path) -> None:
    """Two VIST SIS stories (4 and 3 photos), storylets out of photo order."""
    from tiny_models import write_images

    paths = write_images(image_root, 4)
    for k, p in enumerate(paths):
        p.rename(image_root / f"{100 + k}{p.suffix}")
    storylets = [("a", 1, 101, TAPM_TEXTS[1]), ("a", 0, 100, TAPM_TEXTS[0]), ("a", 3, 103, TAPM_TEXTS[3]),
                 ("a", 2, 102, TAPM_TEXTS[2]), ("b", 2, 102, TAPM_TEXTS[4]), ("b", 0, 100, TAPM_TEXTS[2]),
                 ("b", 1, 101, TAPM_TEXTS[0])]
    path.write_text(json.dumps({"annotations": [[{"story_id": s, "worker_arranged_photo_order": o,
                                                  "photo_flickr_id": str(i), "text": t}]
                                                for s, o, i, t in storylets]}), encoding="utf-8")


def _chat_prompt(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_vist_sis_rows_are_rl_prompts_and_the_storylets_in_photo_order(assets, tmp_path):
    from storyrl.training.storyteller.sft import SFTRunConfig, sft_dataset

    data = tmp_path / "train.story-in-sequence.json"
    _write_vist(data, tmp_path / "images")
    config = SFTRunConfig.from_mapping(options(assets, tmp_path / "out", data=str(data),
                                               image_root=str(tmp_path / "images")))
    from transformers import AutoTokenizer

    rows = list(sft_dataset(config, "causal_lm", AutoTokenizer.from_pretrained(assets["chat"])))
    assert rows == [
        {"prompt": _chat_prompt(P1.format(n="four")),
         "completion": [{"role": "assistant", "content": " ".join(TAPM_TEXTS[0:4]) + "[EOS]"}]},
        {"prompt": _chat_prompt(P1.format(n="three")),
         "completion": [{"role": "assistant",
                         "content": " ".join([TAPM_TEXTS[2], TAPM_TEXTS[0], TAPM_TEXTS[4]]) + "[EOS]"}]},
    ]  # the tiny chat template closes no turn: EOS ends the story (storyteller.turn_end)


def _write_vwp(path: Path, image_root: Path) -> None:
    from tiny_models import write_images

    names = [p.name for p in write_images(image_root, 3)]
    header = "scene_full_id,story,link0,link1,link2,select_imgs_list\n"
    path.write_text(header + f'tt01,"{STORIES[0]}",{names[0]},{names[1]},{names[2]},"[1, 2, 3]"\n'
                    + f'tt01,"  {STORIES[1]} ",{names[2]},{names[0]},,"[3, 1]"\n', encoding="utf-8")


def test_vwp_rows_plain_prompt_and_the_story_after_a_space(assets, tmp_path):
    from transformers import AutoTokenizer

    from storyrl.training.storyteller.sft import SFTRunConfig, sft_dataset

    data = tmp_path / "vwp.csv"
    _write_vwp(data, tmp_path / "images")
    config = SFTRunConfig.from_mapping(options(assets, tmp_path / "out", model="plain", data=str(data),
                                               image_root=str(tmp_path / "images")))
    rows = list(sft_dataset(config, "causal_lm", AutoTokenizer.from_pretrained(assets["plain"])))
    assert rows == [{"prompt": P1.format(n="three"), "completion": " " + STORIES[0]},
                    {"prompt": P1.format(n="two"), "completion": " " + STORIES[1]}]


def test_vwp_rows_of_a_vlm_with_separate_images(assets, vlm, tmp_path):
    from transformers import AutoProcessor

    from storyrl.training.storyteller.sft import SFTRunConfig, sft_dataset

    data = tmp_path / "vwp.csv"
    _write_vwp(data, tmp_path / "images")
    config = SFTRunConfig.from_mapping(options(assets, tmp_path / "out", model="chat", data=str(data),
                                               image_root=str(tmp_path / "images"))
                                       | {"model": vlm, "setting": "separate"})
    rows = sft_dataset(config, "vlm", AutoProcessor.from_pretrained(vlm))
    row = rows[1]
    image = {"type": "image", "text": None}  # Arrow gives every content entry every key (as in RL's rows)
    assert row["prompt"] == [{"role": "user", "content": [image, image,
                                                           {"type": "text", "text": P1.format(n="two")}]}]
    assert row["completion"] == [{"role": "assistant", "content": STORIES[1]}]
    assert [im.size for im in row["images"]] == [(48, 40)] * 2  # each image, as they are on disk
    visual = sft_dataset(SFTRunConfig.from_mapping({**config.to_dict(), "setting": "visual"}), "vlm",
                         AutoProcessor.from_pretrained(vlm))
    assert len(visual[1]["images"]) == 1 and visual[1]["prompt"][0]["content"][0] == image


def _prompt_text(assets, tmp_path, **extra) -> str:
    from transformers import AutoTokenizer

    from storyrl.training.storyteller.sft import SFTRunConfig, sft_dataset

    config = SFTRunConfig.from_mapping(options(assets, tmp_path / "out", model="plain", **extra))
    return sft_dataset(config, "causal_lm", AutoTokenizer.from_pretrained(assets["plain"]))[0]["prompt"]


def test_prompt_prompts_file_and_fill_count_change_the_prompt(assets, tmp_path):
    from storyrl.generators.prompts import AUTHORS_PLACEHOLDER

    assert _prompt_text(assets, tmp_path) == P1.format(n="three")
    assert _prompt_text(assets, tmp_path, prompt="P2") == (
        "Generate a story consisting of three sentences for this image sequence. Use only three sentences and not more.")
    assert _prompt_text(assets, tmp_path, fill_count=False) == P1.format(n=AUTHORS_PLACEHOLDER)
    prompts = tmp_path / "mine.yaml"
    prompts.write_text(yaml.safe_dump({"prompts": [{"name": "mine", "kind": "visual", "text": "Tell {n} things:"}]}))
    assert _prompt_text(assets, tmp_path, prompts_file=str(prompts), prompt="mine") == "Tell three things:"


# -- training options -----------------------------------------------------------------------


def _weights(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(directory) / "model.safetensors")


def test_learning_rate_zero_keeps_the_weights(assets, tmp_path):
    import torch

    from storyrl.training.storyteller.sft import SFTRunConfig, train

    result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "out", learning_rate=0.0)), progress=False)
    before, after = _weights(assets["chat"]), _weights(result.final_dir)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_gradient_accumulation_makes_one_step_of_the_whole_batch(assets, tmp_path):
    import torch

    from storyrl.training.storyteller.sft import SFTRunConfig, train

    def run(name, **extra):
        result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / name, **extra)), progress=False)
        assert result.steps == 1
        return result, _weights(result.final_dir)

    whole, w_whole = run("whole", batch_size=2)
    accumulated, w_acc = run("acc", batch_size=1, gradient_accumulation_steps=2)
    _, w_single = run("single", batch_size=1)
    # Two batches of one, accumulated: the same loss (mean over all story tokens) and the same update.
    assert accumulated.summary()["last_loss"] == pytest.approx(whole.summary()["last_loss"], abs=1e-5)
    assert all(torch.allclose(w_acc[k], w_whole[k], atol=1e-6) for k in w_whole)
    assert not all(torch.allclose(w_single[k], w_whole[k], atol=1e-6) for k in w_whole)


@pytest.mark.parametrize("extra, steps", [({"epochs": 2.0, "max_steps": None}, 2),
                                          ({"epochs": 1.5, "max_steps": None, "batch_size": 1}, 3),
                                          ({"epochs": 2.0, "max_steps": 3}, 3)])
def test_epochs_unless_max_steps(assets, tmp_path, extra, steps):
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    result = train(SFTRunConfig.from_mapping(options(assets, tmp_path / "out", **extra)), progress=False)
    assert result.steps == steps
    assert [s for s, _ in _losses(result.history)] == list(range(1, steps + 1))


def test_max_length_cuts_the_story_end_and_a_prompt_that_does_not_fit_is_an_error(assets, tmp_path):
    from transformers import AutoTokenizer

    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

    ids, labels = hand_labels(AutoTokenizer.from_pretrained(assets["chat"]), STORIES[0], chat=True)
    prompt = labels.count(-100)
    cut = prompt + 3
    assert len(ids) > cut
    trainer = build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path, max_length=cut)), progress=False)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"][0].tolist() == ids[:cut]
    assert batch["labels"][0].tolist() == labels[:cut]
    with pytest.raises(ValueError, match=rf"max_length {prompt}: no story fits after its prompt"):
        build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path, max_length=prompt)), progress=False)


def test_shipped_config_loads_and_every_key_is_an_option(tmp_path):
    from dataclasses import fields

    from storyrl.training.storyteller.sft import SFTRunConfig
    from storyrl.training.storyteller.config import LoraOptions

    path = Path(__file__).parents[1] / "configs" / "training" / "sft.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    names = {f.name for f in fields(SFTRunConfig)}
    assert set(raw) <= names, set(raw) - names
    assert set(raw["lora"]) <= {f.name for f in fields(LoraOptions)}
    data = tmp_path / "train.story-in-sequence.json"  # the placeholder data path, made real here
    _write_vist(data, tmp_path / "images")
    config = SFTRunConfig.from_yaml(path, data=str(data))
    assert config.data == str(data)
    for key, value in raw.items():
        if key == "lora":
            assert {k: getattr(config.lora, k) for k in value} == value
        elif key != "data":
            assert getattr(config, key) == value, key


def test_turn_end_appends_eos_only_where_the_template_closes_no_turn(tmp_path):
    """TRL leaves a conversation's ending to the chat template: a template
    that closes no assistant turn would teach the policy never to stop."""
    from tiny_models import CHAT_TEMPLATE, chat_tokenizer

    from storyrl.training.storyteller.config import story_completion, turn_end

    open_turns = chat_tokenizer(TEXTS)
    assert turn_end(open_turns) == "[EOS]"
    closed = chat_tokenizer(TEXTS, chat_template=CHAT_TEMPLATE.replace("\n{% endfor %}",
                                                                       "{{ eos_token }}\n{% endfor %}"))
    assert turn_end(closed) == ""
    broken = chat_tokenizer(TEXTS, chat_template="{{ raise_exception('no') }}")
    assert turn_end(broken) == ""
    assert story_completion([{"role": "user", "content": "p"}], " a story. ", "[EOS]") == [
        {"role": "assistant", "content": "a story.[EOS]"}]
    assert story_completion("prompt:", "a story.", "[EOS]") == " a story."  # TRL adds EOS to plain text
    assert story_completion("prompt: ", "a story.") == "a story."


# -- review breaks: what a test must catch ------------------------------------------------


@pytest.mark.parametrize("setting", ["visual", "separate"])
def test_a_tapm_policy_with_an_image_setting_is_refused(assets, tmp_path, setting):
    from storyrl.training.storyteller.sft import SFTRunConfig

    with pytest.raises(ValueError, match=rf"setting {setting}: a tapm policy sees no images") as info:
        SFTRunConfig.from_mapping(options(assets, tmp_path, policy="tapm", setting=setting))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("story", ["", "  \n "])
def test_a_record_without_a_human_story_is_a_one_line_error(assets, tmp_path, story):
    from transformers import AutoTokenizer

    from storyrl.training.storyteller.sft import SFTRunConfig, sft_dataset

    data = tmp_path / "data.jsonl"
    rows = [json.loads(line) for line in Path(assets["data"]).read_text().splitlines()]
    rows[1]["story"] = story  # and no reference: nothing to learn
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = SFTRunConfig.from_mapping(options(assets, tmp_path / "out", data=str(data)))
    with pytest.raises(ValueError, match=r"story 's1' has no human story to train on") as info:
        sft_dataset(config, "causal_lm", AutoTokenizer.from_pretrained(assets["chat"]))
    assert "\n" not in str(info.value) and str(data) in str(info.value)


@pytest.mark.parametrize("model", ["chat", "plain"])
def test_a_text_batch_pads_on_the_right(assets, tmp_path, model):
    """Stories of different lengths: each row is its prompt and story from the
    first token, padding (labels -100, attention 0) after it."""
    from storyrl.training.storyteller.sft import SFTRunConfig, build_trainer

    trainer = build_trainer(SFTRunConfig.from_mapping(options(assets, tmp_path, model)), progress=False)
    # TRL 1.16's collator pads completions on the right whatever the tokenizer
    # says; the tokenizer is set to right too, for anything that follows it.
    assert trainer.processing_class.padding_side == "right"
    batch = trainer.data_collator([trainer.train_dataset[k] for k in range(2)])
    pad = trainer.processing_class.pad_token_id
    lengths = []
    for k, story in enumerate(STORIES):
        ids, labels = hand_labels(trainer.processing_class, story, chat=model == "chat")
        n, width = len(ids), batch["input_ids"].shape[1]
        lengths.append(n)
        assert batch["input_ids"][k].tolist() == ids + [pad] * (width - n)
        assert batch["labels"][k].tolist() == labels + [-100] * (width - n)
        assert batch["attention_mask"][k].tolist() == [1] * n + [0] * (width - n)
    assert lengths[0] != lengths[1]  # one row is padded
