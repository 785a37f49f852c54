"""``storyrl train rl``: RLConfig, the prompt dataset, GRPO/RLOO through TRL
and the dispatch to storyrl's PPO, on CPU with a tiny random LLaMA and a
tiny random LLaVA-NeXT built here (tests/tiny_models.py; nothing downloaded).

Rewards: the composite ``weighted`` (repetition logged only, plus a
word-count reward that varies between completions, so that advantages are
not all zero) and a reward that raises for the first completion it sees.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TAPM_TEXTS, save_tiny_chat_vlm, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)
from storyrl.rewards import Reward, register_reward

REPO = Path(__file__).resolve().parents[1]
# The d_HM visual prompt P1 (configs/prompts/dhm.yaml), filled in by hand.
P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
WORDS = {3: "three", 4: "four"}
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
STEPS = 2


@register_reward()
class _Words(Reward):
    """Test reward: a tenth of the story's word count."""

    name = "test_rl_words"

    def _score_batch(self, stories, **context):
        return np.array([len(s.split()) / 10 for s in stories])


@register_reward()
class _Flaky(Reward):
    """Test reward: raises for the first story it scores (the batch, then
    that story alone), then scores distinct words / 10."""

    name = "test_rl_flaky"

    def _score_batch(self, stories, **context):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls <= 2:
            raise RuntimeError("flaky reward")
        return np.array([len(set(s.split())) / 10 for s in stories])


REWARDS = [
    {"reward": "weighted", "components": [{"reward": "repetition", "weight": 0.0},
                                          {"reward": "test_rl_words", "weight": 1.0}]},
    {"reward": "test_rl_flaky"},
]
REWARD_WEIGHTS = [1.0, 0.5]


pytestmark = pytest.mark.usefixtures("trl_offline")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    images = [str(p) for p in write_images(root / "images", 4)]
    data = root / "data.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for k in range(4):
            n = 3 + k % 2
            record = {"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k : k + 2]), "images": images[:n]}
            if k == 1:
                record["reference"] = "the human story of s1 ."
            f.write(json.dumps(record) + "\n")
    return {
        "root": root, "images": images, "data": str(data),
        "text": save_tiny_llama(root / "llama", TEXTS),
        "plain": save_tiny_llama(root / "llama_plain", TEXTS, chat=False),
        "vlm": save_tiny_chat_vlm(root / "vlm", TEXTS),
    }


def options(assets, out, algorithm="grpo", policy="text", lora=False, **extra):
    section = {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
               "learning_rate": 1e-3, "beta": 0.1, "logging_steps": 1, "save_strategy": "no",
               "gradient_checkpointing": False, **extra.pop(algorithm, {})}
    return {"algorithm": algorithm, "model": assets[policy], "data": assets["data"], "output_dir": str(out),
            "rewards": REWARDS, "reward_weights": REWARD_WEIGHTS, "max_steps": STEPS, "prompt": "P1",
            "lora": {"enabled": lora, "r": 4, "alpha": 8}, algorithm: section, **extra}


def rl_config(*args, **kwargs):
    from storyrl.training.storyteller.rl.config import RLConfig

    return RLConfig.from_mapping(options(*args, **kwargs))


def parameters(model):
    return {name: (p.detach().clone(), p.requires_grad) for name, p in model.named_parameters()}


def snapshot_callback():
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.before = parameters(model)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.after = parameters(model)

    return Snapshot()


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# -- GRPO / RLOO: two optimisation steps ----------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("policy", ["text", "vlm"])
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_two_steps_train_log_and_save(assets, tmp_path, algorithm, policy, lora):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import vision_parameter_names
    from storyrl.training.storyteller.rl.train import train

    config = rl_config(assets, tmp_path / "out", algorithm, policy, lora)
    snapshot = snapshot_callback()
    result = train(config, progress=False, callbacks=[snapshot])
    assert result.steps == STEPS

    # Trainable parameters changed; frozen ones (the LoRA base, a VLM's vision tower) did not.
    before, after = snapshot.before, snapshot.after
    trainable = {n for n, (_, grad) in after.items() if grad}
    changed = {n for n in after if not np.array_equal(before[n][0].numpy(), after[n][0].numpy())}
    assert trainable and changed == trainable, sorted(trainable ^ changed)[:5]
    if lora:
        assert trainable == {n for n in after if "lora_" in n}
    elif policy == "vlm":
        vision = set(vision_parameter_names(_model_of(config)))
        assert vision and not vision & trainable and set(after) - vision == trainable
    else:
        assert trainable == set(after)

    # Losses finite; every reward, every component, the story statistics and KL logged.
    steps = [e for e in result.history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for entry in steps:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["kl"])
        for key in ("rewards/weighted/mean", "rewards/test_rl_flaky/mean", "weighted/test_rl_words/mean",
                    "weighted/repetition/unscorable_frac", "story/sentences_mean", "story/words_mean",
                    "story/distinct_1", "story/empty_frac", "story/one_sentence_frac"):
            assert key in entry, key
        # Our token count of the completions equals TRL's own.
        assert entry["story/tokens_mean"] == pytest.approx(entry["completions/mean_length"])
    # The flaky reward raised for one of the 4 completions of step 1: that
    # completion went unscored and training went on.
    assert [e["test_rl_flaky/unscorable_frac"] for e in steps] == [0.25, 0.0]
    assert read_jsonl(Path(config.output_dir) / "history.jsonl") == json.loads(json.dumps(result.history))

    # Sample stories with every reward and the weighted total.
    samples = read_jsonl(Path(config.output_dir) / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2]
    assert samples[0]["samples"][0]["rewards"]["test_rl_flaky"] is None
    for line in samples:
        assert len(line["samples"]) == 3
        for sample in line["samples"]:
            weighted, flaky = sample["rewards"]["weighted"], sample["rewards"]["test_rl_flaky"]
            assert weighted == pytest.approx(len(sample["story"].split()) / 10)
            assert sample["reward"] == pytest.approx(weighted + (0.0 if flaky is None else 0.5 * flaky))

    # final/: adapters or full weights, the tokenizer/processor and the config, which loads back.
    final = Path(result.final_dir)
    assert (final / ("adapter_config.json" if lora else "model.safetensors")).is_file()
    assert (final / ("processor_config.json" if policy == "vlm" else "tokenizer.json")).is_file()
    for path in (Path(config.output_dir) / "rl_config.yaml", final / "rl_config.yaml"):
        assert RLConfig.from_yaml(path).to_dict() == config.to_dict()
    if policy == "vlm":  # the saved VLM (adapters on the base, or full weights) generates
        from storyrl.datasets import load_records
        from storyrl.training.storyteller.rl.policy import generate_stories

        stories = generate_stories(config, str(final), load_records(assets["data"])[:2], batch_size=2)
        assert list(stories) == ["s0", "s1"] and all(isinstance(v, str) for v in stories.values())


def test_lora_merge_saves_full_weights_changed_only_where_adapters_were(assets, tmp_path):
    from safetensors.numpy import load_file

    from storyrl.training.storyteller.rl.train import train

    config = rl_config(assets, tmp_path / "out", lora=True, max_steps=1)
    config.lora.merge = True
    final = Path(train(config, progress=False).final_dir)
    assert not (final / "adapter_config.json").exists() and (final / "tokenizer.json").is_file()
    base, merged = load_file(Path(assets["text"]) / "model.safetensors"), load_file(final / "model.safetensors")
    assert base.keys() == merged.keys()
    changed = {k for k in base if not np.array_equal(base[k], merged[k])}
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert changed and all(k.split(".")[-2] in targets for k in changed)
    assert {k.split(".")[-2] for k in changed} == set(targets)


def _model_of(config):
    from storyrl.training.storyteller.rl.policy import load_policy

    return load_policy(config).model


def test_lora_runs_keep_the_vlm_vision_tower_without_adapters(assets):
    from storyrl.training.storyteller.rl.policy import lora_config, vision_parameter_names

    from peft import get_peft_model

    config = rl_config(assets, "unused", policy="vlm", lora=True)
    model = get_peft_model(_model_of(config), lora_config(config, "vlm"))
    adapted = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert adapted and not set(adapted) & set(vision_parameter_names(model))
    assert any("language_model" in n for n in adapted)


# -- resume -------------------------------------------------------------------------------------


def test_resume_equals_an_uninterrupted_run(assets, tmp_path):
    """A run that crashes at step 4 of 4, after logging it, resumes from its
    checkpoint at step 3 (inside the second pass over the 4 prompts, 2 per
    step): the same weights, losses and samples as 4 steps in one go (prompt
    order, sampling and LoRA dropout included), and its history.jsonl and
    samples.jsonl hold each step once."""
    from safetensors.numpy import load_file
    from transformers import TrainerCallback

    from storyrl.training.storyteller.rl.train import train

    class CrashAfterLogging4(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise KeyboardInterrupt

    def config(out):  # the flaky reward would raise again after the restart: left out
        return rl_config(assets, out, lora=True, max_steps=4, rewards=REWARDS[:1], reward_weights=[1.0],
                         grpo={"save_strategy": "steps", "save_steps": 3})

    whole = train(config(tmp_path / "whole"), progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "cut"), progress=False, callbacks=[CrashAfterLogging4()])
    assert sorted(p.name for p in (tmp_path / "cut").iterdir() if p.is_dir()) == ["checkpoint-3"]
    resumed = train(config(tmp_path / "cut"), resume=True, progress=False)

    assert resumed.steps == whole.steps == 4
    a = load_file(Path(whole.final_dir) / "adapter_model.safetensors")
    b = load_file(Path(resumed.final_dir) / "adapter_model.safetensors")
    at3 = load_file(tmp_path / "cut" / "checkpoint-3" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], at3[k]) for k in a)  # step 4 did change them
    losses = [[e["loss"] for e in r.history if "loss" in e] for r in (whole, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert [e["step"] for e in read_jsonl(tmp_path / "cut" / "history.jsonl") if "loss" in e] == [1, 2, 3, 4]
    samples = [read_jsonl(tmp_path / run / "samples.jsonl") for run in ("whole", "cut")]
    assert samples[0] == samples[1] and [s["step"] for s in samples[1]] == [1, 2, 3, 4]


# -- the prompt dataset --------------------------------------------------------------------------


@pytest.mark.parametrize("policy,setting", [("text", "auto"), ("plain", "auto"), ("vlm", "auto"),
                                            ("vlm", "separate")])
def test_prompt_dataset_rows(assets, policy, setting):
    from PIL import Image

    from storyrl.generators.sequence_image import sequence_image
    from storyrl.training.storyteller.rl.data import build_dataset
    from storyrl.training.storyteller.rl.policy import load_policy

    config = rl_config(assets, "unused", policy=policy, setting=setting)
    loaded = load_policy(config)
    dataset = build_dataset(config, loaded.kind, loaded.processing_class)
    assert len(dataset) == 4
    for k, row in enumerate(dataset):
        n = 3 + k % 2
        text = P1.format(n=WORDS[n])
        assert row["story_id"] == f"s{k}"
        assert row["story_images"] == assets["images"][:n]
        assert row["reference"] == ("the human story of s1 ." if k == 1 else " ".join(TAPM_TEXTS[k : k + 2]))
        if policy == "plain":  # no chat template: the text as is
            assert row["prompt"] == text and "images" not in row
        elif policy == "text":
            assert row["prompt"] == [{"role": "user", "content": text}] and "images" not in row
        else:
            (message,) = row["prompt"]
            entries = [c["type"] for c in message["content"]]
            expected = [sequence_image(assets["images"][:n])] if setting == "auto" else \
                [Image.open(p).convert("RGB") for p in assets["images"][:n]]
            assert entries == ["image"] * len(expected) + ["text"] and message["content"][-1]["text"] == text
            assert len(row["images"]) == len(expected)
            for got, want in zip(row["images"], expected):
                assert np.array_equal(np.asarray(got), np.asarray(want))


def test_generate_stories_equals_greedy_decoding_by_hand(assets, tmp_path):
    """A saved policy's stories: the chat-templated prompt, greedy, as
    transformers decodes it directly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.datasets import load_records
    from storyrl.training.storyteller.rl.policy import generate_stories

    config = rl_config(assets, tmp_path / "out")
    records = load_records(assets["data"])
    got = generate_stories(config, assets["text"], records, batch_size=3)
    tokenizer = AutoTokenizer.from_pretrained(assets["text"])
    model = AutoModelForCausalLM.from_pretrained(assets["text"]).eval()
    for k, record in enumerate(records):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": P1.format(n=WORDS[3 + k % 2])}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=8, do_sample=False)
        want = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert got[record.story_id] == want


# -- RLConfig ----------------------------------------------------------------------------------


def write_yaml(path, data):
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_run_level_keys_flow_into_the_algorithm_and_only_given_keys_are_saved(assets, tmp_path, monkeypatch):
    import importlib.util

    from trl import GRPOConfig

    from storyrl.training.storyteller.rl.config import RLConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # tensorboard as if installed (storyrl does not need it)
                        lambda name, *a: object() if name == "tensorboard" else real(name, *a))
    config = rl_config(assets, tmp_path / "out", seed=7, report_to="tensorboard")
    grpo = config.grpo
    assert (grpo.output_dir, grpo.seed, grpo.max_steps, grpo.reward_weights) == \
        (str(tmp_path / "out"), 7, STEPS, REWARD_WEIGHTS)
    assert grpo.report_to == ["tensorboard"] and grpo.use_cpu and not grpo.bf16  # no CUDA here
    assert config.ppo is None and config.rloo is None
    saved = write_yaml(tmp_path / "saved.yaml", config.to_dict())
    assert config.to_dict()["grpo"] == options(assets, "x")["grpo"]  # what was given, nothing derived
    again = RLConfig.from_yaml(saved)
    assert again.to_dict() == config.to_dict() and again.grpo.to_dict() == grpo.to_dict()
    # A copy with another output_dir carries it into the TRL config too.
    moved = dataclasses.replace(config, output_dir=str(tmp_path / "elsewhere"))
    assert moved.grpo.output_dir == str(tmp_path / "elsewhere") and moved.grpo.learning_rate == 1e-3
    # A GRPOConfig built in Python: its changed keys are what is saved.
    built = RLConfig.from_mapping({**options(assets, tmp_path / "out"),
                                   "grpo": GRPOConfig(output_dir="x", use_cpu=True, bf16=False, beta=0.2,
                                                      per_device_train_batch_size=4, num_generations=2)})
    assert built.to_dict()["grpo"] == {"beta": 0.2, "per_device_train_batch_size": 4, "num_generations": 2,
                                       "generation_batch_size": 4}
    assert built.grpo.output_dir == str(tmp_path / "out")
    assert RLConfig.from_yaml(write_yaml(tmp_path / "b.yaml", built.to_dict())).grpo.beta == 0.2
    # The default algorithm config is made when its section is left out.
    bare = {k: v for k, v in options(assets, tmp_path / "o", "rloo").items() if k != "rloo"}
    assert RLConfig.from_mapping(bare).rloo.max_steps == STEPS


@pytest.mark.parametrize("change,message", [
    ({"grpo": {"seed": 3}}, r"grpo: set seed at the top level"),
    ({"grpo": {"output_dir": "x", "reward_weights": [1, 1]}}, r"grpo: set output_dir, reward_weights at the top"),
    ({"grpo": {"no_such_key": 1}}, r"grpo: unknown key 'no_such_key'"),
    ({"grpo": {"num_generations": 3}}, r"grpo: generation_batch_size \(8\) must be divisible by num_generations \(3\)"),
    ({"algorithm": "ppo", "grpo": None, "ppo": {"kl_estimator": "k9"}}, r"ppo: .*kl_estimator must be one of k1, k3"),
    ({"ppo": {"kl_estimator": "k1"}}, r"ppo: options for algorithm ppo, but the run's algorithm is grpo"),
    ({"rewards": ["nope"]}, r"rewards\[0\]: unknown reward 'nope'"),
    ({"rewards": [{"reward": "repetition", "chunk_size": 0}]}, r"rewards\[0\]: .*chunk_size"),
    ({"rewards": ["repetition", {"reward": "repetition"}]}, r"two rewards named 'repetition'"),
    ({"reward_weights": [1.0]}, r"reward_weights: 1 weights for 2 rewards"),
    ({"load_in_4bit": True}, r"load_in_4bit: a 4-bit base trains through LoRA adapters only"),
    ({"prompt": "P9"}, r"no visual prompt named 'P9'"),
    ({"report_to": "carrier-pigeon"}, r"report_to: unknown tracker 'carrier-pigeon'"),
    ({"data": "missing.jsonl"}, r"data: no such file missing.jsonl"),
    ({"algorithm": "a2c"}, r"algorithm must be one of ppo, grpo, rloo"),
    ({"max_steps": "2"}, r"key 'max_steps': expected an integer"),
])
def test_config_errors_name_the_file_and_the_key(assets, tmp_path, change, message):
    from storyrl.training.storyteller.rl.config import RLConfig

    path = write_yaml(tmp_path / "bad.yaml", {**options(assets, tmp_path / "out"), **change})
    with pytest.raises(ValueError, match=f"^{path}: RLConfig: .*{message}") as info:
        RLConfig.from_yaml(path)
    assert "\n" not in str(info.value)


def test_tapm_policies_train_with_ppo_only(assets, tmp_path):
    from storyrl.training.storyteller.rl.config import RLConfig

    tapm = tmp_path / "tapm"
    tapm.mkdir()
    (tapm / "config.json").write_text(json.dumps({"model_type": "storyrl_tapm"}))
    for algorithm in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=f"algorithm {algorithm}: a TAPM policy trains with ppo only"):
            RLConfig.from_mapping(options(assets, tmp_path / "o", algorithm, model=str(tapm)))
    ppo = RLConfig.from_mapping({**options(assets, tmp_path / "o", "ppo", model=str(tapm)), "ppo": {}})
    assert ppo.policy_kind() == "tapm" and ppo.resolved_setting("tapm") == "text"
    with pytest.raises(ValueError, match="a TAPM policy keeps the adapters"):
        RLConfig.from_mapping({**options(assets, tmp_path / "o", "ppo", model=str(tapm), lora=True), "ppo": {}})


def test_ppo_refuses_callbacks_in_one_line_before_loading_anything(assets, tmp_path):
    from storyrl.training.storyteller.rl.config import ALGORITHMS, RLConfig
    from storyrl.training.storyteller.rl.train import train

    assert [n for n, a in ALGORITHMS.items() if not a.callbacks] == ["ppo"]
    config = RLConfig.from_mapping({**options(assets, tmp_path / "o", "ppo"), "ppo": {}})
    with pytest.raises(ValueError) as caught:
        train(config, progress=False, callbacks=[snapshot_callback()])
    assert str(caught.value) == ("algorithm ppo: callbacks (transformers TrainerCallback objects) are for grpo, "
                                 "rloo; storyrl's ppo takes none: leave callbacks unset")
    assert not (tmp_path / "o" / "rl_config.yaml").exists()  # refused before the run started


def test_detected_policies(assets):
    from storyrl.training.storyteller.rl.policy import detect_policy

    assert detect_policy(assets["text"]) == "causal_lm" and detect_policy(assets["vlm"]) == "vlm"
    assert detect_policy("some/hub-model", read_hub=False) is None


def test_4bit_without_cuda_is_a_one_line_error(assets):
    import torch

    from storyrl.training.storyteller.rl.policy import load_policy

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    config = rl_config(assets, "unused", lora=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="^load_in_4bit needs a CUDA device"):
        load_policy(config)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "rl").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_rl_configs_load(path, assets, monkeypatch):
    from storyrl.training.storyteller.rl.config import RLConfig

    monkeypatch.chdir(REPO)  # reward config paths are relative to the checkout
    config = RLConfig.from_yaml(path.relative_to(REPO), data=assets["data"])  # their data is not here
    assert config.algorithm_config().output_dir == config.output_dir
    assert config.algorithm_config().seed == config.seed
    assert path.stem.startswith(config.algorithm)


# -- accelerate configs ----------------------------------------------------------------------------

ACCELERATE = {"single_gpu": ("NO", 1, 1, None), "multi_gpu": ("MULTI_GPU", 8, 1, None),
              "deepspeed_zero2": ("DEEPSPEED", 8, 1, 2), "deepspeed_zero3": ("DEEPSPEED", 8, 1, 3),
              "multi_node": ("MULTI_GPU", 16, 2, None)}


@pytest.mark.parametrize("name", sorted(ACCELERATE))
def test_accelerate_configs_load_as_accelerate_launch_reads_them(name):
    """accelerate's own loader and launch-argument validation (what
    `accelerate launch --config_file ...` runs before starting processes)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = str(REPO / "configs" / "accelerate" / f"{name}.yaml")
    kind, processes, machines, zero = ACCELERATE[name]
    loaded = load_config_from_file(path)
    assert (str(loaded.distributed_type).split(".")[-1], loaded.num_processes, loaded.num_machines) == \
        (kind, processes, machines)
    args = launch_command_parser().parse_args(
        ["--config_file", path, "-m", "storyrl", "train", "rl", "--config", "configs/rl/grpo_llava_next.yaml"])
    args, _, _ = _validate_launch_command(args)
    assert args.module and args.training_script == "storyrl"
    assert args.training_script_args == ["train", "rl", "--config", "configs/rl/grpo_llava_next.yaml"]
    assert bool(args.use_deepspeed) == (zero is not None) and args.zero_stage == zero
    assert args.num_processes == processes and args.mixed_precision == "bf16"
    readme = (REPO / "configs" / "accelerate" / "README.md").read_text(encoding="utf-8")
    assert f"--config_file configs/accelerate/{name}.yaml" in readme


# -- the command line ---------------------------------------------------------------------------------


def run_cli(*args):
    from click.testing import CliRunner

    from storyrl.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_trains_and_prints_a_summary(assets, tmp_path):
    config = write_yaml(tmp_path / "rl.yaml", options(assets, tmp_path / "out", "rloo", max_steps=5))
    result = run_cli("train", "rl", "--config", config, "--max-steps", 1, "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["algorithm"] == "rloo" and summary["steps"] == 1
    assert summary["final"] == str(tmp_path / "out" / "final") and Path(summary["final"]).is_dir()
    assert "max_steps: 1" in (tmp_path / "out" / "rl_config.yaml").read_text()  # the option won


def test_cli_errors_are_one_line(assets, tmp_path):
    help_text = run_cli("train", "rl", "--help").output
    assert "--algorithm [ppo|grpo|rloo]" in help_text and "--data" in help_text
    bad = write_yaml(tmp_path / "bad.yaml", {**options(assets, tmp_path / "out"), "grpo": {"seed": 1}})
    for args in (["--config", bad], ["--config", write_yaml(tmp_path / "ok.yaml", options(assets, tmp_path / "o")),
                                     "--data", tmp_path / "bad.yaml", "--data-format", "vwp"]):
        result = run_cli("train", "rl", *args, "-q")
        errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
        assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "grpo: set seed at the top level" in run_cli("train", "rl", "--config", bad).output


def test_cli_dispatches_ppo(assets, tmp_path):
    """algorithm ppo runs storyrl's PPOTrainer on the same dataset and rewards."""
    config = write_yaml(tmp_path / "ppo.yaml", {
        **{k: v for k, v in options(assets, tmp_path / "out", "ppo", lora=True).items() if k != "ppo"},
        "ppo": {"per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8,
                "num_ppo_epochs": 1, "learning_rate": 1e-3, "save_steps": 1}})
    result = run_cli("train", "rl", "--config", config, "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["algorithm"] == "ppo" and summary["steps"] == STEPS
    history = read_jsonl(tmp_path / "out" / "history.jsonl")
    assert [h["step"] for h in history] == [1, 2]
    assert all("story/sentences_mean" in h and "weighted/test_rl_words/mean" in h for h in history)
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


def train_two_processes(config_path) -> str:
    """`storyrl train rl` under `torch.distributed.run --nproc_per_node 2`
    (what accelerate launch starts); its stdout, after checking it exited 0."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "-m", "storyrl", "train", "rl", "--config", str(config_path), "-q"]
    # Its own process group: a hung run is killed with both of its workers.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def test_two_processes_under_torch_launcher(assets, tmp_path):
    """`python -m torch.distributed.run --nproc_per_node 2 -m storyrl train rl`
    (what accelerate launch starts): both processes train, the main one alone
    writes the samples, history and final policy."""
    # rouge_l against the record's story scores any text (a run that scores no story fails)
    config = {**options(assets, tmp_path / "out", lora=True), "rewards": ["rouge_l"], "reward_weights": None}
    config["grpo"]["per_device_train_batch_size"] = 2  # 2 processes x 2 completions = one group per process
    stdout = train_two_processes(write_yaml(tmp_path / "rl.yaml", config))
    summaries = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 2 and all(s["steps"] == STEPS for s in summaries)
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2] and all(len(s["samples"]) == 2 for s in samples)
    assert [e["step"] for e in read_jsonl(tmp_path / "out" / "history.jsonl") if "loss" in e] == [1, 2]
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


def test_tapm_policy_trains_with_ppo_and_generates(tmp_path):
    """A TAPM directory as the policy: detected, its records' image ids and
    the feature directory reach storyrl's PPO, final/ is a TAPM directory
    that the tapm generator runs."""
    import tiny_models
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.datasets import load_records
    from storyrl.generators.tapm import TapmGenerator
    from storyrl.generators.tapm.features import FeatureExtractor, FeatureStore, write_features
    from storyrl.generators.tapm.model import TapmModel
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import generate_stories
    from storyrl.training.storyteller.rl.train import train

    images = tiny_models.write_images(tmp_path / "img", n=5)
    write_features(tmp_path / "features", [(p.stem, str(p)) for p in images],
                   FeatureExtractor("test_resnet", pretrained=False, device="cpu"), batch_size=5)
    decoder = tiny_models.save_tiny_decoder(tmp_path / "gpt2")
    tokenizer, store = AutoTokenizer.from_pretrained(decoder), FeatureStore(tmp_path / "features")
    model = TapmModel.from_decoder(AutoModelForCausalLM.from_pretrained(decoder), tokenizer,
                                   {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, seed=0)
    model.save_pretrained(tmp_path / "tapm")
    tokenizer.save_pretrained(tmp_path / "tapm")
    data = tmp_path / "data.jsonl"
    ids = [["img0", "img1", "img2"], ["img1", "img2", "img3", "img4"], ["img4", "img0", "img1"], ["img2", "img3"]]
    data.write_text("".join(json.dumps({"story_id": f"t{k}", "story": "a dog ran . the cat sat .", "image_ids": i})
                            + "\n" for k, i in enumerate(ids)))
    config = RLConfig.from_mapping({
        "algorithm": "ppo", "model": str(tmp_path / "tapm"), "data": str(data), "image_root": str(tmp_path / "img"),
        "output_dir": str(tmp_path / "out"), "rewards": ["repetition"], "max_steps": STEPS,
        "ppo": {"per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 6, "num_ppo_epochs": 1,
                "learning_rate": 1e-3, "tapm_features": str(tmp_path / "features")}})
    assert config.policy_kind() == "tapm"
    result = train(config, progress=False)
    assert result.steps == STEPS and all("story/sentences_mean" in h for h in result.history)
    final = Path(result.final_dir)
    before, after = load_file(tmp_path / "tapm" / "model.safetensors"), load_file(final / "model.safetensors")
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    TapmModel.from_pretrained(final)
    records = load_records(data)
    stories = generate_stories(config, str(final), records, batch_size=3)
    direct = TapmGenerator(model=str(final), features=str(tmp_path / "features"), max_new_tokens=6).generate(records)
    # the same stories both ways; a story that decodes to nothing is a failure both ways (None / failures)
    assert set(stories) == {r.story_id for r in records}
    assert {k: v for k, v in stories.items() if v is not None} == direct.stories
    assert {k for k, v in stories.items() if v is None} == set(direct.failures)
