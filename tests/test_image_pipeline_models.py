"""The image_pipeline option (issue 32) of RoViST-VG, COSMiC and the TAPM
``features`` extractor: fast pixels within a uint8 level of the exact ones
(PIL and the model's own transform, computed here), fast vectors within a
stated tolerance of exact ones, the option choosing the path (spies), caches
and feature stores keeping the pipelines apart, fp16/bf16 on the CPU, option
validation, the fall back for a transform the fast path cannot reproduce,
and an unreadable image still being that story's NaN. Tiny random models;
the CLIP rewards' own tests are tests/test_image_pipeline.py."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import precision_tolerance
from PIL import Image
from tiny_models import albert_tokenizer

import storyrl  # noqa: F401  (torchvision fallback before timm/open_clip)
from storyrl.images import GridRegions, ImageError, Region, load_regions
from storyrl.rewards.clip_base import ClipConfig

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("one_thread_module")

#: A fast vector's distance from the exact one: the pixels differ by a uint8 level in under 1% of the
#: values (two in 1e-4 at most; test_fast_pixels_within_a_level_of_exact), which moved the tiny
#: models' unit vectors by at most 2e-4 here; 1e-3 leaves room yet fails for crops one pixel off.
UNIT_TOL = 1e-3
COSMIC_TIMM = {"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64), "stem_chs": 8}


@pytest.fixture(scope="module")
def pictures(images, tmp_path_factory):
    """The gradient test images and a noise JPEG (where resampling round-off shows)."""
    path = tmp_path_factory.mktemp("noise") / "noise.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (57, 83, 3), dtype=np.uint8)).save(path, quality=90)
    return [*images, str(path)]


@pytest.fixture(scope="module")
def regions(pictures):
    return [r for p in pictures for r in GridRegions().regions([p])[0]]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "broken.jpg"
    path.write_bytes(b"\xff\xd8\xff not a jpeg")
    return str(path)


def shifted(regions):
    """The same crops one pixel to the right: what the tolerance must still tell apart."""
    return [Region(r.source, None if r.box is None else (r.box[0] + 1, r.box[1], r.box[2] + 1, r.box[3]))
            for r in regions]


def lambda_first(transform):
    """``transform`` with a step the fast pipeline does not reproduce."""
    from torchvision import transforms as T

    return T.Compose([T.Lambda(lambda im: im), *transform.transforms])


def spy_region_batches(monkeypatch):
    import storyrl.images.tensor_preprocess as tp

    made = []
    batches = tp.region_batches
    monkeypatch.setattr(tp, "region_batches", lambda *a, **k: made.append(1) or batches(*a, **k))
    return made


def refuse(_):
    raise AssertionError("the exact path's loader was called")


# -- the pixels ----------------------------------------------------------------------------------


def _transforms(rovist_vg_dir):
    import timm
    from timm.data import create_transform, resolve_data_config

    from storyrl.models.rovist_vg import RovistVGModel

    out = {"rovist_vg (squash, bicubic)": RovistVGModel.from_pretrained(rovist_vg_dir).image_transform()}
    for name, kwargs in [("resnetv2_50", COSMIC_TIMM), ("test_resnet", {})]:
        model = timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
        out[name] = create_transform(**resolve_data_config({}, model=model))
    return out


def test_fast_pixels_within_a_level_of_exact(rovist_vg_dir, regions):
    """The three models' timm transforms (fixed-size squash; shortest side + centre crop, bicubic and
    bilinear): the fast pixels are the exact ones but for resampling round-off. The matrix backend
    (CUDA's; float32 sums of Pillow's weights) is off by one uint8 level at most, in 0.07% of the
    values at most (measured); the CPU's uint8 interpolate backend by one level in 0.4% of the values
    and by two in 2e-5 of them (measured, resnetv2_50's 235 -> 224 bicubic)."""
    from storyrl.images.tensor_preprocess import region_pixels

    crops = load_regions(regions)
    for name, transform in _transforms(rovist_vg_dir).items():
        exact = torch.stack([transform(im) for im in crops])
        std = torch.as_tensor(transform.transforms[-1].std).view(1, -1, 1, 1)
        for backend, most in (("matrix", 1), ("interpolate", 2)):
            fast = region_pixels(regions, transform, "cpu", torch.float32, backend=backend)
            assert fast.shape == exact.shape, name
            levels = ((fast - exact) * std * 255).abs()
            assert levels.max() <= most + 1e-3, (name, backend, levels.max())
            assert (levels > 0.5).float().mean() < 0.01, (name, backend)
            assert (levels > 1.5).float().mean() < 1e-4, (name, backend)


# -- RoViST-VG ------------------------------------------------------------------------------------


@pytest.fixture
def rovist(rovist_vg_dir):
    from storyrl.models.rovist_vg import RovistVGEmbedder

    return RovistVGEmbedder(rovist_vg_dir, "cpu", "fp32")


def test_rovist_vg_fast_close_to_exact_and_each_path_its_own(rovist, regions, monkeypatch):
    made = spy_region_batches(monkeypatch)
    exact = rovist.embed_regions(regions, load_regions, 16, "exact")
    assert not made
    fast = rovist.embed_regions(regions, refuse, 16, pipeline="fast")
    assert made
    np.testing.assert_allclose(fast, exact, atol=UNIT_TOL)
    assert not np.array_equal(fast, exact)  # not the exact vectors served again
    assert np.abs(rovist.embed_regions(shifted(regions), load_regions, 16, "exact") - exact).max() > UNIT_TOL
    with pytest.raises(ValueError, match="image pipeline must be one of exact, fast, got 'slow'"):
        rovist.embed_regions(regions, load_regions, 16, "slow")



def interleaved(regions):
    """The regions image by image in turn (A0 B0 C0 A1 B1 ...): region_batches hands them back grouped
    by image, so a result matched by position instead of by its batch's own regions goes wrong."""
    per_image: dict = {}
    for r in regions:
        per_image.setdefault(r.source, []).append(r)
    lists = list(per_image.values())
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]


def spy_batch_sizes(monkeypatch, obj):
    sizes, encode = [], obj._encode_images
    monkeypatch.setattr(obj, "_encode_images", lambda pixels: sizes.append(len(pixels)) or encode(pixels))
    return sizes


def test_rovist_vg_fast_keeps_interleaved_regions_and_the_batch_size(rovist_vg_dir, rovist, regions, monkeypatch):
    from storyrl.models.rovist_vg import RovistVGEmbedder

    mixed = interleaved(regions)
    assert [r.source for r in mixed[:2]] != [mixed[0].source] * 2
    sizes = spy_batch_sizes(monkeypatch, rovist)
    fast = rovist.embed_regions(mixed, refuse, 4, "fast")
    assert max(sizes) == 4 and sum(sizes) == len(regions)  # the user's batch_size bounds each forward
    exact = RovistVGEmbedder(rovist_vg_dir, "cpu", "fp32").embed_regions(mixed, load_regions, 16, "exact")
    np.testing.assert_allclose(fast, exact, atol=UNIT_TOL)

def test_rovist_vg_caches_keep_the_pipelines_apart(rovist, regions):
    n = len(regions)
    fast = rovist.embed_regions(regions, load_regions, 64, "fast")
    exact = rovist.embed_regions(regions, load_regions, 64, "exact")
    assert rovist.stats["regions_embedded"] == 2 * n  # exact was not served the fast vectors
    np.testing.assert_array_equal(rovist.embed_regions(regions, refuse, 64, "fast"), fast)
    np.testing.assert_array_equal(rovist.embed_regions(regions[::-1], refuse, 64, "exact"), exact[::-1])
    assert rovist.stats["regions_embedded"] == 2 * n
    assert regions[0].key in rovist.regions  # exact keeps the keys it always had


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rovist_vg_fast_at_half_precision_on_the_cpu(rovist_vg_dir, rovist, regions, precision, monkeypatch):
    from storyrl.models.rovist_vg import RovistVGEmbedder

    want = rovist.embed_regions(regions, load_regions, 64, "fast")
    half = RovistVGEmbedder(rovist_vg_dir, "cpu", precision)
    made = spy_region_batches(monkeypatch)
    got = half.embed_regions(regions, refuse, 64, "fast")
    assert made and got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=precision_tolerance(precision, want))


def test_rovist_vg_falls_back_to_exact_and_says_so_once(rovist, regions, caplog):
    rovist.transform = lambda_first(rovist.transform)
    with caplog.at_level(logging.WARNING, logger="storyrl.models.rovist_vg"):
        fast = rovist.embed_regions(regions, load_regions, 64, "fast")
        rovist.embed_regions(shifted(regions), load_regions, 64, "fast")
    assert [r.getMessage() for r in caplog.records].count(
        f"RoViST-VG model {rovist.model_dir}: image_pipeline='fast' uses the exact PIL pipeline: the image "
        "transform's Lambda step is not reproduced") == 1
    np.testing.assert_array_equal(fast, rovist.embed_regions(regions, load_regions, 64, "exact"))


def test_rovist_vg_reward_option(rovist_vg_dir, glove_path, pictures, broken, monkeypatch):
    from storyrl.config import ConfigError
    from storyrl.models.runtime import release_models
    from storyrl.rewards.rovist_vg import RovistVG

    def make(**options):
        return RovistVG(model=rovist_vg_dir, glove=glove_path, device="cpu", precision="fp32", **options)

    assert make().image_pipeline == ClipConfig.image_pipeline  # the CLIP rewards' default
    with pytest.raises(ConfigError, match="image_pipeline must be one of exact, fast, got 'slow'"):
        make(image_pipeline="slow")
    release_models()
    context = {"images": [pictures[:2], pictures[2:], [pictures[0], broken]], "nouns": [["dog", "car"]] * 3}
    stories = ["s"] * 3
    made = spy_region_batches(monkeypatch)
    exact = make(image_pipeline="exact").score(stories, **context)
    assert not made
    reward = make(image_pipeline="fast")
    fast = reward.score(stories, **context)
    assert made
    # Scores are log-sum-exps of unit-vector cosines: they move as the vectors do.
    np.testing.assert_allclose(fast[:2], exact[:2], atol=2 * UNIT_TOL)
    assert not np.array_equal(fast[:2], exact[:2])
    # The story with an unreadable image is NaN, counted with its reason, as under exact.
    assert np.isnan(fast[2]) and np.isnan(exact[2]) and reward.stats["reasons"]["images"] == 1
    (explained,) = reward.explain(stories[2:], images=context["images"][2:], nouns=context["nouns"][2:])
    assert explained["reason"].startswith(f"images: {broken}: ")


# -- COSMiC -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import BertConfig, BertModel

    directory = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(directory)
    albert_tokenizer(["a dog ran the boat sailed a view"]).save_pretrained(directory)
    return str(directory)


@pytest.fixture(params=["timm", "open_clip"])
def cosmic_spec(request, tiny_bert, tiny_clip):
    from storyrl.models.cosmic import EncoderSpec

    if request.param == "timm":
        return EncoderSpec("timm", "resnetv2_50", None, tuple(COSMIC_TIMM.items()), tiny_bert, 32)
    return EncoderSpec("open_clip", tiny_clip, None, (), tiny_bert, 32)


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_cosmic_fast_close_to_exact_caches_apart_and_half_precision(cosmic_spec, pictures, monkeypatch):
    """The towers' vectors are unnormalised (pooled features): compared as directions (UNIT_TOL) and
    by their scale (1%)."""
    from storyrl.models.cosmic import CosmicEncoders

    enc = CosmicEncoders(cosmic_spec, "cpu", "fp32", batch_size=2)
    made = spy_region_batches(monkeypatch)
    exact = enc.embed_images(pictures)
    assert not made
    monkeypatch.setattr("storyrl.images.load_regions", refuse)
    fast = enc.embed_images(pictures, "fast")
    assert made and enc.stats["images_embedded"] == 2 * len(pictures)
    np.testing.assert_allclose(_unit(fast), _unit(exact), atol=UNIT_TOL)
    np.testing.assert_allclose(np.linalg.norm(fast, axis=1), np.linalg.norm(exact, axis=1), rtol=0.01)
    assert not np.array_equal(fast, exact)
    np.testing.assert_array_equal(enc.embed_images(pictures[::-1], "fast"), fast[::-1])  # cached apart
    assert enc.stats["images_embedded"] == 2 * len(pictures)
    with pytest.raises(ValueError, match="image pipeline must be one of exact, fast, got 'slow'"):
        enc.embed_images(pictures, "slow")
    for precision in ("fp16", "bf16"):
        made.clear()
        half = CosmicEncoders(cosmic_spec, "cpu", precision, batch_size=2).embed_images(pictures, "fast")
        assert made and half.dtype == np.float32 and np.isfinite(half).all()
        np.testing.assert_allclose(half, fast, atol=precision_tolerance(precision, fast))



def test_cosmic_fast_order_duplicates_and_batch_size(cosmic_spec, pictures, monkeypatch):
    from storyrl.models.cosmic import CosmicEncoders

    sources = [pictures[2], pictures[0], pictures[2], pictures[1], pictures[-1]]
    enc = CosmicEncoders(cosmic_spec, "cpu", "fp32", batch_size=2)
    sizes = spy_batch_sizes(monkeypatch, enc)
    fast = enc.embed_images(sources, "fast")
    assert max(sizes) == 2 and sum(sizes) == 4  # batch_size bounds each forward; the repeat embedded once
    exact = CosmicEncoders(cosmic_spec, "cpu", "fp32").embed_images(sources, "exact")
    np.testing.assert_allclose(_unit(fast), _unit(exact), atol=UNIT_TOL)
    np.testing.assert_array_equal(fast[0], fast[2])

def test_cosmic_falls_back_to_exact_and_says_so_once(tiny_bert, pictures, caplog):
    from storyrl.models.cosmic import CosmicEncoders, EncoderSpec

    enc = CosmicEncoders(EncoderSpec("timm", "resnetv2_50", None, tuple(COSMIC_TIMM.items()), tiny_bert, 32),
                         "cpu", "fp32")
    enc.preprocess = lambda_first(enc.preprocess)
    with caplog.at_level(logging.WARNING, logger="storyrl.models.cosmic"):
        fast = enc.embed_images(pictures, "fast")
        enc.embed_images(pictures[:1] * 2, "fast")
    assert [r.getMessage() for r in caplog.records].count(
        "COSMiC image tower 'resnetv2_50': image_pipeline='fast' uses the exact PIL pipeline: the image "
        "transform's Lambda step is not reproduced") == 1
    np.testing.assert_array_equal(fast, enc.embed_images(pictures, "exact"))


def test_cosmic_reward_option(tiny_bert, pictures, broken, tmp_path, monkeypatch):
    from storyrl.config import ConfigError
    from storyrl.models.cosmic import CosmicEncoders, CosmicHead, EncoderSpec, HeadConfig
    from storyrl.models.runtime import release_models
    from storyrl.rewards import create_reward

    spec = EncoderSpec("timm", "resnetv2_50", None, tuple(COSMIC_TIMM.items()), tiny_bert, 32)
    torch.manual_seed(0)
    CosmicHead(HeadConfig(image_dim=64, text_dim=16, encoders=spec)).save_pretrained(tmp_path / "model")

    def make(**options):
        return create_reward("cosmic", model=str(tmp_path / "model"), device="cpu", precision="fp32", **options)

    assert make().image_pipeline == ClipConfig.image_pipeline
    with pytest.raises(ConfigError, match="image_pipeline must be one of exact, fast, got 'slow'"):
        make(image_pipeline="slow")
    release_models()
    pipelines = []
    original = CosmicEncoders.embed_images
    monkeypatch.setattr(CosmicEncoders, "embed_images",
                        lambda self, sources, pipeline="exact": pipelines.append(pipeline) or original(
                            self, sources, pipeline))
    story, ref = "A dog ran. The boat sailed.", "A dog. A boat."
    context = {"images": [pictures[:2], pictures[2:4], [pictures[0], broken]], "reference": [ref] * 3}
    exact = make(image_pipeline="exact").score([story] * 3, **context)
    assert set(pipelines) == {"exact"}
    pipelines.clear()
    reward = make(image_pipeline="fast")
    assert reward.prepare({"images": context["images"]})["failed"] == 1
    fast = reward.score([story] * 3, **context)
    assert set(pipelines) == {"fast"}
    np.testing.assert_allclose(fast[:2], exact[:2], rtol=1e-3, atol=1e-4)
    assert not np.array_equal(fast[:2], exact[:2])
    assert np.isnan(fast[2]) and np.isnan(exact[2]) and reward.stats["reasons"]["images"] == 1


# -- the features extractor --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table(tmp_path_factory, pictures):
    from storyrl.images import RegionTable

    path = tmp_path_factory.mktemp("table") / "regions.csv"
    rows = "".join(f'{k},"[{1 + k}, 2.5, {30 + k}, 33]"\n{k},"[0, 0, 40, 20]"\n' for k in range(len(pictures)))
    path.write_text("image_id,bbox\n" + rows)
    return RegionTable(str(path), top_b=2)


def _extractor(pipeline, regions=None):
    from storyrl.generators.tapm.features import FeatureExtractor

    torch.manual_seed(0)  # the same random backbone for each pipeline
    return FeatureExtractor("test_resnet", regions=regions, max_boxes=3, pretrained=False, device="cpu",
                            image_pipeline=pipeline)


def test_features_fast_close_to_exact_in_order(pictures, table, monkeypatch):
    keys = [str(k) for k in range(len(pictures))]
    exact = _extractor("exact", table)(pictures, keys)
    made = spy_region_batches(monkeypatch)
    fast = _extractor("fast", table)(pictures, keys)
    assert made
    assert fast.keys() == exact.keys() and all(fast[t].shape == exact[t].shape for t in fast)
    for t in ("image", "boxes"):
        a, b = exact[t].flatten(0, 1).numpy(), fast[t].flatten(0, 1).numpy()
        real = np.linalg.norm(a, axis=1) > 0
        assert real.sum() == (len(pictures) if t == "image" else 2 * len(pictures))
        np.testing.assert_allclose(_unit(b[real]), _unit(a[real]), atol=UNIT_TOL)
        np.testing.assert_array_equal(b[~real], 0)  # the padding of absent boxes
    assert not np.array_equal(fast["boxes"], exact["boxes"])
    # Regions back in their order: each box's features are its own exact ones, not another's.
    cos = _unit(fast["boxes"][:, :2].flatten(0, 1).numpy()) @ _unit(exact["boxes"][:, :2].flatten(0, 1).numpy()).T
    assert (cos.argmax(axis=1) == np.arange(len(cos))).all()


def test_features_fast_interleaved_and_repeated_regions(pictures, regions):
    """Regions of several images in turn, one of them twice: each row is its own region's features."""
    mixed = interleaved(regions)
    mixed = [*mixed, mixed[1]]
    fast = _extractor("fast")._fast_features(0, mixed, 4).numpy()
    ext = _extractor("exact")
    exact = ext._embed(0, load_regions(mixed)).numpy()
    np.testing.assert_allclose(_unit(fast), _unit(exact), atol=UNIT_TOL)
    np.testing.assert_array_equal(fast[-1], fast[1])


def test_features_each_backbone_its_own_preprocessing(pictures):
    """With --vit, each backbone's fast pixels follow its own transform: here the second's Normalize
    differs from the first's (as resnet101's ImageNet mean/std and an augreg ViT's 0.5 do)."""
    from torchvision import transforms as T

    from storyrl.generators.tapm.features import FeatureExtractor

    keys = [str(k) for k in range(len(pictures))]
    got = {}
    for pipeline in ("exact", "fast"):
        torch.manual_seed(0)
        ext = FeatureExtractor("test_resnet", vit="test_vit", pretrained=False, device="cpu", image_pipeline=pipeline)
        steps = [T.Normalize(mean=(0.5,) * 3, std=(0.5,) * 3) if isinstance(t, T.Normalize) else t
                 for t in ext.transforms[1].transforms]
        ext.transforms[1] = T.Compose(steps)
        got[pipeline] = ext(pictures, keys)["image"][:, 0].numpy()
    dim = ext.models[0].num_features
    assert got["exact"].shape[1] > dim  # both backbones' features
    for part in (slice(None, dim), slice(dim, None)):
        np.testing.assert_allclose(_unit(got["fast"][:, part]), _unit(got["exact"][:, part]), atol=UNIT_TOL)

def test_features_unreadable_image_is_the_same_error(pictures, broken):
    for pipeline in ("exact", "fast"):
        with pytest.raises(ImageError, match="broken.jpg"):
            _extractor(pipeline)([pictures[0], broken], ["0", "x"])


def test_features_store_keeps_its_pipeline(pictures, tmp_path, caplog):
    from storyrl.generators.tapm.features import write_features

    items = [(str(k), p) for k, p in enumerate(pictures[:2])]
    exact = _extractor("exact")
    assert "image_pipeline" not in exact.describe()  # stores written before the option still match
    write_features(tmp_path / "exact", items, exact)
    with pytest.raises(ValueError, match="'image_pipeline': 'fast'.*use another directory"):
        write_features(tmp_path / "exact", items, _extractor("fast"))
    write_features(tmp_path / "fast", items, _extractor("fast"))
    index = json.loads((tmp_path / "fast" / "index.json").read_text())
    assert index["backbones"]["image_pipeline"] == "fast"
    with pytest.raises(ValueError, match="image_pipeline must be one of exact, fast, got 'slow'"):
        _extractor("slow")
    fallback = _extractor("fast")
    fallback.transforms[0] = lambda_first(fallback.transforms[0])
    with caplog.at_level(logging.WARNING, logger="storyrl.generators.tapm.features"):
        got = fallback(pictures, list(map(str, range(len(pictures)))))
        fallback(pictures[:1], ["0"])
    assert [r.getMessage() for r in caplog.records].count(
        "timm backbone 'test_resnet': image_pipeline='fast' uses the exact PIL pipeline: the image transform's "
        "Lambda step is not reproduced") == 1
    np.testing.assert_array_equal(got["image"], exact(pictures, list(map(str, range(len(pictures)))))["image"])


def test_features_cli_image_pipeline(pictures, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    data = tmp_path / "stories.jsonl"
    data.write_text(json.dumps({"story_id": "s", "story": "x", "images": pictures[:2]}) + "\n")
    runner = CliRunner()
    base = ["features", "--data", str(data), "--backbone", "test_resnet", "--no-pretrained", "-q"]
    for pipeline in ("exact", "fast"):
        result = runner.invoke(main, [*base, "--out", str(tmp_path / pipeline), "--image-pipeline", pipeline])
        assert result.exit_code == 0, result.output
        backbones = json.loads((tmp_path / pipeline / "index.json").read_text())["backbones"]
        assert backbones.get("image_pipeline", "exact") == pipeline
    result = runner.invoke(main, [*base, "--out", str(tmp_path / "default")])
    assert result.exit_code == 0, result.output
    backbones = json.loads((tmp_path / "default" / "index.json").read_text())["backbones"]
    assert backbones.get("image_pipeline", "exact") == ClipConfig.image_pipeline == "fast"  # the rewards' default
    bad = runner.invoke(main, [*base, "--out", str(tmp_path / "x"), "--image-pipeline", "slow"])
    assert bad.exit_code != 0 and "'slow' is not one of 'exact', 'fast'" in bad.output
