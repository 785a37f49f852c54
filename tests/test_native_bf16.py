"""bf16 on a CUDA card that only emulates it (a T4, a V100): torch >= 2.3's
``is_bf16_supported()`` says yes there unless asked about native support, so
every bf16 decision in storyrl asks ``cuda_native_bf16``. A simulated T4
(emulation yes, native no) must be treated as a card without bf16: refused
where bf16 is asked for, never picked by ``auto``."""

from __future__ import annotations

import json

import pytest

import storyrl  # noqa: F401  (before torch/transformers: CPU torchvision fallback)


def _card(monkeypatch, native: bool) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # torch's own signature and answer: emulation counts unless including_emulation=False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)


@pytest.fixture
def rl_keys(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "A dog ran.", "image_ids": ["a"]}) + "\n")
    return {"model": "m", "policy": "causal_lm", "setting": "text", "data": str(data),
            "output_dir": str(tmp_path / "o"), "rewards": ["bleu"], "algorithm": "grpo"}


def test_an_emulating_card_has_no_bf16(monkeypatch, rl_keys):
    import torch

    from storyrl.models.runtime import PrecisionError, cuda_native_bf16, resolve_precision
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import training_dtype
    from storyrl.training.storyteller.rl.ppo.config import PPOConfig

    _card(monkeypatch, native=False)
    assert torch.cuda.is_bf16_supported()  # what the old checks asked
    assert not cuda_native_bf16()
    with pytest.raises(PrecisionError, match="does not support bfloat16"):
        resolve_precision("bf16", torch.device("cuda:0"))
    assert training_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="mixed_precision: bf16 needs a GPU with bf16 support"):
        PPOConfig(mixed_precision="bf16")
    with pytest.raises(ValueError, match="precision: bf16 needs a GPU with bf16 support"):
        RLConfig.from_mapping({**rl_keys, "precision": "bf16", "grpo": {"use_cpu": True, "bf16": False}})
    # TRL's default mixed precision on this card: not bf16 (TRL's config itself needs a real GPU)
    assert RLConfig._device_defaults({}) == {"bf16": False}


def test_a_native_card_has_bf16(monkeypatch, rl_keys):
    import torch

    from storyrl.models.runtime import cuda_native_bf16, resolve_precision
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import training_dtype
    from storyrl.training.storyteller.rl.ppo.config import PPOConfig

    _card(monkeypatch, native=True)
    assert cuda_native_bf16()
    assert resolve_precision("bf16", torch.device("cuda:0")) == "bf16"
    assert training_dtype("auto") == torch.bfloat16
    PPOConfig(mixed_precision="bf16")
    RLConfig.from_mapping({**rl_keys, "precision": "bf16", "grpo": {"use_cpu": True, "bf16": False}})
    assert RLConfig._device_defaults({}) == {"bf16": True}


def test_without_cuda_there_is_no_native_bf16(monkeypatch):
    import torch

    from storyrl.models.runtime import cuda_native_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cuda_native_bf16()
