"""Reward.prepare (issue 24 part 1): the image side of a dataset embedded once
before scoring. After it, scoring embeds no image (backbone calls counted)
and gives the scores of scoring without it; the disk cache resumes (a
crash loses at most one batch); composites forward to their components and
d_HM pre-scores its human stories; the RL option switches it off; the RL
trainer, the sweep and ``storyrl serve --prepare-data`` call it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import KeywordPhrases, albert_tokenizer, save_coherence_model

import storyrl  # noqa: F401  (torchvision fallback before open_clip)
from storyrl.models.runtime import release_models
from storyrl.rewards import create_reward
from storyrl.rewards.base import Reward, prepare_rewards

NOUNS = ["dog", "cat", "park", "car", "tree", "sky", "sea", "beach"]
STORIES = ["The dog ran to the park. A car was red.", "A cat sat under the tree. The sky was blue.",
           "We went to the beach. The sea was calm."]
HUMAN = ["The dog saw a car. The park was big.", "The cat sat. The tree and the sky were blue.",
         "The sea was calm. We sat on the beach."]

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture
def fresh():
    """Process-wide models and their in-memory caches forgotten before and after."""
    release_models()
    yield
    release_models()


def sequences(images):
    # Three sequences over the same three images: 3 distinct images in all.
    return [images[k:] + images[:k] for k in range(3)]


def pronouns(tmp_path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "pronouns.txt"
    path.write_text("it\nwe\nthey\n")
    return str(path)


def groovist(tiny_clip, tmp_path, cache: bool = True, **options):
    reward = create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, theta=0.5, weighting="none",
                           regions="grid", device="cpu", pronouns=pronouns(tmp_path), **({"cache_dir": str(tmp_path / "cache")} if cache else {}),
                           **options)
    reward._extractor = KeywordPhrases(NOUNS)
    return reward


class ImageCalls:
    """Counts the images the CLIP image tower sees (and can fail on a call)."""

    def __init__(self, embedder, fail_on_call: int | None = None) -> None:
        self.images, self.calls, self.fail_on_call = 0, 0, fail_on_call
        self.original = embedder.model.encode_image
        embedder.model.encode_image = self

    def __call__(self, pixels, *a, **kw):
        self.calls += 1
        if self.fail_on_call == self.calls:
            raise RuntimeError("simulated crash")
        self.images += len(pixels)
        return self.original(pixels, *a, **kw)


def test_after_prepare_scoring_embeds_no_image_and_scores_are_the_same(tiny_clip, images, tmp_path, fresh):
    want = groovist(tiny_clip, tmp_path, cache=False).score(STORIES, images=sequences(images))
    assert np.isfinite(want).all() and np.ptp(want) > 0
    release_models()
    reward = groovist(tiny_clip, tmp_path)
    calls = ImageCalls(reward.embedder)
    counts = reward.prepare({"story_images": sequences(images)})
    # 3 distinct images x (3x3 grid + the whole image) = 30 regions, each embedded once;
    # the 2nd and 3rd sequences add no new region.
    assert counts == {"sequences": 1, "regions": 30, "failed": 0, "embedded": 30, "from_disk": 0}
    assert calls.images == 30
    got = reward.score(STORIES, images=sequences(images))
    assert calls.images == 30  # scoring embedded no image
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_batches_of_batch_size_regions(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path, batch_size=10)
    calls = ImageCalls(reward.embedder)
    reward.prepare({"images": [[p] for p in images]})
    assert (calls.calls, calls.images) == (3, 30)  # one image's 10 regions per forward


def test_resume_embeds_only_what_the_disk_cache_lacks(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path)
    assert reward.prepare({"images": [images[:1]]})["embedded"] == 10
    release_models()  # a new process: the in-memory cache is gone, the disk cache stays
    reward = groovist(tiny_clip, tmp_path)
    calls = ImageCalls(reward.embedder)
    counts = reward.prepare({"images": sequences(images)})
    assert (counts["embedded"], counts["from_disk"], calls.images) == (20, 10, 20)


def test_a_crash_loses_at_most_the_current_batch(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path, batch_size=10)
    ImageCalls(reward.embedder, fail_on_call=3)  # the third image's batch fails
    with pytest.raises(RuntimeError, match="simulated crash"):
        reward.prepare({"images": [[p] for p in images]})
    release_models()
    reward = groovist(tiny_clip, tmp_path, batch_size=10)
    calls = ImageCalls(reward.embedder)
    counts = reward.prepare({"images": [[p] for p in images]})
    assert (counts["from_disk"], counts["embedded"], calls.images) == (20, 10, 10)


def test_unreadable_images_are_counted_not_raised(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path)
    counts = reward.prepare({"images": [[str(tmp_path / "missing.png")], images[:1]]})
    assert (counts["failed"], counts["regions"]) == (1, 10)


def test_clipscore_prepares_whole_images(tiny_clip, images, tmp_path, fresh):
    reward = create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, device="cpu")
    want = reward.score(STORIES, images=sequences(images))
    release_models()
    reward = create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, device="cpu")
    calls = ImageCalls(reward.embedder)
    assert reward.prepare({"images": sequences(images)})["regions"] == 3  # one per image
    np.testing.assert_allclose(reward.score(STORIES, images=sequences(images)), want, rtol=1e-5)
    assert calls.images == 3


def test_rewards_without_images_prepare_nothing(tiny_clip, images, tmp_path, fresh):
    assert create_reward("repetition").prepare({"images": sequences(images)}) == {}
    assert groovist(tiny_clip, tmp_path).prepare({"reference": HUMAN}) == {}  # no image column
    seen = []

    def plain(prompts=None, completions=None, **kw):  # a plain reward function: skipped
        seen.append(1)

    assert prepare_rewards([plain, create_reward("repetition")], {"images": sequences(images)}) == {"repetition": {}}
    assert not seen
    with pytest.raises(ValueError, match="different lengths"):
        prepare_rewards([], {"images": sequences(images), "reference": HUMAN[:2]})


# -- composites -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def coherence_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("coherence")
    return save_coherence_model(root / "m", albert_tokenizer([*STORIES, *HUMAN]), seed=0, size="tiny", head_scale=20)


def dhm(tiny_clip, coherence_model, tmp_path):
    reward = create_reward("dhm", rewards={
        "grounding": {"clip_model": tiny_clip, "clip_pretrained": None, "theta": 0.5, "weighting": "none",
                      "regions": "grid", "device": "cpu", "cache_dir": str(tmp_path / "cache"),
                      "pronouns": pronouns(tmp_path)},
        "coherence": {"model": coherence_model, "device": "cpu"}})
    reward.component_rewards["grounding"]._extractor = KeywordPhrases(NOUNS)
    return reward


def test_dhm_prepares_components_and_human_stories(tiny_clip, images, coherence_model, tmp_path, fresh):
    ctx = {"story_id": ["a", "b", "c"], "reference": HUMAN, "images": sequences(images)}
    want = dhm(tiny_clip, coherence_model, tmp_path / "one").score(STORIES, **ctx)
    assert np.isfinite(want).all()
    release_models()
    reward = dhm(tiny_clip, coherence_model, tmp_path / "two")
    calls = ImageCalls(reward.component_rewards["grounding"].embedder)
    counts = reward.prepare({**ctx, "images": None, "story_images": ctx["images"]})  # as a dataset has them
    assert counts["grounding"]["embedded"] == 30 and counts["coherence"] == {} and counts["repetition"] == {}
    assert counts["human_scored"] == 3 == reward.stats["human_scored"]
    got = reward.score(STORIES, **ctx)
    assert reward.stats["human_scored"] == 3  # no human story scored in the call
    assert calls.images == 30
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_weighted_forwards_to_its_components(tiny_clip, images, tmp_path, fresh):
    reward = create_reward("weighted", components=[
        {"reward": {"reward": "clipscore", "clip_model": tiny_clip, "clip_pretrained": None, "device": "cpu"}},
        {"reward": "repetition"}])
    counts = reward.prepare({"images": sequences(images)})
    assert [c.get("regions") for c in counts.values()] == [3, None]


# -- the RL option and the callers ------------------------------------------------------------------


class Recording(Reward):
    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.prepared = []

    def prepare(self, context, progress=False):
        self.prepared.append(context)
        return {"rows": len(next(iter(context.values())))}

    def _score_batch(self, stories, **context):
        return np.zeros(len(stories))


def rl_config(tmp_path, **extra):
    from storyrl.training.rl.config import RLConfig

    data = tmp_path / "d.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"story_id": "0", "story": "s", "images": ["x.png"]}) + "\n")
    return RLConfig.from_mapping({"model": "m", "data": str(data), "output_dir": str(tmp_path / "out"),
                                  "rewards": ["repetition"], **extra})


def test_rl_prepare_option(tmp_path, images, monkeypatch):
    from datasets import Dataset

    from storyrl.training.rl import train as rl_train

    monkeypatch.setattr("storyrl.training.rl.config.RLConfig.policy_kind", lambda self, read_hub=True: "text")
    rows = [{"prompt": "p", "story_id": str(k), "reference": HUMAN[k], "story_images": s, "image_ids": None}
            for k, s in enumerate(sequences(images))]
    dataset = Dataset.from_list(rows).with_transform(lambda batch: {"images": batch["story_id"]})
    reward = Recording()
    on = rl_config(tmp_path)
    assert on.prepare_rewards is True
    assert rl_train.prepare_rewards(on, [reward], dataset, progress=False) == {"recording": {"rows": 3}}
    (context,) = reward.prepared
    assert context["story_images"] == sequences(images) and context["reference"] == HUMAN
    assert "image_ids" not in context  # an all-None column is left out
    off = rl_config(tmp_path, prepare_rewards=False)
    assert rl_train.prepare_rewards(off, [reward], dataset, progress=False) is None
    assert len(reward.prepared) == 1
    with pytest.raises((TypeError, ValueError), match="prepare_rewards"):
        rl_config(tmp_path, prepare_rewards="no")


def test_rl_train_calls_prepare_before_the_algorithm(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from storyrl.training.rl import config as rl_config_module
    from storyrl.training.rl import train as rl_train

    order = []
    reward = Recording()
    monkeypatch.setattr(rl_config_module.RLConfig, "policy_kind", lambda self, read_hub=True: "text")
    monkeypatch.setattr(rl_config_module.RLConfig, "build_rewards", lambda self: [reward])
    monkeypatch.setattr("storyrl.training.rl.policy.load_policy",
                        lambda config, kind: SimpleNamespace(processing_class=None))
    from datasets import Dataset

    monkeypatch.setattr("storyrl.training.rl.data.build_dataset", lambda config, kind, pc: Dataset.from_list(
        [{"prompt": "p", "story_id": "0", "reference": "r", "story_images": ["x.png"]}]))

    def runner(config, policy, dataset, rewards, **kw):
        order.append(("run", len(reward.prepared)))
        return "ran"

    monkeypatch.setattr(rl_config_module.Algorithm, "runner", lambda self: runner)
    for flag, prepared in ((True, 1), (False, 0)):
        reward.prepared.clear()
        config = rl_config(tmp_path / str(flag), prepare_rewards=flag)
        assert rl_train._train(config, resume=False, progress=False, callbacks=None) == "ran"
        assert order[-1] == ("run", prepared)


def test_sweep_prepares_every_record(images):
    from storyrl.data import StoryRecord
    from storyrl.eval.sweep import prepare_sweep_rewards

    reward = Recording()
    records = [StoryRecord("a", "s", images=images), StoryRecord("b", "s", image_ids=["x", "y"])]
    assert prepare_sweep_rewards([reward], records, progress=False) == {"recording": {"rows": 2}}
    assert reward.prepared[0] == {"images": [images, None], "image_ids": [None, ["x", "y"]]}


def test_serve_prepare_data_resolves_images_as_the_server_does(tmp_path, images):
    pytest.importorskip("fastapi")
    import os

    from storyrl.integrations.server import prepare_for_data

    root = os.path.dirname(images[0])
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"story_id": "a", "story": "The dog.", "images": [os.path.basename(images[0])]})
                    + "\n", encoding="utf-8")
    reward = Recording()
    assert prepare_for_data(reward, str(data), root, progress=False) == {"recording": {"rows": 1}}
    assert reward.prepared[0]["images"] == [[os.path.realpath(images[0])]]
    assert reward.prepared[0]["reference"] == ["The dog."] and reward.prepared[0]["story_id"] == ["a"]


def test_serve_cli_prepare_data(tmp_path, images, monkeypatch):
    pytest.importorskip("fastapi")
    import os

    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.integrations import server

    seen = {}
    monkeypatch.setattr(server, "prepare_for_data", lambda reward, data, root, progress=True: seen.update(
        data=data, root=root) or {"done": 1})
    monkeypatch.setattr(server, "serve", lambda app, **kw: seen.update(served=True))
    config = tmp_path / "r.yaml"
    config.write_text("reward: repetition\n")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    root = os.path.dirname(images[0])
    result = CliRunner().invoke(main, ["serve", "--config", str(config), "--prepare-data", str(data),
                                       "--image-root", root])
    assert result.exit_code == 0, result.output
    assert seen == {"data": str(data), "root": root, "served": True}
    assert "prepared" in result.output


def test_rovist_vg_prepares_its_regions(rovist_vg_dir, glove_path, images, fresh):
    from storyrl.rewards.rovist_vg import RovistVG

    nouns = [["dog", "car"], ["cat", "tree", "sky"], ["sky"]]

    def make():
        return RovistVG(model=rovist_vg_dir, glove=glove_path, device="cpu", regions="grid", grid=2)

    want = make().score(STORIES, images=sequences(images), nouns=nouns)
    assert np.isfinite(want).all()
    release_models()
    reward = make()
    counts = reward.prepare({"images": sequences(images)})
    assert (counts["regions"], counts["embedded"]) == (15, 15)  # 3 images x (2x2 + whole)
    got = reward.score(STORIES, images=sequences(images), nouns=nouns)
    assert reward.embedder.stats["regions_embedded"] == 15  # nothing embedded by scoring
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cosmic_prepares_its_images(tmp_path, tiny_clip, images, fresh):
    import torch
    from transformers import BertConfig, BertModel

    from storyrl.models.cosmic import CosmicHead, EncoderSpec, HeadConfig, cosmic_encoders

    bert = tmp_path / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(bert)
    albert_tokenizer([" ".join([*STORIES, *HUMAN])], vocab_size=64).save_pretrained(bert)
    spec = EncoderSpec("open_clip", tiny_clip, None, (), str(bert), 32)
    encoders = cosmic_encoders(spec, "cpu", "fp32")
    CosmicHead(HeadConfig(encoders.image_dim, encoders.text_dim, encoders=spec)).save_pretrained(tmp_path / "m")

    def make():
        return create_reward("cosmic", model=str(tmp_path / "m"), device="cpu", precision="fp32")

    ctx = {"images": sequences(images), "reference": ["A dog. A cat. The sky."] * 3}
    stories = ["The dog ran. A car. The park.", "A cat. The tree. The sky.", "The sea. A beach. We sat."]
    want = make().score(stories, **ctx)
    assert np.isfinite(want).all()
    release_models()
    reward = make()
    assert reward.prepare(ctx) == {"sequences": 1, "images": 3, "failed": 0, "embedded": 3}
    got = reward.score(stories, **ctx)
    assert reward._scorer().encoders.stats["images_embedded"] == 3  # scoring embedded no image
    np.testing.assert_allclose(got, want, rtol=1e-5)
