"""TRL's vLLM generation for GRPO/RLOO (storyrl.training.storyteller.rl.vllm_options):
refused in one line where vLLM is missing (it is, here), every key's values
and the combinations TRL would refuse late or ignore checked when the RL
config is read, the keys reaching TRL's config unchanged, and TRL's
in-place LoRA merge for the weight sync kept off the base weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import tiny_models

import storyrl  # noqa: F401  (torchvision fallback before transformers)
from storyrl.training.storyteller.rl import vllm_options

pytestmark = pytest.mark.usefixtures("trl_offline")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    data = root / "data.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "a story .", "images": []}) + "\n")
    return {"data": str(data), "model": tiny_models.save_tiny_llama(root / "llama", tiny_models.TAPM_TEXTS)}


def build(files, tmp_path, algorithm="grpo", section=None, **top):
    from storyrl.training.storyteller.rl.config import RLConfig

    section = {"max_completion_length": 16, **(section or {})}
    return RLConfig.from_mapping({"algorithm": algorithm, "model": files["model"], "data": files["data"],
                                  "output_dir": str(tmp_path), "rewards": ["bleu"], "prompt": "P1",
                                  algorithm: section, **top})


@pytest.fixture
def vllm_here(monkeypatch):
    """vLLM installed and a CUDA device, as far as the checks can tell."""
    monkeypatch.setattr(vllm_options, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_options, "cuda_available", lambda: True)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_use_vllm_without_vllm_is_one_line(files, tmp_path, algorithm):
    from storyrl.config import ConfigError

    assert not vllm_options.vllm_installed()  # this machine has no vLLM
    with pytest.raises(ConfigError) as info:
        build(files, tmp_path, algorithm, {"use_vllm": True, "vllm_gpu_memory_utilization": 5.0})
    message = str(info.value)
    assert "\n" not in message and message.count(";") <= 1  # one fault, not the values it would go on to check
    assert f"{algorithm}.use_vllm: vLLM is not installed" in message and 'pip install -e ".[vllm]"' in message


def test_without_a_gpu_vllm_is_refused(files, tmp_path, monkeypatch):
    from storyrl.config import ConfigError

    monkeypatch.setattr(vllm_options, "vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match=r"grpo.use_vllm: no CUDA device; vLLM samples on GPUs"):
        build(files, tmp_path, section={"use_vllm": True})


BAD_VALUES = [
    ({"vllm_mode": "local"}, "vllm_mode: colocate"),
    ({"vllm_model_impl": "hf"}, "vllm_model_impl: vllm or transformers"),
    ({"vllm_mode": "server", "vllm_server_port": 0}, "vllm_server_port: a port number"),
    ({"vllm_mode": "server", "vllm_server_port": 70000}, "vllm_server_port: a port number"),
    ({"vllm_mode": "server", "vllm_group_port": -1}, "vllm_group_port: a port number"),
    ({"vllm_mode": "server", "vllm_server_timeout": 0.0}, "vllm_server_timeout: seconds > 0"),
    ({"vllm_mode": "server", "vllm_server_host": ""}, "vllm_server_host: a host name"),
    ({"vllm_mode": "server", "vllm_server_base_url": "localhost:8000"}, "vllm_server_base_url: an http://"),
    ({"vllm_gpu_memory_utilization": 0.0}, r"vllm_gpu_memory_utilization: a share .* \(0, 1\]"),
    ({"vllm_gpu_memory_utilization": 1.5}, r"vllm_gpu_memory_utilization: a share .* \(0, 1\]"),
    ({"vllm_tensor_parallel_size": 0}, "vllm_tensor_parallel_size: GPUs per vLLM engine"),
    ({"vllm_max_model_length": 16}, r"vllm_max_model_length: a context longer than max_completion_length \(16\)"),
    ({"vllm_structured_outputs_regex": ""}, "vllm_structured_outputs_regex: a regular expression"),
    ({"vllm_importance_sampling_mode": "token"}, "vllm_importance_sampling_mode: token_truncate"),
    ({"vllm_importance_sampling_clip_max": -1.0}, "vllm_importance_sampling_clip_max: a ratio bound > 0"),
    ({"vllm_importance_sampling_clip_min": 0.0}, "vllm_importance_sampling_clip_min: a ratio bound > 0"),
    # keys TRL would ignore
    ({"vllm_server_port": 8001}, "vllm_server_port: applies to vllm_mode server only; vllm_mode is colocate"),
    ({"vllm_mode": "server", "vllm_gpu_memory_utilization": 0.5},
     "vllm_gpu_memory_utilization: applies to vllm_mode colocate only; vllm_mode is server"),
    ({"vllm_mode": "server", "vllm_enable_sleep_mode": True}, "vllm_enable_sleep_mode: applies to vllm_mode colocate"),
    ({"vllm_mode": "server", "vllm_server_base_url": "http://gpu:8000", "vllm_server_port": 8001},
     "vllm_server_port: vllm_server_base_url is given and wins"),
    ({"cache_implementation": "static"}, "cache_implementation: transformers' KV cache; vLLM manages its own"),
]


@pytest.mark.parametrize("keys,message", BAD_VALUES, ids=[next(iter(k.items()))[0] + f"-{i}"
                                                          for i, (k, _) in enumerate(BAD_VALUES)])
def test_every_vllm_key_is_checked(files, tmp_path, vllm_here, keys, message):
    from storyrl.config import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        build(files, tmp_path, section={"use_vllm": True, **keys})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keys,message", [
    ({"use_vllm": "yes"}, "key 'use_vllm'"),
    ({"use_vllm": True, "vllm_server_port": "8000"}, "key 'vllm_server_port'"),
    ({"use_vllm": True, "vllm_gpu_memory_utilization": float("nan")}, "key 'vllm_gpu_memory_utilization'"),
])
def test_vllm_keys_are_typed_not_coerced(files, tmp_path, vllm_here, keys, message):
    with pytest.raises(ValueError, match=message):
        build(files, tmp_path, section=keys)


def test_vllm_keys_without_use_vllm_are_refused(files, tmp_path):
    from storyrl.config import ConfigError

    with pytest.raises(ConfigError, match="rloo.vllm_mode: has no effect without use_vllm: true"):
        build(files, tmp_path, "rloo", {"vllm_mode": "server"})


def test_4bit_with_vllm_is_refused(files, tmp_path, vllm_here):
    from storyrl.config import ConfigError

    with pytest.raises(ConfigError, match="load_in_4bit with grpo.use_vllm: vLLM would quantise the policy"):
        build(files, tmp_path, section={"use_vllm": True}, load_in_4bit=True, lora={"enabled": True})


COLOCATE = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.45,
            "vllm_tensor_parallel_size": 2, "vllm_max_model_length": 2048, "vllm_enable_sleep_mode": True,
            "vllm_model_impl": "transformers", "vllm_structured_outputs_regex": "[a-z .]+"}
SERVER = {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "10.0.0.2", "vllm_server_port": 8001,
          "vllm_server_timeout": 60.0, "vllm_group_port": 51300}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
@pytest.mark.parametrize("keys", [COLOCATE, SERVER, {"use_vllm": True, "vllm_mode": "server",
                                                      "vllm_server_base_url": "https://gpu.example:9000"}],
                         ids=["colocate", "server", "base_url"])
def test_vllm_keys_reach_trls_config_unchanged(files, tmp_path, vllm_here, algorithm, keys):
    import trl

    from storyrl.training.storyteller.rl.config import RLConfig

    config = build(files, tmp_path, algorithm, dict(keys))
    built = config.algorithm_config()
    assert isinstance(built, trl.GRPOConfig if algorithm == "grpo" else trl.RLOOConfig)
    assert {k: getattr(built, k) for k in keys} == keys
    config.to_yaml(tmp_path / "rl.yaml")  # saved as given, read back the same
    again = RLConfig.from_yaml(tmp_path / "rl.yaml").algorithm_config()
    assert {k: getattr(again, k) for k in keys} == keys


def test_tensor_parallelism_must_divide_the_processes(files, tmp_path, vllm_here):
    from storyrl.training.storyteller.rl.trl_trainers import train_trl

    config = build(files, tmp_path, section={"use_vllm": True, "vllm_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"grpo.vllm_tensor_parallel_size 2 does not divide the 1 training"):
        train_trl(config, SimpleNamespace(kind="causal_lm"), [], [])


# -- TRL's weight sync: LoRA merged in place and back, on copies ------------------------------


def _bf16_lora():
    import peft
    import torch

    tokenizer = tiny_models.chat_tokenizer(["the red dog ran to the park ."])
    model = peft.get_peft_model(tiny_models.tiny_llama(tokenizer).to(torch.bfloat16),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    return model


def _base_weights(model):
    from storyrl.training.storyteller.rl.sampling import lora_layers

    return {k: layer.get_base_layer().weight.detach().clone() for k, (_, _, layer) in enumerate(lora_layers(model))}


def trl_like_sync(model, seen):
    """What TRL's VLLMGeneration does with a peft model: merge in place,
    read the merged weights, unmerge in place."""
    model.merge_adapter()
    seen.append(_base_weights(model))
    model.unmerge_adapter()


def test_the_weight_sync_leaves_the_bf16_base_as_it_was():
    import torch

    from storyrl.training.storyteller.rl.sampling import kept_base_weights

    model = _bf16_lora()
    before = _base_weights(model)
    seen = []
    trl_like_sync(model, seen)  # TRL's own round trip rounds in bf16: the frozen base drifts
    assert any(not torch.equal(before[k], w) for k, w in _base_weights(model).items())

    model = _bf16_lora()
    before = _base_weights(model)
    with kept_base_weights(model) as guarded:
        trl_like_sync(model, seen)
    assert guarded == 4
    assert all(torch.equal(before[k], w) for k, w in _base_weights(model).items())
    assert any(not torch.equal(before[k], w) for k, w in seen[-1].items())  # vLLM got the merged weights


def test_the_trainer_wraps_trls_weight_sync():
    import torch

    from storyrl.training.storyteller.rl.trl_trainers import _merged_sampling

    model, seen = _bf16_lora(), []

    class FakeTrainer:  # what the wrapper reads of TRL's trainer
        def __init__(self):
            self.use_vllm, self.model = True, model
            self.accelerator = SimpleNamespace(unwrap_model=lambda m: m)
            self.vllm_generation = SimpleNamespace(sync_weights=lambda: trl_like_sync(model, seen))

    before = _base_weights(model)
    _merged_sampling(FakeTrainer, True)().vllm_generation.sync_weights()
    assert seen and all(torch.equal(before[k], w) for k, w in _base_weights(model).items())
