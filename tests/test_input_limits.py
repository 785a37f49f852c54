"""Inputs at the edges (issue 21, item 6): a byte-order mark (Excel) at the
start of a CSV/TSV/JSON/JSONL is read like the same file without it; JSON
nested too deeply, a number too long for Python, a CSV/TSV field over the
csv module's limit and a YAML whose aliases expand without bound are one-line
errors naming the file (and record), never a traceback or exhausted memory."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.config import ConfigFileError, load_yaml
from storyrl.data import StoryDataError, load_stories, read_scores
from storyrl.datasets import load_records, load_vwp
from storyrl.judgements import JudgementDataError
from storyrl.judgements.pairs import load_pairs_jsonl
from storyrl.judgements.raccoon import REQUIRED_COLUMNS, load_raccoon
from storyrl.judgements.ratings import load_ratings
from storyrl.judgements.vhed import VHED_COLUMNS, load_vhed
from storyrl.judgements.vist_edit import load_vist_edit

BOM = "\ufeff"
DIGITS = sys.get_int_max_str_digits() + 700  # 5,000 with Python's default limit


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


# -- inputs: text of each reader, and what to compare ---------------------------

def _vhed_text():
    row = {"sent1": "we went to the park . it was fun .", "sent2": "the dog ran . the dog ran .", "label": "-0.4", "story_id": "s1",
           "model_base": "reference", "model_comp": "KGStory", "agreement": "4", "img_seq": "1 2 3 4 5",
           "avg_rank_base": "0.2", "avg_rank_comp": "0.6", "order": "5", "rank_norm": "-0.1"}
    return ",".join(VHED_COLUMNS) + "\n" + ",".join(row[c] for c in VHED_COLUMNS) + "\n"


def _raccoon_text():
    row = {c: "0" for c in REQUIRED_COLUMNS}
    row.update(id_annotation="1", id_annotator="2", caption="a dog", url="http://x/a.jpg", source="True1",
               cbVisible5="1")
    return "\t".join(REQUIRED_COLUMNS) + "\n" + "\t".join(row[c] for c in REQUIRED_COLUMNS) + "\n"


def _vist_edit(root, text):
    folder = root / "AREL" / "dev"
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(text, encoding="utf-8")
    return root


VIST_EDIT = json.dumps({"photo_sequence_id": "1", "photo_sequence_ids": ["p1", "p2"],
                        "auto_story_text_normalized": "the car .", "data_split": "dev", "model": "AREL",
                        "edited_stories": [{"worker_id": "w", "edited_story_text": "x",
                                            "normalized_edited_story_text_sent": ["we drove ."]}]})

READERS = {
    # name: (file name, text, load(path) -> a comparable value)
    "stories-jsonl": ("s.jsonl", '{"story_id": "a", "story": "one"}\n{"story_id": "b", "story": "two"}\n',
                      lambda p: load_stories(p)),
    "stories-json": ("s.json", '{"a": "one", "b": "two"}', lambda p: load_stories(p)),
    "records-auto": ("r.jsonl", '{"story_id": "a", "story": "one", "images": ["x.jpg"]}\n',
                     lambda p: load_records(p)),
    "vist-sis": ("sis.json", json.dumps({"annotations": [[{"story_id": "1", "photo_flickr_id": "p",
                                                           "worker_arranged_photo_order": 0, "text": "hi"}]]}),
                 lambda p: load_records(p)),
    "vwp": ("v.csv", "scene_full_id,story,link0\nsc1,a story,http://x/1.jpg\n", lambda p: load_vwp(p)),
    "scores-csv": ("sc.csv", "story_id,R_score,C_score\na,0.5,\nb,1,2\n", lambda p: read_scores(p).scores),
    "scores-json": ("sc.json", '{"a": 0.5, "b": null}', lambda p: repr(read_scores(p, "groovist").scores)),
    "vhed": ("VHED.csv", _vhed_text(), lambda p: [(x.story1, x.story2, x.gap) for x in load_vhed(p).pairs]),
    "ratings": ("r.csv", "story_id,workerId,focused\ns1,w1,4\ns1,w2,5\n",
                lambda p: load_ratings(p, aspects=["focused"]).story_means("focused")),
    "pairs-jsonl": ("p.jsonl", '{"better": "a good story", "worse": "a bad one"}\n',
                    lambda p: [(x.better, x.worse) for x in load_pairs_jsonl(p)]),
    "raccoon-tsv": ("R.tsv", _raccoon_text(), lambda p: [(r.caption, r.url) for r in load_raccoon(p).records]),
}


@pytest.mark.parametrize("name", list(READERS))
def test_a_byte_order_mark_is_read_like_the_file_without_it(tmp_path, name):
    filename, text, load = READERS[name]
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    plain.mkdir(), marked.mkdir()
    (plain / filename).write_text(text, encoding="utf-8")
    (marked / filename).write_text(BOM + text, encoding="utf-8")
    assert load(marked / filename) == load(plain / filename)


def test_a_byte_order_mark_vist_edit(tmp_path):
    plain = load_vist_edit(_vist_edit(tmp_path / "plain", VIST_EDIT))
    marked = load_vist_edit(_vist_edit(tmp_path / "marked", BOM + VIST_EDIT))
    assert [(s.machine, s.edits) for s in marked.stories] == [(s.machine, s.edits) for s in plain.stories]


def test_a_byte_order_mark_vhed_through_the_cli(tmp_path):
    """The reported case: VHED from Excel said "missing column(s) sent1"."""
    path = tmp_path / "VHED.csv"
    path.write_text(BOM + _vhed_text(), encoding="utf-8")
    result = run("meta-eval", "pairs", "--vhed", path, "-m", "repetition", "--out", tmp_path / "o.csv", "-q")
    assert result.exit_code == 0, result.output
    assert "missing column" not in result.output


def test_a_byte_order_mark_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BOM + "a: 1\n", encoding="utf-8")
    assert load_yaml(path) == {"a": 1}


# -- JSON past Python's limits --------------------------------------------------

def _deep(n=100_000):
    return "[" * n + "]" * n


@pytest.mark.parametrize("fault, value, message", [
    ("deep", _deep(), "nested too deeply"),
    ("digits", "1" * DIGITS, f"more than {sys.get_int_max_str_digits()} digits"),
])
def test_json_past_pythons_limits_is_one_line_through_the_cli(tmp_path, fault, value, message):
    stories = tmp_path / "s.jsonl"
    stories.write_text('{"story_id": "a", "story": "one"}\n'
                       f'{{"story_id": "b", "story": "two", "x": {value}}}\n', encoding="utf-8")
    line = one_error_line(run("score", stories, "-m", "repetition", "-o", tmp_path / "o.csv", "-q"))
    assert line.startswith(f"Error: {stories}: record at line 2: invalid JSON: ") and message in line
    assert "RecursionError" not in line and "Exceeds the limit" not in line


@pytest.mark.parametrize("fault, value, message", [
    ("deep", _deep(), "nested too deeply"),
    ("digits", "1" * DIGITS, f"more than {sys.get_int_max_str_digits()} digits"),
])
def test_json_past_pythons_limits_every_reader(tmp_path, fault, value, message):
    whole = tmp_path / "s.json"
    whole.write_text('{"a": "one",\n "b": ' + value + "}", encoding="utf-8")
    with pytest.raises(StoryDataError, match=f"s.json: invalid JSON at line 2 column .*{message}"):
        load_stories(whole)
    scores = tmp_path / "g.json"
    scores.write_text('{"a": ' + value + "}", encoding="utf-8")
    with pytest.raises(StoryDataError, match=f"g.json: cannot read: .*{message}"):
        read_scores(scores, "groovist")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"better": "a", "worse": "b"}\n{"better": ' + value + "}\n", encoding="utf-8")
    with pytest.raises(JudgementDataError, match=f"p.jsonl: line 2: invalid JSON: .*{message}"):
        load_pairs_jsonl(pairs)
    with pytest.raises(JudgementDataError, match=f"1.json: invalid JSON at line 1: .*{message}"):
        load_vist_edit(_vist_edit(tmp_path / "ve", '{"model": ' + value + "}"))
    sis = tmp_path / "sis.json"
    sis.write_text('{"annotations": [], "x": ' + value + "}", encoding="utf-8")
    with pytest.raises(StoryDataError, match=f"sis.json: .*{message}"):
        load_records(sis, "vist-sis")


# -- a field over the csv module's limit ----------------------------------------

def test_a_huge_tsv_field_is_one_line_naming_file_and_row(tmp_path):
    path = tmp_path / "R.tsv"
    text = _raccoon_text()
    path.write_text(text + text.splitlines()[1].replace("a dog", "x" * 200_000) + "\n", encoding="utf-8")
    with pytest.raises(JudgementDataError) as info:
        load_raccoon(path)
    message = str(info.value)
    assert message == f"R.tsv: row 2: malformed TSV: a field longer than {csv.field_size_limit():,} characters " \
                      "(the csv module's limit)"


@pytest.mark.parametrize("name", ["vhed", "ratings", "scores-csv", "vwp"])
def test_a_huge_csv_field_names_file_and_line(tmp_path, name):
    filename, text, load = READERS[name]
    path = tmp_path / filename
    lines = text.splitlines()
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + "y" * 200_000 + "," + lines[1] + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "line 3" in message and "a field longer than" in message


# -- YAML -------------------------------------------------------------------------

def _alias_bomb():
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for k in range(1, 9):
        prev, cur = chr(ord("a") + k - 1), chr(ord("a") + k)
        lines.append(f"{cur}: &{cur} [{','.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text, message", [
    (_alias_bomb(), "refused: its aliases expand to more than 100,000 values"),
    ("a: &a [*a]\n", "refused: an alias refers to a node that contains it"),
    ("a: " + _deep(5000) + "\n", "invalid YAML: nested too deeply"),
    ("a: 1\nb: " + "1" * DIGITS + "\n", f"invalid YAML at line 2: a number with more than "
                                        f"{sys.get_int_max_str_digits()} digits"),
])
def test_yaml_past_the_limits_is_one_line(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigFileError) as info:
        load_yaml(path)
    assert str(info.value) == f"{path}: {message}"


def test_yaml_alias_bomb_through_the_cli(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text(_alias_bomb(), encoding="utf-8")
    assert len(path.read_bytes()) < 500
    line = one_error_line(run("train", "rl", "--config", path, "-q"))
    assert line == f"Error: {path}: refused: its aliases expand to more than 100,000 values"


def test_yaml_aliases_within_the_bound_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 0.1, steps: [1, 2]}\nrun: {<<: *b, steps: [3]}\nother: *b\n", encoding="utf-8")
    assert load_yaml(path) == {"base": {"lr": 0.1, "steps": [1, 2]}, "run": {"lr": 0.1, "steps": [3]},
                               "other": {"lr": 0.1, "steps": [1, 2]}}


def test_a_large_yaml_without_aliases_is_not_refused(tmp_path):
    # The bound counts only what aliases add beyond the document's own values.
    path = tmp_path / "big.yaml"
    path.write_text("values: [" + ",".join(["1"] * 120_000) + "]\n", encoding="utf-8")
    assert len(load_yaml(path)["values"]) == 120_000


def test_json_errors_point_at_the_fault_past_escaped_quotes_and_legal_long_numbers():
    from storyrl.input_text import json_loads

    limit = sys.get_int_max_str_digits()
    deep = "[" * 100_000 + "]" * 100_000
    text = '{"a": "x\\"[[[", "b": ' + deep + "}"
    with pytest.raises(json.JSONDecodeError) as info:
        json_loads(text)
    # where the nesting first reaches its greatest depth: the last "[" of b's run,
    # not shifted by the brackets inside the string
    assert info.value.pos == text.index('"b": ') + len('"b": ') + 100_000 - 1
    legal = "9" * limit
    text = '{"a": ' + legal + ', "b": ' + "1" * DIGITS + "}"
    with pytest.raises(json.JSONDecodeError) as info:
        json_loads(text)
    assert info.value.pos == text.index(", \"b\"") + len(', "b": ')
