"""Image sequences, region sources and region detection (tiny images made here)."""

from __future__ import annotations

import csv
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_models import save_random_detector

from storyrl.images import (
    COCO_CHECKPOINT,
    GridRegions,
    ImageError,
    Region,
    RegionTable,
    WholeImage,
    create_region_source,
    detect_regions,
    load_region,
    load_regions,
    resolve_images,
    sequence_regions,
)


def gradient(width: int, height: int, seed: int = 0) -> Image.Image:
    """RGB image whose pixel (x, y) is (x, y, seed): crops are recognisable by their pixels."""
    x = np.arange(width, dtype=np.uint8)[None, :].repeat(height, 0)
    y = np.arange(height, dtype=np.uint8)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, seed)], axis=-1), "RGB")


@pytest.fixture
def pics(tmp_path: Path) -> Path:
    """a.png 64x48 gradient, b.jpg 60x30 solid, c.png 60x30 gradient (grayscale mode)."""
    gradient(64, 48).save(tmp_path / "a.png")
    Image.new("RGB", (60, 30), (200, 10, 10)).save(tmp_path / "b.jpg")
    gradient(60, 30, seed=7).convert("L").save(tmp_path / "c.png")
    return tmp_path


# -- Region and loading ----------------------------------------------------------


def test_region_key_for_files(pics):
    a = Region(str(pics / "a.png"), (1, 2, 3, 4), image_index=0, label="x")
    b = Region(pics / "a.png", [1.0, 2.0, 3.0, 4.0], image_index=5, label="y")
    assert a.key == b.key == (str(pics / "a.png"), (1.0, 2.0, 3.0, 4.0))
    assert a == b and hash(a) == hash(b)  # index and label do not count
    assert a != Region(str(pics / "a.png"), (1, 2, 3, 5))
    assert a != Region(str(pics / "a.png"))
    assert Region(str(pics / "a.png")).key == (str(pics / "a.png"), None)
    assert len({a, b}) == 1


def test_region_key_for_pil_images_is_by_content():
    one, same, other = gradient(8, 6), gradient(8, 6), gradient(8, 6, seed=1)
    key = Region(one, (0, 0, 2, 2)).key
    assert key[0].startswith("pil:") and key[1] == (0.0, 0.0, 2.0, 2.0)
    assert Region(same, (0, 0, 2, 2)).key == key
    assert Region(other, (0, 0, 2, 2)).key != key
    assert Region(one.convert("L"), (0, 0, 2, 2)).key != key  # mode is part of the digest
    assert Region(one) == Region(same) and hash(Region(one)) == hash(Region(same))
    # The digest is cached per object and the image is not kept alive by the cache.
    import gc
    import weakref

    from storyrl.images import loading as mod

    assert id(one) in mod._pil_digests
    ref, ident = weakref.ref(other), id(other)
    del other
    gc.collect()
    assert ref() is None and ident not in mod._pil_digests


def test_region_rejects_bad_input():
    with pytest.raises(TypeError):
        Region(123)
    with pytest.raises(ValueError, match="4 numbers"):
        Region("a.png", (1, 2, 3))


def test_load_region_crops_and_clamps(pics):
    path = str(pics / "a.png")
    whole = load_region(Region(path))
    assert whole.mode == "RGB" and whole.size == (64, 48)
    crop = load_region(Region(path, (10, 5, 30, 25)))
    assert crop.size == (20, 20)
    assert crop.getpixel((0, 0)) == (10, 5, 0)  # top-left pixel of the box
    # Out-of-bounds parts are clamped away.
    assert load_region(Region(path, (-10, -3, 100, 20))).size == (64, 20)
    assert load_region(Region(path, (50, 40, 80, 90))).size == (14, 8)
    # A positive float box thinner than a pixel still yields one pixel.
    assert load_region(Region(path, (10.2, 5, 10.4, 6))).size == (1, 1)
    # Grayscale files come back as RGB.
    assert load_region(Region(str(pics / "c.png"), (0, 0, 5, 5))).mode == "RGB"
    # PIL sources are not modified.
    src = gradient(20, 10).convert("L")
    out = load_region(Region(src, (0, 0, 4, 4)))
    assert out.mode == "RGB" and out.size == (4, 4) and src.mode == "L" and src.size == (20, 10)


@pytest.mark.parametrize("box", [(70, 0, 90, 10), (10, 10, 10, 20), (30, 20, 20, 30), (-5, -5, 0, 10)])
def test_zero_area_box_is_an_error(pics, box):
    path = str(pics / "a.png")
    with pytest.raises(ImageError, match="zero area") as info:
        load_region(Region(path, box))
    assert info.value.path == path


def test_unreadable_images_name_the_path(pics):
    missing = str(pics / "nope.png")
    with pytest.raises(ImageError, match="cannot read image") as info:
        load_region(Region(missing))
    assert info.value.path == missing and str(info.value).startswith(missing + ": ")
    (pics / "junk.jpg").write_bytes(b"not an image")
    with pytest.raises(ImageError, match="cannot read image") as info:
        load_regions([Region(str(pics / "a.png")), Region(str(pics / "junk.jpg"), (0, 0, 1, 1))])
    assert info.value.path == str(pics / "junk.jpg")
    # ImageError survives pickling (multiprocessing workers).
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.path, again.problem, str(again)) == (info.value.path, info.value.problem, str(info.value))


def test_load_regions_decodes_each_file_once(pics, monkeypatch):
    a, b = str(pics / "a.png"), str(pics / "b.jpg")
    pil = gradient(10, 10)
    regions = [Region(a, (0, 0, 4, 4)), Region(b), Region(a), Region(pil, (0, 0, 2, 3)), Region(a, (4, 4, 8, 10))]
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda fp, *args, **kw: opened.append(str(fp)) or real_open(fp, *args, **kw))
    out = load_regions(regions)
    assert sorted(opened) == sorted([a, b])
    assert [im.size for im in out] == [(4, 4), (60, 30), (64, 48), (2, 3), (4, 6)]
    assert out[4].getpixel((0, 0)) == (4, 4, 0)
    assert all(im.mode == "RGB" for im in out)
    assert load_regions([]) == []


# -- resolve_images ----------------------------------------------------------------


def test_resolve_images_paths_root_and_pil(pics):
    a = str(pics / "a.png")
    assert resolve_images([a, pics / "b.jpg"]) == [a, str(pics / "b.jpg")]
    assert resolve_images(["a.png", "b.jpg"], image_root=pics) == [a, str(pics / "b.jpg")]
    assert resolve_images([a], image_root="/elsewhere") == [a]  # absolute paths ignore the root
    pil = gradient(4, 4)
    out = resolve_images([pil, "a.png"], image_root=str(pics))
    assert out[0] is pil and out[1] == a
    assert resolve_images(a) == [a]  # a single path is one image, not characters
    with pytest.raises(ImageError, match="not found") as info:
        resolve_images(["a.png", "zzz.png"], image_root=pics)
    assert info.value.path == str(pics / "zzz.png")


def test_resolve_images_by_id(pics):
    Image.new("RGB", (4, 4)).save(pics / "d.jpeg")
    assert resolve_images(image_ids=["a", "b", "d", "b.jpg"], image_root=pics) == [
        str(pics / "a.png"),
        str(pics / "b.jpg"),
        str(pics / "d.jpeg"),
        str(pics / "b.jpg"),
    ]
    # The first existing extension wins, in the given order.
    Image.new("RGB", (4, 4)).save(pics / "a.jpg")
    assert resolve_images(image_ids=["a"], image_root=pics) == [str(pics / "a.jpg")]
    assert resolve_images(image_ids=["a"], image_root=pics, extensions=(".png", ".jpg")) == [str(pics / "a.png")]


def test_resolve_images_errors(pics):
    with pytest.raises(ImageError) as info:
        resolve_images(image_ids=["a", "missing"], image_root=pics, extensions=(".jpg", ".png"))
    message = str(info.value)
    assert "'missing'" in message
    assert str(pics / "missing.jpg") in message and str(pics / "missing.png") in message
    with pytest.raises(ImageError, match="story has no images or image_ids") as info:
        resolve_images()
    assert info.value.path == "<no images>"
    with pytest.raises(ImageError, match="story has no images"):
        resolve_images(images=[], image_ids=[])
    with pytest.raises(ImageError, match="image_root"):
        resolve_images(image_ids=["a"])


# -- region sources ------------------------------------------------------------------


def test_whole_image_regions(pics):
    images = [str(pics / "a.png"), gradient(5, 5)]
    regions = WholeImage().regions(images, None)
    assert [[(r.source, r.box, r.image_index) for r in regs] for regs in regions] == [
        [(images[0], None, 0)],
        [(images[1], None, 1)],
    ]
    assert regions[1][0].label == "img1"


def test_grid_regions_boxes(pics):
    path = str(pics / "b.jpg")  # 60x30
    (regs,) = GridRegions(grid=3).regions([path], None)
    assert len(regs) == 10 and regs[0].box is None
    assert [r.box for r in regs[1:]] == [
        (0.0, 0.0, 20.0, 10.0),
        (20.0, 0.0, 40.0, 10.0),
        (40.0, 0.0, 60.0, 10.0),
        (0.0, 10.0, 20.0, 20.0),
        (20.0, 10.0, 40.0, 20.0),
        (40.0, 10.0, 60.0, 20.0),
        (0.0, 20.0, 20.0, 30.0),
        (20.0, 20.0, 40.0, 30.0),
        (40.0, 20.0, 60.0, 30.0),
    ]
    assert regs[5].label == "img0 [20,10,40,20]"
    assert all(im.size == (20, 10) for im in load_regions(regs[1:]))
    (two,) = GridRegions(grid=2, include_whole=False).regions([gradient(5, 3)], None)
    assert [r.box for r in two] == [(0, 0, 2.5, 1.5), (2.5, 0, 5, 1.5), (0, 1.5, 2.5, 3), (2.5, 1.5, 5, 3)]
    with pytest.raises(ValueError, match="grid"):
        GridRegions(grid=0)
    with pytest.raises(ImageError, match="cannot read"):
        GridRegions().regions([str(pics / "nope.png")], None)


def test_grid_reads_only_the_header(pics, monkeypatch):
    # Sizes come from Image.open(...).size: no pixel decoding.
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded pixels"))
    assert len(GridRegions().regions([str(pics / "a.png")], None)[0]) == 10


def write_table(path: Path, rows: list[tuple], header=("image_name", "image_id", "bbox", "object", "score")) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture
def table(pics) -> Path:
    rows = [("a.png", "a", f"[{i}.5, 1.0, {i + 10}.25, 20.0]", f"obj{i}", 0.9 - i / 100) for i in range(12)]
    rows.insert(3, ("b.jpg", "b", "[0.0, 0.0, 30.0, 15.0]", "car", 0.5))  # interleaved: file order per id
    return write_table(pics / "regions.csv", rows)


def test_region_table_top_b_in_file_order(pics, table):
    source = RegionTable(table)  # top_b=10
    images = [str(pics / "a.png"), str(pics / "b.jpg")]
    regs_a, regs_b = source.regions(images, None)
    assert [r.box for r in regs_a] == [(i + 0.5, 1.0, i + 10.25, 20.0) for i in range(10)]
    assert all(r.source == images[0] and r.image_index == 0 for r in regs_a)
    assert regs_a[2].label == "img0 obj2 [2.5,1,12.25,20]"
    assert [(r.source, r.box, r.image_index) for r in regs_b] == [(images[1], (0, 0, 30, 15), 1)]
    assert [r.box[0] for r in RegionTable(table, top_b=3).regions(images[:1], None)[0]] == [0.5, 1.5, 2.5]
    # image_ids override the file stem.
    (regs,) = source.regions([gradient(64, 48)], ["b"])
    assert regs[0].box == (0, 0, 30, 15)
    assert "top 10" in source.describe() and str(table) in source.describe()


def test_region_table_crops_dir_names(pics, table):
    crops = pics / "crops"
    crops.mkdir()
    source = RegionTable(table, top_b=2, crops_dir=crops)
    (regs,) = source.regions([str(pics / "a.png")], None)
    names = ["a_[0.5, 1.0, 10.25, 20.0].jpg", "a_[1.5, 1.0, 11.25, 20.0].jpg"]
    assert [r.source for r in regs] == [str(crops / n) for n in names]
    assert all(r.box is None for r in regs)
    assert regs[1].label == "img0 " + names[1]
    gradient(10, 19).save(crops / names[0])
    assert load_region(regs[0]).size == (10, 19)
    with pytest.raises(ImageError, match="cannot read image") as info:
        load_region(regs[1])
    assert info.value.path == str(crops / names[1])


def test_region_table_minimal_columns_and_bom(pics):
    path = pics / "min.csv"
    path.write_text('\ufeffimage_id,bbox\n7,"[1, 2, 3, 4]"\n', encoding="utf-8")
    (regs,) = RegionTable(path).regions(["x/7.jpg"], None)
    assert regs[0].box == (1, 2, 3, 4) and regs[0].label == "img0 [1,2,3,4]"


def test_region_table_errors(pics, table):
    with pytest.raises(ImageError, match="no regions for image id 'c'") as info:
        RegionTable(table).regions([str(pics / "c.png")], None)
    assert info.value.path == str(table)
    bad = write_table(
        pics / "bad.csv", [("a.png", "a", "[1, 2, 3, 4]", "x", 1), ("a.png", "a", "[1, 2, oops]", "x", 1)]
    )
    with pytest.raises(ImageError, match=r"line 3: malformed bbox '\[1, 2, oops\]'") as info:
        RegionTable(bad)
    assert info.value.path == str(bad)
    nan = write_table(pics / "nan.csv", [("a.png", "a", "[1, 2, nan, 4]", "x", 1)])
    with pytest.raises(ImageError, match="line 2"):
        RegionTable(nan)
    no_bbox = write_table(pics / "nobbox.csv", [("a", "1 2 3 4")], header=("image_id", "box"))
    with pytest.raises(ImageError, match="bbox"):
        RegionTable(no_bbox)
    with pytest.raises(ImageError, match="cannot read region table"):
        RegionTable(pics / "absent.csv")
    with pytest.raises(ImageError, match="crops directory"):
        RegionTable(table, crops_dir=pics / "absent")
    with pytest.raises(ImageError, match="need image_ids"):
        RegionTable(table).regions([gradient(4, 4)], None)


def test_create_region_source(pics, table):
    assert isinstance(create_region_source("whole"), WholeImage)
    grid = create_region_source("grid", grid=2, top_b=None, region_table=None)
    assert isinstance(grid, GridRegions) and grid.grid == 2
    assert create_region_source(" Grid ").grid == 3
    tab = create_region_source("table", region_table=table, top_b=4)
    assert isinstance(tab, RegionTable) and tab.top_b == 4 and tab.crops_dir is None
    assert create_region_source("table", path=str(table)).top_b == 10
    (pics / "crops").mkdir()
    crops = create_region_source("crops", region_table=table, crops_dir=pics / "crops")
    assert crops.crops_dir == str(pics / "crops")

    with pytest.raises(ValueError, match="valid kinds: whole, grid, table, crops"):
        create_region_source("boxes")
    with pytest.raises(ValueError, match="needs region_table"):
        create_region_source("table")
    with pytest.raises(ValueError, match="needs crops_dir"):
        create_region_source("crops", region_table=table)
    with pytest.raises(ValueError, match="do not apply"):
        create_region_source("whole", region_table=table)
    with pytest.raises(ValueError, match="unknown region source option"):
        create_region_source("grid", gird=3)


def test_sources_pickle(pics, table):
    for source in (WholeImage(), GridRegions(grid=2, include_whole=False), RegionTable(table, top_b=3)):
        again = pickle.loads(pickle.dumps(source))
        assert type(again) is type(source) and again.describe() == source.describe()
        images = [str(pics / "a.png")]
        assert again.regions(images, None) == source.regions(images, None)
    regions = GridRegions().regions([gradient(6, 6)], None)[0]
    assert pickle.loads(pickle.dumps(regions)) == regions


def test_sequence_regions(pics):
    images = resolve_images(image_ids=["a", "b"], image_root=pics)
    flat = sequence_regions(GridRegions(grid=2), images, None)
    assert len(flat) == 10
    assert [r.image_index for r in flat] == [0] * 5 + [1] * 5
    assert [r.label for r in flat[:2]] == ["img0", "img0 [0,0,32,24]"]
    assert flat[5].label == "img1"
    assert sequence_regions(WholeImage(), [], None) == []


# -- detection -------------------------------------------------------------------------

# Small inputs and proposal counts keep a random-weight ResNet-50 Faster R-CNN at
# about a second per image on 2 CPU cores.
FAST = dict(min_size=64, max_size=64, rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=30)


def test_detect_regions_without_weights(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as info:
        detect_regions([tmp_path / "x.jpg"], tmp_path / "out.csv", progress=False)
    message = str(info.value)
    assert COCO_CHECKPOINT in message and str(tmp_path / "hub" / "checkpoints") in message
    assert "--weights" in message and "download" in message
    with pytest.raises(FileNotFoundError, match="mine.pth"):
        detect_regions([tmp_path / "x.jpg"], tmp_path / "out.csv", weights=tmp_path / "mine.pth", progress=False)
    assert not (tmp_path / "out.csv").exists()


@pytest.fixture(scope="module")
def random_detector(tmp_path_factory) -> Path:
    import torch
    import torch._dynamo

    import storyrl  # noqa: F401  (torchvision import hook)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compat fallback warning
        from torchvision.ops import roi_align

    # Without compiled ops torchvision runs roi_align in Python through torch.compile,
    # which costs 5-10 s of compilation per process. Let it bind the eager function
    # instead: same results on these tiny inputs, and the CSV logic is what is tested.
    disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        roi_align(torch.zeros(1, 1, 4, 4), [torch.tensor([[0.0, 0.0, 2.0, 2.0]])], 2)
    finally:
        torch._dynamo.config.disable = disabled

    return save_random_detector(tmp_path_factory.mktemp("weights") / "random_frcnn.pth", seed=0)


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


def test_detect_regions_writes_resumable_csv(tmp_path, random_detector, capsys, monkeypatch):
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights

    categories = FasterRCNN_ResNet50_FPN_Weights.COCO_V1.meta["categories"]
    paths = []
    for i, name in enumerate(["p.jpg", "q.png", "r.png"]):
        gradient(64, 64, seed=40 * i).save(tmp_path / name)
        paths.append(tmp_path / name)
    out = tmp_path / "det" / "regions.csv"
    kwargs = dict(weights=random_detector, top_b=3, score_threshold=0.0, batch_size=2, **FAST)

    result = detect_regions(paths[:2], out, progress=True, device="cpu", **kwargs)
    assert result == out
    err = capsys.readouterr().err
    assert "detecting regions" in err  # tqdm on stderr
    # on CPU an estimate comes first: tqdm's ETA only appears after the first batch (issue 21 item 7)
    assert "detecting regions in 2 images on CPU: about 30-50 s per image, ETA 1-2 min" in err
    header, rows = read_rows(out)
    assert header == ["image_name", "image_id", "bbox", "object", "score"]
    by_id = {}
    for row in rows:
        by_id.setdefault(row["image_id"], []).append(row)
    assert set(by_id) == {"p", "q"}
    assert all(0 < len(v) <= 3 for v in by_id.values())
    for row in rows:
        assert row["image_name"] == row["image_id"] + (".jpg" if row["image_id"] == "p" else ".png")
        assert row["object"] in categories
        assert row["bbox"].startswith("[") and row["bbox"].endswith("]")
    for image_rows in by_id.values():
        scores = [float(r["score"]) for r in image_rows]
        assert scores == sorted(scores, reverse=True)

    # The CSV feeds RegionTable directly, boxes inside the 64x64 images.
    table = RegionTable(out, top_b=10)
    regs_p, regs_q = table.regions([str(p) for p in paths[:2]], None)
    assert len(regs_p) == len(by_id["p"]) and len(regs_q) == len(by_id["q"])
    for r in regs_p + regs_q:
        x1, y1, x2, y2 = r.box
        assert 0 <= x1 <= x2 <= 64 and 0 <= y1 <= y2 <= 64

    # Resume: done images are skipped (their rows unchanged), new ones appended.
    before = out.read_text()
    detect_regions(paths, out, progress=False, **kwargs)
    after = out.read_text()
    assert after.startswith(before)
    _, rows = read_rows(out)
    assert [r["image_id"] for r in rows[len(by_id["p"]) + len(by_id["q"]) :]] == ["r"] * (
        len(rows) - len(by_id["p"]) - len(by_id["q"])
    )
    assert after.count("\nr.png,") >= 1
    assert capsys.readouterr().err == ""  # progress=False

    # Everything done: the model is not even loaded.
    import torch

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("model loaded"))
    detect_regions(paths, out, progress=False, **kwargs)
    assert out.read_text() == after
    empty = tmp_path / "empty.csv"
    detect_regions([], empty, progress=False, **kwargs)
    assert read_rows(empty) == (["image_name", "image_id", "bbox", "object", "score"], [])


def test_detect_regions_repairs_interrupted_csv(tmp_path, random_detector):
    path = tmp_path / "s.png"
    gradient(64, 64).save(path)
    out = tmp_path / "regions.csv"
    # A crash mid-row: the last image's rows are dropped and it is detected again.
    out.write_text(
        "image_name,image_id,bbox,object,score\n"
        'k.png,k,"[1.0, 2.0, 3.0, 4.0]",person,0.5\n'
        's.png,s,"[1.0, 2.0, 3.0, 4.0]",person,0.5\n'
        's.png,s,"[1.0, 2.',
        encoding="utf-8",
    )
    detect_regions([path], out, weights=random_detector, top_b=2, progress=False, **FAST)
    _, rows = read_rows(out)
    assert rows[0]["image_id"] == "k"
    assert [r["image_id"] for r in rows[1:]] == ["s"] * (len(rows) - 1) and 1 <= len(rows) - 1 <= 2
    assert rows[1]["bbox"] != "[1.0, 2.0, 3.0, 4.0]"


def test_detect_regions_errors(tmp_path, random_detector):
    (tmp_path / "bad.jpg").write_bytes(b"nope")
    with pytest.raises(ImageError, match="cannot read image") as info:
        detect_regions([tmp_path / "bad.jpg"], tmp_path / "o.csv", weights=random_detector, progress=False, **FAST)
    assert info.value.path == str(tmp_path / "bad.jpg")
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b\n1,2\n")
    gradient(8, 8).save(tmp_path / "ok.png")
    with pytest.raises(ValueError, match="refusing to append"):
        detect_regions([tmp_path / "ok.png"], foreign, weights=random_detector, progress=False, **FAST)
    gradient(8, 8).save(tmp_path / "ok.jpg")
    with pytest.raises(ValueError, match="share the image id"):
        detect_regions([tmp_path / "ok.png", tmp_path / "ok.jpg"], tmp_path / "o.csv", weights=random_detector)
