"""Reward.prepare (issue 24 part 1): the image side of a dataset embedded once
before scoring. After it, scoring embeds no image (backbone calls counted)
and gives the scores of scoring without it; the disk cache resumes (a
crash loses at most one batch); composites forward to their components and
d_HM pre-scores its human stories; the RL option switches it off; the RL
trainer, the sweep and ``storyrl serve --prepare-data`` call it (in order,
with the keys scoring uses; their failures one line); corrupt images count as
failed, counts are this run's, batches go to disk one by one."""

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
    options = {"regions": "grid", **options}
    reward = create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, theta=0.5, weighting="none",
                           device="cpu", pronouns=pronouns(tmp_path), **({"cache_dir": str(tmp_path / "cache")} if cache else {}),
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


def dhm(tiny_clip, coherence_model, tmp_path, **options):
    reward = create_reward("dhm", **options, rewards={
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
    from storyrl.training.storyteller.rl.config import RLConfig

    data = tmp_path / "d.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"story_id": "0", "story": "s", "images": ["x.png"]}) + "\n")
    return RLConfig.from_mapping({"model": "m", "data": str(data), "output_dir": str(tmp_path / "out"),
                                  "rewards": ["repetition"], **extra})


def test_rl_prepare_option(tmp_path, images, monkeypatch):
    from datasets import Dataset

    from storyrl.training.storyteller.rl import train as rl_train

    monkeypatch.setattr("storyrl.training.storyteller.rl.config.RLConfig.policy_kind",
                        lambda self, read_hub=True: "text")
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

    from storyrl.training.storyteller.rl import config as rl_config_module
    from storyrl.training.storyteller.rl import train as rl_train

    order = []
    reward = Recording()
    monkeypatch.setattr(rl_config_module.RLConfig, "policy_kind", lambda self, read_hub=True: "text")
    monkeypatch.setattr(rl_config_module.RLConfig, "build_rewards", lambda self: [reward])
    monkeypatch.setattr("storyrl.training.storyteller.rl.policy.load_policy",
                        lambda config, kind: SimpleNamespace(processing_class=None))
    from datasets import Dataset

    monkeypatch.setattr("storyrl.training.storyteller.rl.data.build_dataset",
                        lambda config, kind, pc: Dataset.from_list(
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


@pytest.fixture(scope="module")
def cosmic_models(tmp_path_factory, tiny_clip):
    """Two tiny COSMiC models: ``image`` (with the image input) and ``text`` (without)."""
    import torch
    from transformers import BertConfig, BertModel

    from storyrl.models.cosmic import CosmicHead, EncoderSpec, HeadConfig, cosmic_encoders

    root = tmp_path_factory.mktemp("cosmic")
    bert = root / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(bert)
    albert_tokenizer([" ".join([*STORIES, *HUMAN])], vocab_size=64).save_pretrained(bert)
    spec = EncoderSpec("open_clip", tiny_clip, None, (), str(bert), 32)
    encoders = cosmic_encoders(spec, "cpu", "fp32")
    for name, use_image in (("image", True), ("text", False)):
        CosmicHead(HeadConfig(encoders.image_dim, encoders.text_dim, use_image=use_image,
                              encoders=spec)).save_pretrained(root / name)
    return {name: str(root / name) for name in ("image", "text")}


def cosmic(path, **options):
    return create_reward("cosmic", model=path, device="cpu", precision="fp32", **options)


def test_cosmic_prepares_its_images(cosmic_models, images, fresh):
    def make():
        return cosmic(cosmic_models["image"])

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



# -- what the review found untested ---------------------------------------------------------------


class ForwardsAndWrites:
    """The order of the CLIP image forwards (their sizes) and the disk
    cache's writes (their sizes)."""

    def __init__(self, embedder) -> None:
        self.events: list[tuple[str, int]] = []
        encode, put = embedder._encode_images, embedder.disk.put_many
        embedder._encode_images = lambda images: self.events.append(("forward", len(images))) or encode(images)
        embedder.disk.put_many = lambda new: self.events.append(("disk", len(new))) or put(new)


def test_each_batch_is_on_disk_before_the_next_forward(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path, batch_size=4)
    Reward.setup(reward)  # the disk cache attached
    spy = ForwardsAndWrites(reward.embedder)
    reward.prepare({"images": [[p] for p in images]})
    # Each image's 10 regions go as soon as they are cut (4 + 4 + 2), each
    # forward's embeddings written before the next forward.
    assert spy.events == [(kind, n) for n in [4, 4, 2] * 3 for kind in ("forward", "disk")]


def test_crops_need_image_ids_only(tiny_clip, images, tmp_path, fresh):
    from PIL import Image

    table = tmp_path / "regions.csv"
    table.write_text('image_id,bbox\na,"[0, 0, 8, 8]"\na,"[8, 8, 16, 16]"\n', encoding="utf-8")
    crops = tmp_path / "crops"
    crops.mkdir()
    for box, image in zip(["[0, 0, 8, 8]", "[8, 8, 16, 16]"], images):
        Image.open(image).convert("RGB").save(crops / f"a_{box}.jpg")
    reward = groovist(tiny_clip, tmp_path, regions="crops", region_table=str(table), crops_dir=str(crops))
    # No image file named by id "a" anywhere: the crops are all it needs.
    assert reward.prepare({"image_ids": [["a"]]}) == {"sequences": 1, "regions": 2, "failed": 0, "embedded": 2,
                                                      "from_disk": 0}


def corrupt(tmp_path) -> str:
    path = tmp_path / "corrupt.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n not an image")  # resolves, cannot be decoded
    return str(path)


def test_an_undecodable_image_counts_as_failed(tiny_clip, images, tmp_path, fresh):
    # grid: found when cutting; whole: found when embedding, in a batch with a good image.
    for regions, good in (("grid", 10), ("whole", 1)):
        release_models()  # (grid's whole-image region is whole's region)
        reward = groovist(tiny_clip, tmp_path / regions, regions=regions)
        counts = reward.prepare({"images": [[corrupt(tmp_path)], images[:1]]})
        assert (counts["failed"], counts["embedded"]) == (1, good), regions


def test_from_disk_and_embedded_count_this_run_only(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path)
    assert reward.prepare({"images": sequences(images)})["embedded"] == 30
    again = reward.prepare({"images": sequences(images)})  # all in memory now
    assert (again["regions"], again["embedded"], again["from_disk"]) == (30, 0, 0)
    release_models()
    reward = groovist(tiny_clip, tmp_path)
    counts = reward.prepare({"images": sequences(images)})
    assert (counts["regions"], counts["embedded"], counts["from_disk"]) == (30, 0, 30)
    assert reward.prepare({"images": sequences(images)})["from_disk"] == 0


def test_memory_cache_warning_only_without_a_disk_cache(tiny_clip, images, tmp_path, fresh, caplog):
    for cache, warned in ((True, False), (False, True)):
        release_models()
        reward = groovist(tiny_clip, tmp_path / str(cache), cache=cache, batch_size=10)
        reward.embedder.regions.maxsize = 12  # one batch, fewer than the 30 regions
        caplog.clear()
        with caplog.at_level("WARNING", logger="storyrl.rewards.region_base"):
            reward.prepare({"images": [[p] for p in images]})
        assert ("set cache_dir" in caplog.text) is warned


def test_tuple_columns_are_rows_like_lists(tiny_clip, images, tmp_path, fresh):
    reward = groovist(tiny_clip, tmp_path)
    rows = tuple(tuple(s) for s in sequences(images))
    assert prepare_rewards([reward], {"images": rows})["groovist"]["regions"] == 30
    with pytest.raises(ValueError, match="different lengths"):
        prepare_rewards([], {"images": rows, "reference": HUMAN[:2]})


# -- d_HM's human stories -----------------------------------------------------------------------------


def test_dhm_prepares_at_most_human_cache_size_stories(tiny_clip, images, coherence_model, tmp_path, fresh):
    reward = dhm(tiny_clip, coherence_model, tmp_path, human_cache_size=2)
    counts = reward.prepare({"story_id": ["a", "b", "c"], "reference": HUMAN, "images": sequences(images)})
    assert counts["human_scored"] == 2 == len(reward.human_cache)


def test_dhm_prepares_references_without_story_ids_once(tiny_clip, images, coherence_model, tmp_path, fresh):
    reward = dhm(tiny_clip, coherence_model, tmp_path)
    ctx = {"reference": HUMAN, "images": sequences(images)}
    assert reward.prepare(ctx)["human_scored"] == 3
    assert list(reward.human_cache) == [(None, h) for h in HUMAN]
    assert reward.prepare(ctx)["human_scored"] == 0  # this run's count: all cached
    reward.score(STORIES, **ctx)
    assert reward.stats["human_scored"] == 3  # the step hit the cache


def test_rl_prepare_keys_human_stories_as_training_steps_do(tiny_clip, images, coherence_model, tmp_path,
                                                            monkeypatch, fresh):
    from datasets import Dataset

    from storyrl.training.storyteller.rl import train as rl_train

    monkeypatch.setattr("storyrl.training.storyteller.rl.config.RLConfig.policy_kind",
                        lambda self, read_hub=True: "text")
    rows = [{"prompt": "p", "story_id": sid, "reference": HUMAN[k], "story_images": s}
            for k, (sid, s) in enumerate(zip(["a", "b", "c"], sequences(images)))]
    reward = dhm(tiny_clip, coherence_model, tmp_path)
    counts = rl_train.prepare_rewards(rl_config(tmp_path), [reward], Dataset.from_list(rows), progress=False)
    assert counts["dhm"]["human_scored"] == 3
    # A training batch, as the trainers pass the dataset's columns.
    scores = reward(prompts=["p"] * 3, completions=STORIES, story_id=["a", "b", "c"], reference=HUMAN,
                    story_images=sequences(images))
    assert all(s is not None for s in scores)
    assert reward.stats["human_scored"] == 3


# -- the callers' failures and order ------------------------------------------------------------------


class Broken(Recording):
    def prepare(self, context, progress=False):
        from storyrl.rewards.base import RewardError

        raise RewardError("reward 'recording': cannot load: no such model")


def test_rl_train_reports_a_prepare_failure_as_a_setup_error(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from datasets import Dataset

    from storyrl.training.storyteller.rl import config as rl_config_module
    from storyrl.training.storyteller.rl import train as rl_train

    monkeypatch.setattr(rl_config_module.RLConfig, "policy_kind", lambda self, read_hub=True: "text")
    monkeypatch.setattr(rl_config_module.RLConfig, "build_rewards", lambda self: [Broken()])
    monkeypatch.setattr("storyrl.training.storyteller.rl.policy.load_policy",
                        lambda config, kind: SimpleNamespace(processing_class=None))
    monkeypatch.setattr("storyrl.training.storyteller.rl.data.build_dataset",
                        lambda config, kind, pc: Dataset.from_list(
                            [{"prompt": "p", "story_id": "0", "reference": "r", "story_images": ["x.png"]}]))
    monkeypatch.setattr(rl_config_module.Algorithm, "runner", lambda self: pytest.fail("the algorithm ran"))
    with pytest.raises(ValueError) as info:
        rl_train._train(rl_config(tmp_path), resume=False, progress=False, callbacks=None)
    assert str(info.value) == "reward 'recording': cannot load: no such model"


def test_run_sweep_prepares_before_scoring(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from storyrl.data import StoryRecord
    from storyrl.eval import scoring, sweep

    order = []
    records = [StoryRecord("a", "The dog ran.", images=["x.png"])]
    monkeypatch.setattr(sweep, "load_some_records", lambda data, fmt, limit: records)
    monkeypatch.setattr(sweep, "plan_cells", lambda config: [])
    monkeypatch.setattr(sweep, "_make_rewards", lambda config, source: ["reward"])
    monkeypatch.setattr(sweep, "_generate_cells", lambda *a: order.append("generate"))
    monkeypatch.setattr(sweep, "processes", lambda: SimpleNamespace(main=True, wait=lambda: None))
    monkeypatch.setattr(sweep, "prepare_sweep_rewards", lambda rewards, recs, progress: order.append(
        ("prepare", rewards, recs)))

    def score(*a, **kw):
        order.append("score")
        raise KeyboardInterrupt  # enough: the order is known

    monkeypatch.setattr(scoring, "score_to_file", score)
    config = SimpleNamespace(data="d", data_format="auto", limit=None, rewards={"coherence": {}},
                             output_dir=str(tmp_path), human_scores=None, score_batch_size=8)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(config, progress=False)
    assert order == ["generate", ("prepare", ["reward"], records), "score"]


def test_serve_prepare_data_keys_are_the_requests_keys(tiny_clip, images, tmp_path, fresh):
    pytest.importorskip("fastapi")
    import os

    from storyrl.integrations.serve_guards import ImageGuard, Limits
    from storyrl.integrations.server import prepare_for_data

    link = tmp_path / "root"
    link.symlink_to(os.path.dirname(images[0]))  # --image-root a symlink
    names = [os.path.basename(p) for p in images]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"story_id": "a", "story": "The dog.", "images": [f"sub/../{names[0]}", *names[1:]]})
                    + "\n", encoding="utf-8")
    reward = create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, device="cpu")
    calls = ImageCalls(reward.embedder)
    assert prepare_for_data(reward, str(data), str(link), progress=False)["clipscore"]["embedded"] == 3
    request = [{"images": list(names)}]
    ImageGuard(Limits(image_root=str(link))).apply(request)  # as the server resolves a request's images
    assert np.isfinite(reward.score(["The dog."], images=[request[0]["images"]])).all()
    assert calls.images == 3  # the request embedded nothing


def test_serve_cli_prepare_data_reward_error_is_one_line(tmp_path, images, monkeypatch):
    pytest.importorskip("fastapi")
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.integrations import server
    from storyrl.rewards.base import RewardError

    def broken(reward, data, root, progress=True):
        raise RewardError("reward 'repetition': scoring failed for 3 stories in a row")

    monkeypatch.setattr(server, "prepare_for_data", broken)
    monkeypatch.setattr(server, "serve", lambda app, **kw: pytest.fail("served"))
    config = tmp_path / "r.yaml"
    config.write_text("reward: repetition\n")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(config), "--prepare-data", str(data)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert f"Error: --prepare-data {data}: reward 'repetition': scoring failed for 3 stories in a row" in result.output



def test_cosmic_without_image_input_prepares_nothing(cosmic_models, images, fresh):
    reward = cosmic(cosmic_models["text"])
    assert reward.prepare({"images": sequences(images)}) == {}
    assert reward._scorer().encoders.stats["images_embedded"] == 0


def test_cosmic_counts_an_undecodable_image_as_failed(cosmic_models, images, tmp_path, fresh):
    reward = cosmic(cosmic_models["image"])
    counts = reward.prepare({"images": [[corrupt(tmp_path)], images[:1]]})
    assert (counts["failed"], counts["embedded"]) == (1, 1)


def test_cosmic_embeds_batch_size_images_per_call(cosmic_models, images, fresh):
    reward = cosmic(cosmic_models["image"], batch_size=2)
    encoders = reward._scorer().encoders
    sizes, embed = [], encoders.embed_images
    encoders.embed_images = lambda sources, *more: sizes.append(len(sources)) or embed(sources, *more)
    assert reward.prepare({"images": [[p] for p in images]})["embedded"] == 3
    assert sizes == [2, 1]  # rows gathered up to batch_size images, then the rest
