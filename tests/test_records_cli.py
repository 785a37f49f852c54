"""``storyrl records`` and storyrl.images.availability: a VIST SIS file (or any
story file) as storyrl records of the stories whose images can all be read."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_documented_path import SENTENCES, write_vist_sis

from storyrl.cli import main
from storyrl.data import StoryRecord
from storyrl.images.availability import check_sequences


@pytest.fixture
def vist(tmp_path):
    """4 VIST stories (ids 0-3, photos 1000 + 10 s + k); story 1 misses a
    photo, story 2 has one that is no image."""
    write_vist_sis(tmp_path / "sis.json", tmp_path / "images", 4)
    (tmp_path / "images/1013.jpg").unlink()
    (tmp_path / "images/1022.jpg").write_bytes(b"not a jpeg")
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(main, ["records", *map(str, args)])


def test_the_readable_stories_in_order_with_their_image_ids(vist):
    out, ids = vist / "rec/train.jsonl", vist / "rec/ids.json"
    result = invoke(vist / "sis.json", "--image-root", vist / "images", "-o", out, "--image-ids-out", ids, "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["stories"] == 4 and summary["kept"] == 2 and summary["dropped"] == 2
    assert summary["reasons"] == {"image not found": 1, "image unreadable": 1}
    assert summary["images_checked"] == 15  # story 1 is out before its photos are decoded
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records == [
        {"story_id": str(s), "story": " ".join(SENTENCES[(s + k) % len(SENTENCES)] for k in range(5)),
         "image_ids": [str(1000 + 10 * s + k) for k in range(5)]} for s in (0, 3)]
    assert json.loads(ids.read_text()) == {r["story_id"]: r["image_ids"] for r in records}
    assert "left out: story 1:" in result.stderr and "1013" in result.stderr
    assert "left out: story 2:" in result.stderr and "cannot read image" in result.stderr


def test_no_decode_checks_only_that_the_files_are_there(vist):
    out = vist / "rec.jsonl"
    result = invoke(vist / "sis.json", "--image-root", vist / "images", "-o", out, "--no-decode", "-q")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["story_id"] for line in out.read_text().splitlines()] == ["0", "2", "3"]
    assert json.loads(result.stdout.strip().splitlines()[-1])["decoded"] is False


@pytest.mark.parametrize("workers", [1, 3])
def test_check_sequences_by_hand(vist, workers):
    records = [StoryRecord("p", "x", images=[str(vist / "images/1000.jpg"), "images/1001.jpg"]),
               StoryRecord("none", "x"),
               StoryRecord("bad", "x", image_ids=["1020", "1022"]),
               StoryRecord("ok", "x", image_ids=["1030"])]
    seen = []
    check = check_sequences(records, vist / "images", workers=workers, progress=seen.append)
    assert [r.story_id for r in check.kept] == ["ok"]  # "p": its relative path resolves under the root: not there
    assert set(check.dropped) == {"p", "none", "bad"} and check.dropped["none"] == "story has no images or image_ids"
    assert check.reasons == {"image not found": 1, "no images": 1, "image unreadable": 1}
    assert check.images == 3 and sum(seen) == 3
    relative = check_sequences(records[:1], vist)
    assert [r.story_id for r in relative.kept] == ["p"]
    with pytest.raises(ValueError, match="workers"):
        check_sequences(records, vist, workers=0)


def test_nothing_readable_is_one_line_and_writes_nothing(vist):
    out = vist / "rec.jsonl"
    result = invoke(vist / "sis.json", "--image-root", vist, "-o", out)
    assert result.exit_code == 1 and "no story has all its images readable (4 left out" in result.output
    assert "is --image-root the directory of the images?" in result.output and not out.exists()


@pytest.mark.parametrize("args, message", [
    (["-o", "{dir}/x.json"], "records are JSONL"),  # under tmp_path, never the working directory
    (["-o", "{dir}/r.jsonl", "--image-ids-out", "{dir}/ids.txt"], "an image-id map is JSON"),
    (["-o", "{dir}/sis.json.jsonl", "--workers", "0"], "--workers"),
])
def test_bad_options(vist, args, message):
    args = [a.format(dir=vist) for a in args]
    result = invoke(vist / "sis.json", "--image-root", vist / "images", *args)
    assert result.exit_code == 2 and message in result.output


def test_existing_output_needs_overwrite_and_duplicate_ids_are_refused(vist):
    out = vist / "r.jsonl"
    assert invoke(vist / "sis.json", "--image-root", vist / "images", "-o", out, "-q").exit_code == 0
    again = invoke(vist / "sis.json", "--image-root", vist / "images", "-o", out, "-q")
    assert again.exit_code == 1 and "exists: use --overwrite" in again.output
    assert invoke(vist / "sis.json", "--image-root", vist / "images", "-o", out, "-q", "--overwrite").exit_code == 0
    twice = vist / "twice.jsonl"
    twice.write_text('{"story_id": "a", "story": "x", "image_ids": ["1000"]}\n'
                     '{"story_id": "a", "story": "y", "image_ids": ["1001"]}\n')
    result = invoke(twice, "--image-root", vist / "images", "-o", vist / "t.jsonl")
    assert result.exit_code == 1 and "record 'a' at line 2: duplicate story id" in result.output
    paths = vist / "paths.jsonl"
    paths.write_text(json.dumps({"story_id": "a", "story": "x", "images": [str(vist / "images/1000.jpg")]}) + "\n")
    result = invoke(paths, "-o", vist / "p.jsonl", "--image-ids-out", vist / "p.json")
    assert result.exit_code == 1 and "story 'a' of" in result.output and "has no image ids" in result.output
