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
