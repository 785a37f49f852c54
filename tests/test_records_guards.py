"""storyrl.images.availability and ``storyrl records``: the guards a
break review found untested (truncated files, PIL's other errors, shared
photos decoded once, the first bad image named, every image extension,
output-is-input, empty files, the dropped-story listing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from storyrl.cli import main
from storyrl.data import StoryRecord
from storyrl.images import availability
from storyrl.images.availability import check_sequences


def _photo(path, seed=0, size=(64, 64)):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def photos(tmp_path):
    """Six decodable JPEGs 0.jpg .. 5.jpg."""
    root = tmp_path / "img"
    root.mkdir()
    for k in range(6):
        _photo(root / f"{k}.jpg", k)
    return root


def invoke(*args):
    return CliRunner().invoke(main, ["records", *map(str, args)])


def test_a_truncated_jpeg_with_an_intact_header_is_left_out(photos):
    data = (photos / "1.jpg").read_bytes()
    (photos / "1.jpg").write_bytes(data[: int(len(data) * 0.8)])
    with Image.open(photos / "1.jpg") as im:  # the header alone still reads: only decoding finds the cut
        assert im.size == (64, 64)
    check = check_sequences([StoryRecord("a", "x", image_ids=["0", "1"]), StoryRecord("b", "x", image_ids=["2"])],
                            photos)
    assert [r.story_id for r in check.kept] == ["b"]
    assert check.dropped["a"].startswith(str(photos / "1.jpg")) and check.reasons == {"image unreadable": 1}


@pytest.mark.parametrize("error", [ValueError("bad mode"), SyntaxError("bad header"),
                                   Image.DecompressionBombError("too many pixels")])
def test_any_pil_error_drops_one_story_and_the_run_goes_on(photos, monkeypatch, error):
    real = availability.open_rgb

    def failing(path):
        if str(path).endswith("1.jpg"):
            raise error
        return real(path)

    monkeypatch.setattr(availability, "open_rgb", failing)
    check = check_sequences([StoryRecord("a", "x", image_ids=["0", "1"]), StoryRecord("b", "x", image_ids=["2"])],
                            photos, workers=2)
    assert [r.story_id for r in check.kept] == ["b"] and str(error) in check.dropped["a"]


def test_each_distinct_image_is_decoded_once(photos, monkeypatch):
    real, seen = availability.open_rgb, []

    def counting(path):
        seen.append(str(path))
        return real(path)

    monkeypatch.setattr(availability, "open_rgb", counting)
    shared = [StoryRecord(str(s), "x", image_ids=["0", "1", str(2 + s)]) for s in range(3)]
    check = check_sequences(shared, photos, workers=1)
    assert len(check.kept) == 3 and check.images == 5
    assert sorted(seen) == sorted(str(photos / f"{k}.jpg") for k in range(5))


def test_reasons_add_up_over_stories(photos):
    (photos / "3.jpg").write_bytes(b"no image")
    (photos / "4.jpg").write_bytes(b"no image")
    records = [StoryRecord("e1", "x"), StoryRecord("e2", "x"), StoryRecord("e3", "x"),
               StoryRecord("m1", "x", image_ids=["9"]), StoryRecord("m2", "x", image_ids=["0", "8"]),
               StoryRecord("u1", "x", image_ids=["3"]), StoryRecord("u2", "x", image_ids=["4"]),
               StoryRecord("ok", "x", image_ids=["0"])]
    check = check_sequences(records, photos)
    assert check.reasons == {"no images": 3, "image not found": 2, "image unreadable": 2}
    assert sum(check.reasons.values()) == len(check.dropped) == 7


def test_the_message_names_the_first_bad_image_and_its_path(photos):
    for k in (2, 4):
        (photos / f"{k}.jpg").write_bytes(b"no image")
    check = check_sequences([StoryRecord("a", "x", image_ids=["0", "1", "2", "3", "4"])], photos)
    assert check.dropped["a"].startswith(f"{photos / '2.jpg'}: cannot read image")
    assert "4.jpg" not in check.dropped["a"]


def test_png_and_gif_images_are_found_by_id(tmp_path):
    _photo(tmp_path / "7.png", 7)
    Image.open(_photo(tmp_path / "tmp.png", 8)).convert("P").save(tmp_path / "8.gif")
    check = check_sequences([StoryRecord("a", "x", image_ids=["7", "8"])], tmp_path)
    assert [r.story_id for r in check.kept] == ["a"] and check.images == 2


def _records_file(path, photos, n):
    path.write_text("".join(json.dumps({"story_id": f"s{k}", "story": "x", "image_ids": [str(k % 6)]}) + "\n"
                            for k in range(n)))
    return path


def test_the_output_may_not_be_the_input_even_with_overwrite(photos, tmp_path):
    data = _records_file(tmp_path / "x.jsonl", photos, 2)
    before = data.read_text()
    result = invoke(data, "--image-root", photos, "-o", data, "--overwrite", "-q")
    assert result.exit_code != 0 and "is also an input file" in result.output
    assert data.read_text() == before


def test_an_empty_vist_file_is_one_line(tmp_path):
    (tmp_path / "sis.json").write_text('{"annotations": []}')
    result = invoke(tmp_path / "sis.json", "-o", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.output.strip().splitlines() == [f"Error: {tmp_path / 'sis.json'}: no stories"]


@pytest.mark.parametrize("bad, more", [(4, None), (5, None), (6, "... 1 more stories left out"),
                                       (8, "... 3 more stories left out")])
def test_the_dropped_listing_names_five_and_counts_the_rest(photos, tmp_path, bad, more):
    data = tmp_path / "d.jsonl"
    ids = ["0"] + [f"gone{k}" for k in range(bad)]
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": "x", "image_ids": [i]}) + "\n"
                            for k, i in enumerate(ids)))
    result = invoke(data, "--image-root", photos, "-o", tmp_path / "o.jsonl", "-q")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("left out: story") == min(bad, 5)
    assert ("more stories left out" in result.stderr) == (more is not None)
    assert more is None or more in result.stderr


def test_quiet_shows_no_progress_bar(photos, tmp_path):
    data = _records_file(tmp_path / "d.jsonl", photos, 3)
    quiet = invoke(data, "--image-root", photos, "-o", tmp_path / "q.jsonl", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_upper_case_json_image_id_map_is_accepted(photos, tmp_path):
    data = _records_file(tmp_path / "d.jsonl", photos, 2)
    result = invoke(data, "--image-root", photos, "-o", tmp_path / "o.jsonl", "--image-ids-out",
                    tmp_path / "IDS.JSON", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "IDS.JSON").read_text()) == {"s0": ["0"], "s1": ["1"]}


@pytest.mark.parametrize("order", ["first", None, [1], 1.5])
def test_a_non_integer_photo_order_is_one_line_naming_the_file_and_record(tmp_path, order):
    annotations = [[{"story_id": "7", "photo_flickr_id": str(k), "worker_arranged_photo_order": k, "text": "x"}]
                   for k in range(2)]
    annotations[1][0]["worker_arranged_photo_order"] = order
    (tmp_path / "sis.json").write_text(json.dumps({"annotations": annotations}))
    result = invoke(tmp_path / "sis.json", "-o", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "sis.json") in lines[0] and "annotations[1]" in lines[0]
    assert "worker_arranged_photo_order" in lines[0] and repr(order) in lines[0]
