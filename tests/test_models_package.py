"""storyrl.models as a package: importing it (or a reward module) loads no
torch, every name it offers resolves to its submodule's object, and the
reward options' defaults match the models'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "open_clip", "timm", "torchvision")


@pytest.mark.parametrize(
    "module",
    [
        "storyrl.models",
        "storyrl.models.runtime",
        "storyrl.models.caches",
        "storyrl.models.clip",
        "storyrl.models.glove",
        "storyrl.rewards.coherence",
        "storyrl.rewards.rovist_vg",
        "storyrl.rewards.clip_base",
        "storyrl.noun_phrases",
    ],
)
def test_import_loads_no_heavy_library(module):
    code = (
        f"import json, sys, {module}\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == []


def test_package_names_are_the_submodules_objects():
    import storyrl.models as models
    from storyrl.models import caches, clip, coherence, glove, rovist_vg, runtime, vlm

    homes = {
        "PRECISIONS": runtime, "release_models": runtime,
        "resolve_device": runtime, "resolve_precision": runtime, "shared_model": runtime,
        "DiskEmbeddingCache": caches, "LruDict": caches,
        "ClipEmbedder": clip, "ClipSpec": clip, "clip_embedder": clip,
        "GloVe": glove, "load_glove": glove, "shared_glove": glove,
        "CoherenceModel": coherence, "encode_pairs": coherence, "load_coherence_model": coherence,
        "RovistVGEmbedder": rovist_vg, "RovistVGModel": rovist_vg, "rovist_vg_embedder": rovist_vg,
        "DEFAULT_VLM": vlm, "VisionLanguageModel": vlm, "load_vlm": vlm,
    }
    assert set(models.__all__) == set(homes)
    for name, home in homes.items():
        assert getattr(models, name) is getattr(home, name), name
    assert set(models.__all__) <= set(dir(models))
    with pytest.raises(AttributeError):
        models.no_such_name  # noqa: B018


def test_shared_models_are_one_registry():
    from storyrl.models import release_models, shared_model

    calls = []
    first = shared_model(("test", "registry"), lambda: calls.append(1) or object())
    assert shared_model(("test", "registry"), lambda: calls.append(1) or object()) is first
    assert calls == [1]
    release_models()
    assert shared_model(("test", "registry"), lambda: calls.append(1) or object()) is not first
    release_models()


def test_coherence_reward_default_base_is_the_models():
    from storyrl.models.coherence import DEFAULT_BASE
    from storyrl.rewards.coherence import Coherence

    assert Coherence().config()["base_model"] == DEFAULT_BASE


def test_resolve_dtype_follows_resolve_precision():
    import torch

    from storyrl.models.runtime import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("fp32", cuda) is torch.float32 and resolve_dtype("fp16", cpu) is torch.float16
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    # auto: fp16 on CUDA, fp32 elsewhere (no CUDA device is needed to ask).
    assert resolve_dtype("auto", cuda) is torch.float16 and resolve_dtype("auto", cpu) is torch.float32
    with pytest.raises(ValueError, match="precision"):
        resolve_dtype("fp8", cpu)
