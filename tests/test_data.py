"""Story-set and score-table I/O: formats, dataset loaders, malformed input."""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO, shared_path
from storyrl.datasets import load_vist_sis, load_vwp
from storyrl.data import (
    ScoreWriter,
    StoryDataError,
    StoryRecord,
    load_stories,
    read_scores,
    save_stories,
    write_scores,
)


def test_json_object_story_set():
    records = load_stories(shared_path("dhm", "vwp", "gt_test.json"))
    assert len(records) == 586
    assert records[0].story_id == "tt0104348_0007_6;2"
    assert records[0].story.startswith("[male0] was at his desk")


def test_jsonl_roundtrip(tmp_path):
    records = [
        StoryRecord("a", "One. Two.", images=["x.png"], image_ids=["1"], reference="Ref."),
        StoryRecord("b", "Three."),
    ]
    save_stories(records, tmp_path / "s.jsonl")
    assert load_stories(tmp_path / "s.jsonl") == records
    save_stories(records, tmp_path / "s.json")
    assert [(r.story_id, r.story) for r in load_stories(tmp_path / "s.json")] == [("a", "One. Two."), ("b", "Three.")]


def test_bundled_examples_load():
    for name in ("human", "model_a", "model_b"):
        records = load_stories(REPO / "examples" / f"{name}.jsonl")
        assert len(records) == 6 and all(len(r.image_ids) == 5 for r in records)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.json", '{"a": "x",', "invalid JSON at line 1"),
        ("dup.json", '{"a": "x", "a": "y"}', "record 'a': duplicate story id"),
        ("list.json", '["x"]', "expected a JSON object"),
        ("nonstr.json", '{"a": 3}', "record 'a': story must be a string, got int"),
        ("bad.jsonl", '{"story_id": "a", "story": "x"}\n{oops\n', "record at line 2: invalid JSON"),
        ("missing.jsonl", '{"story_id": "a"}\n', "record at line 1: missing field 'story'"),
        ("null.jsonl", '{"story_id": "a", "story": null}\n', "record 'a' at line 1: story must be a string, got NoneType"),
        ("dup.jsonl", '{"story_id": "a", "story": "x"}\n\n{"story_id": "a", "story": "y"}\n', "duplicate story id (first at line 1)"),
        ("imgs.jsonl", '{"story_id": "a", "story": "x", "images": "one.png"}\n', "'images' must be a list"),
    ],
)
def test_malformed_story_files_name_file_record_problem(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(StoryDataError) as info:
        load_stories(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_score_csv_roundtrip_with_unscorable(tmp_path):
    path = tmp_path / "scores.csv"
    write_scores(path, ["a", "b"], {"repetition": [0.5, math.nan], "coherence": [1.0, 0.25]})
    assert path.read_text().splitlines() == ["story_id,repetition,coherence", "a,0.5,1.0", "b,,0.25"]
    table = read_scores(path)
    assert table.ids == ["a", "b"] and table.scores["coherence"] == {"a": 1.0, "b": 0.25}
    assert math.isnan(table.scores["repetition"]["b"])


def test_authors_score_files_and_aliases():
    table = read_scores(shared_path("dhm", "vwp", "gt_test_R.csv"))
    assert table.metrics == ["repetition"] and len(table.ids) == 586
    g = read_scores(shared_path("dhm", "vwp", "gt_test_G.json"), "groovist")
    assert g.scores["groovist"]["tt0104348_0007_6;2"] == pytest.approx(0.999023973941803)
    with pytest.raises(StoryDataError, match="needs a metric name"):
        read_scores(shared_path("dhm", "vwp", "gt_test_G.json"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("id,x\na,1\n", "needs a header with a 'story_id' column"),
        ("story_id,x\na,1\na,2\n", "record 'a' at line 3: duplicate story id"),
        ("story_id,x\na,abc\n", "record 'a' at line 2: x: not a number: 'abc'"),
        ("story_id,x\na,1,2\n", "record at line 2: expected 2 cells, got 3"),
    ],
)
def test_malformed_score_csv(tmp_path, content, message):
    path = tmp_path / "s.csv"
    path.write_text(content)
    with pytest.raises(StoryDataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_scores(path)


def test_score_writer_resume_drops_partial_line(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("story_id,repetition\na,0.5\nb,0.7\nc,0.")  # killed mid-row
    with ScoreWriter(path, ["repetition"], resume=True) as writer:
        assert writer.done == {"a", "b"}
        writer.write(["c"], {"repetition": [0.25]})
    assert read_scores(path).scores["repetition"] == {"a": 0.5, "b": 0.7, "c": 0.25}
    with pytest.raises(StoryDataError, match="cannot resume"):
        ScoreWriter(path, ["coherence"], resume=True)


def test_vist_sis_loader(tmp_path):
    annotations = [
        [{"story_id": "7", "photo_flickr_id": f"p{k}", "worker_arranged_photo_order": k, "text": f"line {k} ."}]
        for k in (2, 0, 4, 1, 3)
    ] + [[{"story_id": "8", "photo_flickr_id": "q", "worker_arranged_photo_order": 0, "text": "solo ."}]]
    path = tmp_path / "test.story-in-sequence.json"
    path.write_text(json.dumps({"annotations": annotations, "images": [], "albums": []}))
    records = load_vist_sis(path)
    assert records[0] == StoryRecord(
        "7", "line 0 . line 1 . line 2 . line 3 . line 4 .", image_ids=["p0", "p1", "p2", "p3", "p4"]
    )
    assert records[1].story_id == "8"
    path.write_text(json.dumps({"annotations": [[{"story_id": "7", "text": "x"}]]}))
    with pytest.raises(StoryDataError, match=r"annotations\[0\]: missing field 'photo_flickr_id'"):
        load_vist_sis(path)


def test_vwp_loader(tmp_path):
    path = tmp_path / "vwp_test.csv"
    header = "scene_full_id,story,link0,link1,link2,select_imgs_list\n"
    path.write_text(
        header
        + 'tt01_0002,"[male0] sat. he left.",http://a/0.jpg,http://a/1.jpg,,"[\'3\', \'5\']"\n'
        + "tt01_0002,second story.,http://a/0.jpg,,,\n"
        + "tt02_0001,other.,http://b/0.jpg,,,\n"
    )
    records = load_vwp(path)
    assert [r.story_id for r in records] == ["tt01_0002;0", "tt01_0002;1", "tt02_0001;0"]
    assert records[0].images == ["http://a/0.jpg", "http://a/1.jpg"] and records[0].image_ids == ["3", "5"]
    assert records[1].image_ids is None
    (tmp_path / "bad.csv").write_text("id,story\n1,x\n")
    with pytest.raises(StoryDataError, match="not a VWP split"):
        load_vwp(tmp_path / "bad.csv")
