"""Human-judgement loaders: VHED CSV, VIST-Edit folders, ratings CSV, JSONL
pairs — row validation with one-line errors and the paper's reading rules."""

from __future__ import annotations

import csv
import json

import pytest

import storyrl  # noqa: F401  (before any heavy import, as the other tests)
from storyrl.judgements import JudgementDataError
from storyrl.judgements.vhed import VHED_COLUMNS, is_reference_model, load_vhed

# -- VHED ---------------------------------------------------------------------

def vhed_row(**overrides):
    row = {
        "sent1": "we went to the park . it was fun .",
        "sent2": "the dog ran . the dog ran .",
        "label": "-0.4",
        "story_id": "s1",
        "model_base": "reference",
        "model_comp": "KGStory",
        "agreement": "4",
        "img_seq": "1 2 3 4 5",
        "avg_rank_base": "0.2",
        "avg_rank_comp": "0.6",
        "order": "5",
        "rank_norm": "-0.1",
    }
    row.update(overrides)
    return row


def write_vhed(path, rows, columns=("",) + VHED_COLUMNS):
    # a leading unnamed index column, as pandas writes it: must be ignored
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for i, row in enumerate(rows):
            writer.writerow([str(i) if c == "" else row.get(c, "") for c in columns])
    return path


def test_vhed_reads_pairs_and_fields(tmp_path):
    path = write_vhed(tmp_path / "VHED.csv", [
        vhed_row(),
        vhed_row(sent1="a b c .", sent2="d e\nf .", label="0.25", model_base="AREL", model_comp="GLAC",
                 agreement="5", avg_rank_base="0.75", avg_rank_comp="0.5", order="4", rank_norm="0.06"),
    ])
    data = load_vhed(path)
    assert data.rows == 2 and data.zero_gap_dropped == 0 and data.path == path
    first, second = data.pairs
    assert (first.story1, first.gap, first.agreement, first.model1, first.model2) == (
        "we went to the park . it was fun .", -0.4, 4, "reference", "KGStory")
    assert (first.avg_rank1, first.avg_rank2, first.rankers, first.rank_norm) == (0.2, 0.6, 5, -0.1)
    assert (first.row, second.row) == (1, 2)
    assert second.story2 == "d e\nf ." and second.agreement == 5 and second.rankers == 4
    # story1 is better iff the gap is negative (lower rank = better)
    assert first.better == first.story1 and second.better == second.story2


def test_vhed_agreement_two_reads_as_three(tmp_path):
    data = load_vhed(write_vhed(tmp_path / "v.csv", [vhed_row(agreement="2"), vhed_row(agreement="3")]))
    assert [p.agreement for p in data.pairs] == [3, 3]


def test_vhed_zero_gap_dropped_and_counted(tmp_path):
    path = write_vhed(tmp_path / "v.csv", [vhed_row(label="0"), vhed_row(), vhed_row(label="0.0")])
    data = load_vhed(path)
    assert len(data.pairs) == 1 and data.zero_gap_dropped == 2 and data.rows == 3
    assert data.pairs[0].row == 2
    kept = load_vhed(path, drop_zero_gap=False)
    assert len(kept.pairs) == 3 and kept.zero_gap_dropped == 0


@pytest.mark.parametrize("overrides, message", [
    ({"label": "abc"}, "v.csv: row 2: column 'label': 'abc' is not a number"),
    ({"rank_norm": ""}, "v.csv: row 2: column 'rank_norm': '' is not a number"),
    ({"avg_rank_comp": "nan"}, "v.csv: row 2: column 'avg_rank_comp': 'nan' is not a finite number"),
    ({"agreement": "6"}, "v.csv: row 2: column 'agreement': 6 is outside 2..5"),
    ({"agreement": "1"}, "v.csv: row 2: column 'agreement': 1 is outside 2..5"),
    ({"agreement": "4.5"}, "v.csv: row 2: column 'agreement': '4.5' is not a whole number"),
    ({"order": "0"}, "v.csv: row 2: column 'order': 0 rankers"),
    ({"sent2": "  "}, "v.csv: row 2: column 'sent2' is empty"),
    ({"sent1": ""}, "v.csv: row 2: column 'sent1' is empty"),
])
def test_vhed_row_errors_are_one_line(tmp_path, overrides, message):
    path = write_vhed(tmp_path / "v.csv", [vhed_row(), vhed_row(**overrides)])
    with pytest.raises(JudgementDataError) as info:
        load_vhed(path)
    text = str(info.value)
    assert message in text and "\n" not in text and text.startswith(str(path))


def test_vhed_header_and_file_errors(tmp_path):
    columns = tuple(c for c in VHED_COLUMNS if c not in ("label", "order"))
    path = write_vhed(tmp_path / "v.csv", [vhed_row()], columns=columns)
    with pytest.raises(JudgementDataError, match=r"v.csv: header: missing column\(s\) label, order$"):
        load_vhed(path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(JudgementDataError, match="empty.csv: empty file"):
        load_vhed(empty)
    with pytest.raises(JudgementDataError, match="nope.csv: cannot read"):
        load_vhed(tmp_path / "nope.csv")
    short = tmp_path / "short.csv"
    short.write_text(",".join(VHED_COLUMNS) + "\na,b,-1\n")
    with pytest.raises(JudgementDataError, match="short.csv: row 1: too few cells"):
        load_vhed(short)
    long = tmp_path / "long.csv"
    long.write_text(",".join(VHED_COLUMNS) + "\n" + ",".join(["1"] * (len(VHED_COLUMNS) + 2)) + "\n")
    with pytest.raises(JudgementDataError, match="long.csv: row 1: 2 cell"):
        load_vhed(long)


def test_is_reference_model():
    assert is_reference_model("Reference") and is_reference_model(" human ") and is_reference_model("GT")
    assert not is_reference_model("KGStory") and not is_reference_model("AREL")
    assert is_reference_model("gold_story", names=["gold_story"]) and not is_reference_model("human", names=["x"])


# -- VIST-Edit ----------------------------------------------------------------

from storyrl.judgements.pairs import load_pairs_jsonl  # noqa: E402
from storyrl.judgements.ratings import load_ratings, parse_where  # noqa: E402
from storyrl.judgements.vist_edit import load_vist_edit, vist_edit_pairs  # noqa: E402


def vist_file(root, model, split, name, machine="the car . the car .", edits=(["we drove .", "it was fun ."],), extra=None):
    folder = root / model / split
    folder.mkdir(parents=True, exist_ok=True)
    obj = {"photo_sequence_id": name, "photo_sequence_ids": ["p1", "p2"], "auto_story_text_normalized": machine,
           "edited_stories": [{"worker_id": "w", "edited_story_text": "x", "normalized_edited_story_text_sent": e}
                              for e in edits], "data_split": split, "model": model, **(extra or {})}
    (folder / f"{name}.json").write_text(json.dumps(obj))


def test_vist_edit_pairs_every_edit_of_every_split(tmp_path):
    vist_file(tmp_path, "AREL", "train", "1", edits=(["a b .", " c d . "], ["the car .", "the car ."]))
    vist_file(tmp_path, "AREL", "test", "2")
    vist_file(tmp_path, "GLAC", "dev", "3", machine="x y .", edits=(["x  y ."],))
    data = load_vist_edit(tmp_path)
    assert data.files == {"AREL": 2, "GLAC": 1} and data.identical == 2
    pairs = vist_edit_pairs(data)
    assert [(p.better, p.worse, p.subsets) for p in pairs] == [
        ("a b . c d .", "the car . the car .", ("AREL-edit",)),
        ("the car . the car .", "the car . the car .", ("AREL-edit",)),  # identical edit kept: a tie
        ("we drove . it was fun .", "the car . the car .", ("AREL-edit",)),
        ("x  y .", "x y .", ("GLAC-edit",)),  # sentences joined as they are; identical up to spaces
    ]
    assert pairs[0].story_id == "1" and pairs[0].image_ids == ("p1", "p2")


@pytest.mark.parametrize("extra, message", [
    ({"model": "GLAC"}, "'model' is 'GLAC' but the file is under AREL/"),
    ({"auto_story_text_normalized": ""}, "'auto_story_text_normalized' must be a non-empty string"),
    ({"edited_stories": {}}, "'edited_stories' must be a list"),
    ({"edited_stories": [{"normalized_edited_story_text_sent": "a ."}]},
     "edited_stories[1]: 'normalized_edited_story_text_sent' must be a non-empty list of strings"),
])
def test_vist_edit_errors(tmp_path, extra, message):
    vist_file(tmp_path, "AREL", "dev", "1", extra=extra)
    with pytest.raises(JudgementDataError) as info:
        load_vist_edit(tmp_path)
    assert message in str(info.value) and "1.json" in str(info.value) and "\n" not in str(info.value)


def test_vist_edit_layout_errors(tmp_path):
    with pytest.raises(JudgementDataError, match="no AREL/ or GLAC/ folder"):
        load_vist_edit(tmp_path)
    (tmp_path / "GLAC" / "dev").mkdir(parents=True)
    with pytest.raises(JudgementDataError, match="GLAC: no train"):
        load_vist_edit(tmp_path)
    (tmp_path / "GLAC" / "dev" / "x.json").write_text("{nope")
    with pytest.raises(JudgementDataError, match=r"x.json: invalid JSON at line 1"):
        load_vist_edit(tmp_path)


# -- ratings --------------------------------------------------------------------

HEADER = "team,story_id,album_id,workerId,focused,coherent,share,human,grounded,detailed,,,,,,"


def test_ratings_human_eval_layout(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text(HEADER + "\n"
                    "auto-gen,s1,9,w1,5,4,3,2,1,5,,,,,,\n"
                    "auto-gen,s1,9,w2,4,4,3,2,1,4,,,,,,\n"
                    "human,s2,9,w1,1,1,1,1,1,1,,,,,,\n"
                    "auto-gen,s3,9,w3,2,2,2,2,2,2\n")  # trailing empty cells cut: fine
    ratings = load_ratings(path, where={"team": "auto-gen"})
    assert ratings.story_ids == ["s1", "s3"] and ratings.rows == 4 and ratings.kept == 3
    assert ratings.story_means("focused") == {"s1": 4.5, "s3": 2.0}
    assert ratings.raters["s1"] == ["w1", "w2"] and not ratings.systems
    with_system = load_ratings(path, system_column="team", aspects=["share"])
    assert with_system.systems == {"s1": "auto-gen", "s2": "human", "s3": "auto-gen"}
    assert parse_where(["team=auto-gen", " a = b "]) == {"team": "auto-gen", "a": "b"}
    with pytest.raises(ValueError, match="COLUMN=VALUE"):
        parse_where(["team"])


@pytest.mark.parametrize("row, message", [
    ("auto-gen,s1,9,w1,6,4,3,2,1,5", "row 1: column 'focused': '6' is outside 1..5"),
    ("auto-gen,s1,9,w1,x,4,3,2,1,5", "row 1: column 'focused': 'x' is not a number"),
    ("auto-gen,s1,9,w1,1,4,3,2,1,", "row 1: column 'detailed': '' is not a number"),
    ("auto-gen,,9,w1,1,4,3,2,1,5", "row 1: column 'story_id' is empty"),
    ("auto-gen,s1,9,w1,1,4,3,2,1,5,,,,,,,7", "row 1: 17 cells for 16 columns"),
])
def test_ratings_row_errors(tmp_path, row, message):
    path = tmp_path / "r.csv"
    path.write_text(HEADER + "\n" + row + "\n")
    with pytest.raises(JudgementDataError) as info:
        load_ratings(path)
    assert str(info.value) == f"{path}: {message}"


def test_ratings_header_and_system_errors(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text(HEADER + "\nA,s1,9,w1,1,1,1,1,1,1\nB,s1,9,w2,1,1,1,1,1,1\n")
    with pytest.raises(JudgementDataError, match="row 2: story 's1' is rated as system 'B' here and 'A' before"):
        load_ratings(path, system_column="team")
    with pytest.raises(JudgementDataError, match=r"header: missing column\(s\) rater, clarity"):
        load_ratings(path, rater_column="rater", aspects=["focused", "clarity"])
    with pytest.raises(JudgementDataError, match="no rating rows matching team=C"):
        load_ratings(path, where={"team": "C"})


# -- JSONL pairs ------------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ('{"worse": "b"}', "line 1: missing field 'better'"),
    ('{"better": "a", "worse": 3}', "line 1: 'worse' must be a non-empty string"),
    ('{"better": "a", "worse": "b", "subsets": "x"}', "line 1: 'subsets' must be a list of strings"),
    ('{"better": "a", "worse": "b", "subsets": ["x"], "subset": "y"}', "line 1: give 'subsets' or 'subset'"),
    ('{"better": "a", "worse": "b", "subset": "all"}', "line 1: subset 'all' is implicit"),
    ('{"better": "a", "worse": "b", "gap": "big"}', "line 1: 'gap' must be a finite number"),
    ('{"better": "a", "worse": "b", "references": [1]}', "line 1: 'references' must be a list of strings"),
    ('[1]', "line 1: a pair must be a JSON object"),
    ('{"better": ', "line 1: invalid JSON"),
])
def test_pairs_jsonl_errors(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(JudgementDataError) as info:
        load_pairs_jsonl(path)
    assert str(info.value).startswith(f"{path}: {message}") and "\n" not in str(info.value)
    path.write_text("\n")
    with pytest.raises(JudgementDataError, match="no pairs"):
        load_pairs_jsonl(path)
