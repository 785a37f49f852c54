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


# -- caches: a request larger than the in-memory cache --------------------------------------------


def test_fetch_returns_every_vector_even_past_the_cache_size():
    from storyrl.models.caches import LruDict

    cache = LruDict(2)
    calls = []

    def encode(items):
        calls.append(list(items))
        return [f"v{item}" for item in items]

    vectors, encoded = cache.fetch({k: k for k in range(5)}, encode, batch_size=2)
    assert vectors == {k: f"v{k}" for k in range(5)} and encoded == 5
    assert calls == [[0, 1], [2, 3], [4]] and list(cache) == [3, 4]  # the cache keeps only the last two
    vectors, encoded = cache.fetch({3: 3, 9: 9}, encode, batch_size=8)
    assert vectors == {3: "v3", 9: "v9"} and encoded == 1  # 3 from the cache, 9 encoded


def test_clip_embeds_more_regions_and_texts_in_one_call_than_it_caches(tiny_clip, images):
    """The vectors were read back from the LRU after embedding: a call with
    more distinct items than it keeps raised KeyError for the first ones."""
    import numpy as np

    from storyrl.images import GridRegions, load_regions
    from storyrl.models.clip import ClipEmbedder, ClipSpec

    spec = ClipSpec(tiny_clip, "openai", device="cpu", precision="fp32")
    small, large = ClipEmbedder(spec, batch_size=2, max_cached=3), ClipEmbedder(spec, batch_size=2)
    regions = [r for sequence in GridRegions(2).regions(list(images)) for r in sequence]
    assert len(regions) > 3
    np.testing.assert_allclose(small.embed_regions(regions, load_regions),
                               large.embed_regions(regions, load_regions), atol=1e-6)
    texts = [f"a story about thing {k} ." for k in range(6)]
    np.testing.assert_allclose(small.embed_texts(texts), large.embed_texts(texts), atol=1e-6)
