"""The fast image pipeline (issue 32): Pillow's resampling as tensors against
PIL itself, the tensor preprocessing against the exact pipeline (PIL and the
model's torchvision transform), the decode pool's failures (bad, truncated,
hanging files, killed workers: bounded, nothing lost), and the CLIP
embedder's ``image_pipeline`` option (the path it takes, its caches apart,
fp16/bf16 on the CPU)."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

import storyrl  # noqa: F401  (torchvision fallback before open_clip)
from storyrl.images import GridRegions, ImageError, Region, load_region, load_regions
from storyrl.images import decoding
from storyrl.images.decoding import DecodePool, decode_rgb, decode_sources
from storyrl.images.resample import (
    axis_weights,
    dense_weights,
    pillow_pass_order,
    resample_interpolate,
    resample_matrix,
    vertical_first,
)
from storyrl.images.tensor_preprocess import PixelSpec, pixel_spec, region_batches, region_pixels

PIL_FILTER = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def pil_resize(pixels: np.ndarray, out_h: int, out_w: int, filt: str) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((out_w, out_h), PIL_FILTER[filt])).astype(np.int64)


#: (in_h, in_w, out_h, out_w): up, down, mixed, odd, 1-pixel, and both pass orders.
SIZES = [(7, 5, 23, 31), (40, 33, 9, 14), (1, 1, 5, 3), (1, 9, 4, 4), (13, 1, 3, 8), (17, 19, 17, 6),
         (60, 20, 12, 22), (31, 41, 13, 9), (9, 9, 9, 9), (2, 50, 3, 7),
         # on the pass-order rule's boundary (in_h - out_h == 2 (in_w - out_w): horizontal first), as a
         # portrait region exactly twice as tall as wide resized to 224 on its short side is
         (300, 200, 200, 150), (20, 12, 10, 7)]


# -- resample: Pillow's weights and passes --------------------------------------------------


@pytest.mark.parametrize("filt", ["bicubic", "bilinear"])
def test_matrix_backend_in_float64_is_pillow_exactly(filt):
    import torch

    for k, (h, w, oh, ow) in enumerate(SIZES):
        pixels = noise(h, w, k)
        wy = torch.as_tensor(dense_weights(h, oh, filt))[None]
        wx = torch.as_tensor(dense_weights(w, ow, filt))[None]
        out = resample_matrix(torch.as_tensor(pixels).permute(2, 0, 1).double(), wy, wx, vertical_first(h, w, oh, ow))
        assert np.array_equal(out[0].permute(1, 2, 0).numpy().astype(np.int64), pil_resize(pixels, oh, ow, filt)), \
            (h, w, oh, ow)


def test_both_pass_orders_occur_and_the_installed_pillows_is_found():
    """Pillow 13 resizes some shapes vertical pass first; the other order differs by many levels on
    noise, so the exactness test above covers the rule only if both orders are among SIZES."""
    assert pillow_pass_order() in ("pillow13", "horizontal_first")
    orders = {vertical_first(*size) for size in SIZES}
    if pillow_pass_order() == "pillow13":
        assert orders == {True, False}


@pytest.mark.parametrize("filt", ["bicubic", "bilinear"])
def test_float32_matrix_and_uint8_interpolate_within_round_off_of_pillow(filt):
    """fp32 sums round a few 22-bit fixed-point sums across a half (1 level); torch's uint8 kernel
    has its own weight precision (measured: at most 2 levels, ~0.5% of values on noise)."""
    import torch

    worst = {"matrix": 0, "interpolate": 0}
    differing = {"matrix": 0, "interpolate": 0}
    total = 0
    for k, (h, w, oh, ow) in enumerate(SIZES):
        pixels = noise(h, w, k)
        want = pil_resize(pixels, oh, ow, filt)
        image = torch.as_tensor(pixels).permute(2, 0, 1)
        wy = torch.as_tensor(dense_weights(h, oh, filt), dtype=torch.float32)[None]
        wx = torch.as_tensor(dense_weights(w, ow, filt), dtype=torch.float32)[None]
        order = vertical_first(h, w, oh, ow)
        got = {"matrix": resample_matrix(image.float(), wy, wx, order)[0],
               "interpolate": resample_interpolate(image[None].contiguous(), (oh, ow), filt, order)[0]}
        for name, out in got.items():
            diff = np.abs(out.permute(1, 2, 0).numpy().astype(np.int64) - want)
            worst[name] = max(worst[name], int(diff.max()))
            differing[name] += int((diff > 0).sum())
        total += want.size
    assert worst["matrix"] <= 1 and differing["matrix"] <= 0.01 * total
    assert worst["interpolate"] <= 2 and differing["interpolate"] <= 0.02 * total


def test_axis_weights_by_hand():
    """Halving 4 pixels bilinearly (Pillow's rule, written out): scale 2, so the triangle is
    stretched to support 2; output 0 centres at input 1.0 and takes taps 0..2, at distances
    (x + 0.5 - 1.0) / 2 = -0.25, 0.25, 0.75, weights 0.75, 0.75, 0.25, normalised by 1.75."""
    first, weights = axis_weights([4], [2], [0], 2, "bilinear", quantize=False)
    assert first[0].tolist() == [0, 1]
    np.testing.assert_allclose(weights[0, 0, :3], np.array([0.75, 0.75, 0.25]) / 1.75)
    np.testing.assert_allclose(weights[0].sum(axis=-1), 1.0)
    # Outputs of a centre crop outside the resized image (zero padding) get no weight.
    _, padded = axis_weights([4], [2], [-1], 4, "bilinear")
    assert padded[0, 0].sum() == 0 and padded[0, 3].sum() == 0 and padded[0, 1].sum() > 0


# -- the transform read as numbers -----------------------------------------------------------


def test_pixel_spec_of_open_clip_and_timm_eval_transforms(tiny_clip):
    import open_clip
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
    from timm.data import create_transform

    # ViT-B/32's (the authors' CLIP) eval transform, as open_clip builds it for that model.
    spec, why = pixel_spec(open_clip.image_transform(224, is_train=False, mean=OPENAI_DATASET_MEAN,
                                                     std=OPENAI_DATASET_STD))
    assert why is None
    assert spec == PixelSpec(224, None, "bicubic", (224, 224), (0.48145466, 0.4578275, 0.40821073),
                             (0.26862954, 0.26130258, 0.27577711))
    _, _, preprocess = open_clip.create_model_and_transforms(tiny_clip)
    assert pixel_spec(preprocess)[0].crop == (32, 32)
    spec, why = pixel_spec(create_transform(input_size=(3, 224, 224), interpolation="bilinear", crop_pct=0.95))
    assert why is None and spec.filter == "bilinear" and spec.size == 235 and spec.crop == (224, 224)
    assert spec.mean == pytest.approx((0.485, 0.456, 0.406)) and spec.std == pytest.approx((0.229, 0.224, 0.225))


def test_pixel_spec_refuses_what_it_does_not_reproduce():
    from torchvision import transforms as T

    tensor = [T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)]
    cases = {
        "RandomResizedCrop": T.Compose([T.RandomResizedCrop(8), *tensor]),
        "nearest": T.Compose([T.Resize(8, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(8), *tensor]),
        "Lambda": T.Compose([T.Lambda(lambda im: im), T.Resize(8), T.CenterCrop(8), *tensor]),
        "depends on the image": T.Compose([T.Resize(8), *tensor]),
        "not a torchvision Compose": lambda im: im,
        "no ToTensor": T.Compose([T.Resize(8), T.CenterCrop(8)]),
        "in order": T.Compose([T.CenterCrop(8), T.Resize(8), *tensor]),
        # only one of each: the settings of a second Resize or Normalize would be lost
        "Resize, CenterCrop, ToTensor, Normalize in order": T.Compose([T.Resize(10), T.Resize(8), T.CenterCrop(8),
                                                                      *tensor]),
        "ToTensor, Normalize in order": T.Compose([T.Resize(8), T.CenterCrop(8), *tensor, tensor[1]]),
    }
    for words, transform in cases.items():
        spec, why = pixel_spec(transform)
        assert spec is None and words in why, (words, why)
    with pytest.raises(ValueError, match="cannot reproduce"):
        region_pixels([Region(Image.new("RGB", (4, 4)))], cases["Lambda"])


# -- tensor preprocessing against the exact pipeline -----------------------------------------


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    """Two photo-ish files (JPEG and PNG) and an in-memory image, with boxes that poke out of
    the image, have float corners, are 1 pixel wide or tall, or cover the whole image."""
    root = tmp_path_factory.mktemp("scene")
    y, x = np.mgrid[0:45, 0:61]
    smooth = np.stack([x * 4, y * 5, (x + y) * 2], -1) % 256
    Image.fromarray((smooth + noise(45, 61) // 8).astype(np.uint8)).save(root / "a.jpg", quality=90)
    Image.fromarray(noise(30, 50, 1)).save(root / "b.png")
    memory = Image.fromarray(noise(20, 26, 2))
    boxes = [None, (-3.2, -1.0, 30.6, 20.4), (10.5, 5.5, 11.0, 40.0), (0, 0, 61, 1), (40.7, 2.2, 70, 44.9),
             (3, 4, 9, 41)]
    regions = [Region(str(root / "a.jpg"), b) for b in boxes] + [Region(str(root / "b.png"), b) for b in boxes[:3]]
    regions += [Region(memory, b) for b in (None, (1, 1, 25.5, 7))]
    return root, regions


def exact_pixels(regions, transform):
    import torch

    return torch.stack([transform(im) for im in load_regions(regions)])


@pytest.fixture(scope="module")
def transforms():
    from torchvision import transforms as T

    norm = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    bicubic, bilinear = T.InterpolationMode.BICUBIC, T.InterpolationMode.BILINEAR
    return {
        "clip": T.Compose([T.Resize(16, interpolation=bicubic), T.CenterCrop(16), T.ToTensor(), norm]),
        "bilinear": T.Compose([T.Resize(20, interpolation=bilinear), T.CenterCrop((18, 14)), T.ToTensor(), norm]),
        "padded": T.Compose([T.Resize(9, interpolation=bicubic), T.CenterCrop(13), T.ToTensor()]),
        "fixed": T.Compose([T.Resize((11, 17), interpolation=bicubic), T.ToTensor(), norm]),
        "max_size": T.Compose([T.Resize(12, interpolation=bicubic, max_size=15), T.CenterCrop(12), T.ToTensor()]),
    }


@pytest.mark.parametrize("name", ["clip", "bilinear", "padded", "fixed", "max_size"])
def test_matrix_backend_in_float64_gives_the_exact_pipelines_pixels(scene, transforms, name):
    """Crops (rounded and clamped as PIL's), Resize's output size, CenterCrop's offsets (or zero
    padding), ToTensor and Normalize: bit for bit the exact pipeline's."""
    import torch

    _, regions = scene
    if name == "max_size":  # a 1-pixel-thin crop capped at max_size has 0 pixels (torchvision: ValueError)
        regions = [r for r in regions if r.box is None or min(r.box[2] - r.box[0], r.box[3] - r.box[1]) > 2]
    want = exact_pixels(regions, transforms[name])
    got = region_pixels(regions, transforms[name], backend="matrix", compute_dtype=torch.float64)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["matrix", "interpolate"])
def test_default_precision_backends_within_round_off_of_the_exact_pipeline(scene, transforms, backend):
    import torch

    _, regions = scene
    transform = transforms["clip"]
    want = exact_pixels(regions, transform)
    got = region_pixels(regions, transform, backend=backend)
    std = torch.tensor(transform.transforms[-1].std).view(1, 3, 1, 1)
    levels = ((got - want) * std * 255).abs()
    assert levels.max() <= (1 if backend == "matrix" else 2) + 1e-3
    assert (levels > 0.5).float().mean() < 0.02


def test_half_precision_pixels_are_the_fp32_ones_rounded_once(scene, transforms):
    """Scaling and Normalize run in fp32 and round once to the model's dtype (in bf16 they would be
    off by more than a uint8 level)."""
    import torch

    _, regions = scene
    want = region_pixels(regions, transforms["clip"], backend="matrix")
    for dtype in (torch.float16, torch.bfloat16):
        got = region_pixels(regions, transforms["clip"], dtype=dtype, backend="matrix")
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_region_pixels_keeps_the_given_order(scene, transforms):
    """Regions of several images interleaved (batches come grouped by image): row i is region i's."""
    _, regions = scene
    by_source: dict = {}
    for r in regions:
        by_source.setdefault(id(r.source) if not isinstance(r.source, str) else r.source, []).append(r)
    lists = list(by_source.values())
    mixed = [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]
    assert mixed != regions
    import torch

    got = region_pixels(mixed, transforms["clip"], backend="matrix", compute_dtype=torch.float64)
    assert torch.equal(got, exact_pixels(mixed, transforms["clip"]))


def test_crop_bounds_round_as_pillow_and_keep_thin_edge_boxes_inside():
    from storyrl.images import crop_bounds

    # Pillow's crop (and the authors' img.crop(bbox)) rounds float corners
    for box in [(10.6, 3.4, 50.5, 40.5), (0.49, 0.51, 99.5, 60.49), (20.5, 21.5, 22.5, 23.5)]:
        assert crop_bounds(Region("x.jpg", box), 100, 80) == tuple(round(v) for v in box)
    # a thin box at the right or bottom edge keeps the last column or row, not one past it
    assert crop_bounds(Region("x.jpg", (99.7, 10, 100, 20)), 100, 80) == (99, 10, 100, 20)
    assert crop_bounds(Region("x.jpg", (10, 79.8, 20, 80)), 100, 80) == (10, 79, 20, 80)


def test_region_batches_group_by_image_and_cover_every_region_once(scene, transforms):
    _, regions = scene
    seen = []
    for chunk, pixels in region_batches(regions, transforms["clip"], batch_size=4):
        assert len(chunk) == pixels.shape[0] <= 4
        seen += chunk
    assert sorted(map(id, seen)) == sorted(map(id, regions))


def test_zero_area_box_and_unreadable_file_fail_as_the_exact_pipeline(scene, transforms, tmp_path):
    root, _ = scene
    (tmp_path / "junk.jpg").write_bytes(b"not an image")
    for region in (Region(str(root / "a.jpg"), (70, 2, 80, 9)), Region(str(tmp_path / "junk.jpg"))):
        with pytest.raises(ImageError) as exact:
            load_region(region)
        with pytest.raises(ImageError) as fast:
            region_pixels([region], transforms["clip"])
        assert str(fast.value) == str(exact.value)


# -- decoding: every kind of source, inline and in the pool ---------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Good files of every mode, a bad and a truncated one, and in-memory images."""
    root = tmp_path_factory.mktemp("sources")
    rgb = Image.fromarray(noise(33, 47, 3))
    rgb.save(root / "rgb.jpg", quality=85)
    rgba = Image.fromarray(np.dstack([noise(20, 30, 4), np.linspace(0, 255, 600, dtype=np.uint8).reshape(20, 30)]),
                           "RGBA")
    rgba.save(root / "alpha.png")
    rgb.convert("L").save(root / "gray.png")
    rgb.convert("P", palette=Image.ADAPTIVE).save(root / "palette.png")
    (root / "junk.jpg").write_bytes(b"\xff\xd8 junk")
    full = (root / "rgb.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(full[: len(full) // 2])
    files = [str(root / n) for n in ("rgb.jpg", "alpha.png", "gray.png", "palette.png", "junk.jpg",
                                     "truncated.jpg")]
    return files + [rgba, rgb.convert("L")]


def expected(source):
    try:
        return decode_rgb(source)
    except ImageError as exc:
        return exc


def assert_same(got, want):
    if isinstance(want, ImageError):
        assert isinstance(got, ImageError) and str(got) == str(want)
    else:
        buffer, h, w = got
        assert np.array_equal(np.asarray(buffer)[: h * w * 3].reshape(h, w, 3), want)


def test_decode_rgb_is_load_regions_decoding(sources):
    for source in sources:
        want = expected(source)
        if isinstance(want, ImageError):
            with pytest.raises(ImageError, match="cannot read image"):
                load_region(Region(source))
        else:
            assert np.array_equal(want, np.asarray(load_region(Region(source))))
    assert isinstance(expected(sources[4]), ImageError) and isinstance(expected(sources[5]), ImageError)


@pytest.fixture(scope="module")
def pool():
    pool = DecodePool(workers=2, timeout_s=3.0)
    yield pool
    pool.close()


def test_pil_settings_hold_inline_and_in_the_pool_and_a_bomb_is_an_image_error(sources, pool, monkeypatch):
    """The caller's PIL settings reach the workers with every job: LOAD_TRUNCATED_IMAGES decodes the
    truncated file everywhere, and an image over MAX_IMAGE_PIXELS (a decompression bomb) is an
    ImageError everywhere, not a crash."""
    from PIL import ImageFile

    rgb, truncated = sources[0], sources[5]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    want = decode_rgb(truncated)
    assert_same(next(iter(pool.imap([truncated]))), want)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # the 33x47 file is over twice that: an error
    for read in (lambda: load_region(Region(rgb)), lambda: decode_rgb(rgb)):
        with pytest.raises(ImageError, match="cannot read image: .*decompression bomb"):
            read()
    got = next(iter(pool.imap([rgb])))
    assert isinstance(got, ImageError) and "decompression bomb" in str(got)


def test_the_disk_cache_key_names_a_half_precision():
    from types import SimpleNamespace

    from storyrl.models.clip import ClipEmbedder, ClipSpec

    spec = ClipSpec("ViT-B-32", "openai")
    keys = {p: ClipEmbedder.cache_key.fget(SimpleNamespace(spec=spec, precision=p)) for p in ("fp32", "fp16", "bf16")}
    assert keys["fp32"] == spec.key and len(set(keys.values())) == 3  # fp32's key is the one caches always had


def test_pool_decodes_every_kind_of_source_as_inline(sources, pool):
    files = [s for s in sources if isinstance(s, str)]
    got = list(decode_sources(sources * 2, pool=pool, inline_below=1))
    for source, result in zip(sources * 2, got):
        assert_same(result, expected(source))
    assert pool.stats["decoded"] >= 2 * (len(files) - 2) and pool.stats["failed"] >= 4


def test_pool_without_shared_memory_and_images_larger_than_a_slot(sources, monkeypatch):
    files = [s for s in sources if isinstance(s, str)][:4]
    for setup in ("no shared memory", "small slots"):
        pool = DecodePool(workers=1, timeout_s=3.0)
        if setup == "no shared memory":
            pool._slots_ok = False
        else:
            pool._slot_size = 100  # every image is larger: sent through the socket, the slots then grow
        try:
            for source, result in zip(files, pool.imap(files)):
                assert_same(result, expected(source))
            if setup == "small slots":
                assert pool._slot_size == 33 * 47 * 3
        finally:
            pool.close()


def test_pool_workers_import_no_torch(pool):
    for modules in pool.worker_modules(timeout_s=30):
        assert "PIL" in modules and "torch" not in modules and "numpy" not in modules


def test_abandoned_iteration_leaves_the_pool_usable_and_close_frees_shared_memory(sources):
    files = [s for s in sources if isinstance(s, str)][:4] * 3
    pool = DecodePool(workers=2, timeout_s=3.0)
    iterator = pool.imap(files)
    next(iterator)
    iterator.close()  # the rest are dropped as they arrive
    for source, result in zip(files, pool.imap(files)):
        assert_same(result, expected(source))
    pool.close()
    assert pool.slot_names and not any(os.path.exists(f"/dev/shm/{name}") for name in pool.slot_names)
    with pytest.raises(RuntimeError, match="closed"):
        list(pool.imap(files))


def test_a_hanging_file_times_out_and_a_killed_worker_loses_nothing(sources, tmp_path):
    """A FIFO blocks whoever opens it: the job times out (its ImageError), the worker is replaced,
    and the files queued behind it are decoded elsewhere; killing a worker by hand is the same.
    Every wait is bounded by the pool's timeout_s."""
    fifo = tmp_path / "hangs.jpg"
    os.mkfifo(fifo)
    good = [s for s in sources if isinstance(s, str)][:2]
    pool = DecodePool(workers=1, timeout_s=1.0)
    try:
        killer = threading.Timer(0.4, lambda: pool._pool[0].process.kill())
        killer.start()
        start = time.monotonic()
        got = list(pool.imap([str(fifo), *good, str(fifo), *good]))
        killer.join()
        assert time.monotonic() - start < 20
        for result in (got[0], got[3]):
            assert isinstance(result, ImageError) and str(fifo) in str(result)
            assert "longer than 1 s" in str(result) or "died" in str(result)
        # the second one was never killed by hand: it failed for its timeout, at once, not retried
        assert "decoding took longer than 1 s" in str(got[3])
        for source, result in zip(good * 2, got[1:3] + got[4:]):
            assert_same(result, expected(source))
        assert pool.stats["worker_deaths"] >= 2
    finally:
        pool.close()


def test_a_file_whose_worker_died_once_is_decoded_again_not_failed(sources, tmp_path):
    """One death is retried: the worker dies (killed) while it is held on a file; by the retry
    the path holds a good JPEG, which must come back as its pixels, not as an ImageError."""
    import shutil

    good = [s for s in sources if isinstance(s, str) and s.endswith(".jpg")][0]
    target = tmp_path / "comes_later.jpg"
    os.mkfifo(target)  # opening it blocks the worker until it is killed
    pool = DecodePool(workers=1, timeout_s=10.0)
    try:
        pool.worker_modules(timeout_s=30)  # the worker is up: the next job reaches it at once
        iterator = pool.imap([str(target), good])
        waiter = threading.Thread(target=lambda: got.append(next(iterator)))
        got: list = []
        waiter.start()
        time.sleep(0.5)
        shutil.copyfile(good, tmp_path / "staged.jpg")
        os.replace(tmp_path / "staged.jpg", target)
        pool._pool[0].process.kill()
        waiter.join(timeout=30)
        assert pool.stats["worker_deaths"] == 1
        assert_same(got[0], expected(good))
        assert_same(next(iterator), expected(good))
    finally:
        pool.close()


def test_workers_that_cannot_start_mean_inline_decoding_not_a_hang(sources, monkeypatch, caplog):
    def no_process(*args, **kwargs):
        raise OSError("no process for you")

    monkeypatch.setattr(decoding.subprocess, "Popen", no_process)
    monkeypatch.setattr(decoding, "_warned", [])
    files = [s for s in sources if isinstance(s, str)]
    pool = DecodePool(workers=2, timeout_s=3.0)
    try:
        with caplog.at_level(logging.WARNING, logger="storyrl.images.decoding"):
            got = list(decode_sources(files, pool=pool, inline_below=1))
        for source, result in zip(files, got):
            assert_same(result, expected(source))
        assert "decoding images in this process: no decode worker could start: no process for you" in caplog.text
        # Called directly, the pool fails its files instead of waiting on workers that never come.
        result = next(pool.imap(files[:1]))
        assert isinstance(result, ImageError) and "no decode worker could start" in str(result)
    finally:
        pool.close()


def test_shared_pool_started_only_for_enough_files(sources, monkeypatch):
    started = []
    monkeypatch.setattr(decoding, "shared_pool", lambda: started.append(1) or 1 / 0)
    files = [s for s in sources if isinstance(s, str)]
    list(decode_sources(files, inline_below=len(files) + 1))
    assert not started
    with pytest.raises(ZeroDivisionError):
        list(decode_sources(files, inline_below=len(files)))


# -- the CLIP embedder and the option --------------------------------------------------------


@pytest.fixture(scope="module")
def grid_regions(images):
    return [r for path in images for r in GridRegions().regions([path])[0]]


@pytest.fixture
def embedder(tiny_clip):
    from storyrl.models.clip import ClipEmbedder, ClipSpec

    return ClipEmbedder(ClipSpec(tiny_clip, None, "cpu", "fp32"))


def test_fast_embeddings_within_round_off_of_exact(embedder, grid_regions):
    """A level or two on ~1% of the pixels moves the tiny CLIP's unit embeddings by ~1e-4
    (measured 8e-5); 1e-3 leaves room yet fails for a crop one pixel off (checked here)."""
    exact = embedder.embed_regions(grid_regions, load_regions, "exact")
    fast = embedder.embed_regions(grid_regions, load_regions, "fast")
    np.testing.assert_allclose(fast, exact, atol=1e-3)
    assert not np.array_equal(fast, exact)  # not the exact vectors served twice
    shifted = [Region(r.source, None if r.box is None else (r.box[0] + 1, r.box[1], r.box[2] + 1, r.box[3]))
               for r in grid_regions]
    assert np.abs(embedder.embed_regions(shifted, load_regions, "exact") - exact).max() > 1e-3


def test_fast_never_calls_the_exact_path_nor_exact_the_fast_one(embedder, grid_regions, monkeypatch):
    import storyrl.images.tensor_preprocess as tp

    def refuse(_):
        raise AssertionError("the exact path's loader was called")

    made = []
    batches = tp.region_batches
    monkeypatch.setattr(tp, "region_batches", lambda *a, **k: made.append(1) or batches(*a, **k))
    embedder.embed_regions(grid_regions, refuse, "fast")
    assert made
    made.clear()
    embedder.embed_regions(grid_regions, load_regions, "exact")
    assert not made
    with pytest.raises(ValueError, match="image pipeline must be one of exact, fast, got 'slow'"):
        embedder.embed_regions(grid_regions, load_regions, "slow")


def test_caches_keep_the_pipelines_apart(embedder, grid_regions, tmp_path):
    from storyrl.models.caches import DiskEmbeddingCache

    embedder.use_disk_cache(tmp_path)
    fast = embedder.embed_regions(grid_regions, load_regions, "fast")
    assert embedder.stats["regions_embedded"] == len(grid_regions)
    exact = embedder.embed_regions(grid_regions, load_regions, "exact")  # not served the fast vectors
    assert embedder.stats["regions_embedded"] == 2 * len(grid_regions)
    # A fresh process (memory empty) finds each pipeline's own vectors on disk.
    embedder.regions.clear()
    np.testing.assert_array_equal(embedder.embed_regions(grid_regions, load_regions, "exact"), exact)
    np.testing.assert_array_equal(embedder.embed_regions(grid_regions, load_regions, "fast"), fast)
    assert embedder.stats["regions_embedded"] == 2 * len(grid_regions)
    # The exact pipeline keeps the keys caches were written with before the option existed.
    import hashlib

    disk = DiskEmbeddingCache(tmp_path, embedder.cache_key)
    path, box = grid_regions[1].key
    st = os.stat(path)
    old_key = hashlib.sha1(repr((embedder.cache_key, f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}",
                                 box)).encode()).hexdigest()
    row = disk._db().execute("SELECT vec FROM emb WHERE key = ?", (old_key,)).fetchone()
    np.testing.assert_array_equal(np.frombuffer(row[0], dtype=np.float32), exact[1])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fast_pipeline_at_half_precision_on_the_cpu(tiny_clip, grid_regions, precision):
    """The pixels reach the image tower in its dtype (a first GPU run failed on fp32 pixels
    against fp16 weights), and the embeddings are fp32's within that dtype's round-off."""
    from conftest import precision_tolerance

    from storyrl.models.clip import ClipEmbedder, ClipSpec

    fp32 = ClipEmbedder(ClipSpec(tiny_clip, None, "cpu", "fp32")).embed_regions(grid_regions, None, "fast")
    half = ClipEmbedder(ClipSpec(tiny_clip, None, "cpu", precision))
    got = half.embed_regions(grid_regions, None, "fast")
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, fp32, atol=precision_tolerance(precision, fp32))


def test_an_unreproduced_transform_falls_back_to_exact_and_says_so_once(embedder, grid_regions, caplog):
    from torchvision import transforms as T

    embedder.preprocess = T.Compose([T.Lambda(lambda im: im), *embedder.preprocess.transforms])
    with caplog.at_level(logging.WARNING, logger="storyrl.models.clip"):
        fast = embedder.embed_regions(grid_regions, load_regions, "fast")
        embedder.embed_regions(grid_regions[:2], load_regions, "fast")
    assert [r.getMessage() for r in caplog.records].count(
        f"CLIP model {embedder.spec.model!r}: image_pipeline='fast' uses the exact PIL pipeline: the image "
        "transform's Lambda step is not reproduced") == 1
    np.testing.assert_array_equal(fast, embedder.embed_regions(grid_regions, load_regions, "exact"))


def test_image_pipeline_option_validated_and_on_the_command_line(tiny_clip):
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.rewards import create_reward

    for name in ("groovist", "clipscore"):
        with pytest.raises(ValueError, match="image_pipeline"):
            create_reward(name, clip_model=tiny_clip, image_pipeline="slow")
        assert create_reward(name, clip_model=tiny_clip, image_pipeline="exact").image_pipeline == "exact"
    result = CliRunner().invoke(main, ["score", "--help"])
    assert "--image-pipeline [exact|fast]" in result.output


def test_image_pipeline_changes_the_scores_by_round_off_only(tiny_clip, images):
    from storyrl.rewards import create_reward

    story = "A dog runs. The sky is blue. A car."
    scores = {p: create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, image_pipeline=p)
              .score([story], images=[images])[0] for p in ("exact", "fast")}
    assert scores["fast"] != scores["exact"] and abs(scores["fast"] - scores["exact"]) < 1e-3
