"""``storyrl pairs``: preference pairs from a reward over story sets (a hand
ranking), from VHED and VIST-Edit (what the loaders give), output safety
and one-line errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.data import StoryRecord
from storyrl.eval.pairs import DEFAULT_PROMPT, metric_pairs
from storyrl.judgements.pairs import vhed_pairs
from storyrl.judgements.vhed import VHED_COLUMNS, load_vhed
from storyrl.judgements.vist_edit import load_vist_edit, vist_edit_pairs
from storyrl.rewards import create_reward

FRESH = "We drove to the coast early. Mia ran into the cold waves. Dad built a tall castle. A wave took half of it."
DULL = "There is a beach. There is a beach. There is a beach. There is a beach."
MID = "We went to the beach. The beach was sunny. We swam at the beach and ate lunch on the sand."


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def story_sets(tmp_path):
    # r1: three distinct stories; r2: the same story in a and b (a tie), c
    # duller; r3 only in a (no pair).
    a = write_jsonl(tmp_path / "a.jsonl", [{"story_id": "r1", "story": MID, "images": ["img/1.jpg"]},
                                           {"story_id": "r2", "story": FRESH}, {"story_id": "r3", "story": FRESH}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"story_id": "r1", "story": FRESH, "images": ["img/1.jpg"]},
                                           {"story_id": "r2", "story": FRESH}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"story_id": "r1", "story": DULL}, {"story_id": "r2", "story": DULL}])
    return a, b, c


def test_metric_pairs_equal_a_hand_ranking(tmp_path, story_sets):
    a, b, c = story_sets
    rep = create_reward("repetition")
    fresh, mid, dull = (float(s) for s in rep.score([FRESH, MID, DULL]))
    assert fresh > mid > dull  # the hand ranking the expectations below rest on
    out = tmp_path / "pairs.jsonl"
    result = run("pairs", a, b, c, "-m", "repetition", "-o", out)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["pairs"] == 3 and summary["reward"] == "repetition"
    assert summary["dropped"] == {"unscorable_stories": 0, "records_with_fewer_than_2_scored_stories": 1,
                                  "tied_pairs": 1, "pairs_at_or_below_min_margin": 0}
    rows = lines(out)
    got = [(r["story_id"], r["chosen"], r["rejected"], r["source"]) for r in rows]
    assert got == [("r1", FRESH, MID, f"repetition: {b} > {a}"), ("r1", FRESH, DULL, f"repetition: {b} > {c}"),
                   ("r2", FRESH, DULL, f"repetition: {a} > {c}")]
    assert [r["margin"] for r in rows] == pytest.approx([fresh - mid, fresh - dull, fresh - dull])
    assert [r["chosen_score"] for r in rows] == pytest.approx([fresh] * 3)
    assert [r["rejected_score"] for r in rows] == pytest.approx([mid, dull, dull])
    assert [r["images"] for r in rows] == [["img/1.jpg"], ["img/1.jpg"], []]
    assert {r["prompt"] for r in rows} == {DEFAULT_PROMPT}

    # --min-margin between the two r1 margins drops the smaller one; --prompt is written
    out2 = tmp_path / "pairs2.jsonl"
    cut = (fresh - mid + fresh - dull) / 2
    result = run("pairs", a, b, c, "-m", "repetition", "-o", out2, "--min-margin", cut, "--prompt", "Tell it.")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip())["dropped"]["pairs_at_or_below_min_margin"] == 1
    assert [(r["chosen"], r["rejected"], r["prompt"]) for r in lines(out2)] == [
        (FRESH, DULL, "Tell it."), (FRESH, DULL, "Tell it.")]


class FixedReward:
    """Scores from a table, NaN for unknown stories."""

    name = "fixed"

    def __init__(self, table):
        self.table = table

    def score(self, stories, **context):
        return np.array([self.table.get(s, math.nan) for s in stories], dtype=float)


def test_metric_pairs_nan_ties_and_equal_best():
    def recs(**stories):
        return [StoryRecord(story_id=k, story=v) for k, v in stories.items()]

    reward = FixedReward({"x1": 2.0, "x2": 2.0, "x3": 1.0, "y1": 1.0, "z1": 0.5, "z3": 0.25})
    sets = [("s1", recs(x="x1", y="y1", z="z1")), ("s2", recs(x="x2", y="yNaN")), ("s3", recs(x="x3", z="z3"))]
    rows, dropped = metric_pairs(sets, reward, min_margin=0.25)
    # x: x1 and x2 tie for best -> x1 (earlier set) is best, x1~x2 a tie, x1>x3 kept;
    # y: y2 unscorable -> one scored story, no pair; z: margin 0.25 is not above 0.25.
    assert [(r["story_id"], r["chosen"], r["rejected"], r["margin"]) for r in rows] == [("x", "x1", "x3", 1.0)]
    assert dict(dropped) == {"unscorable_stories": 1, "records_with_fewer_than_2_scored_stories": 1,
                             "tied_pairs": 1, "pairs_at_or_below_min_margin": 1}
    rows, dropped = metric_pairs(sets, reward)  # min_margin 0 keeps z
    assert [(r["story_id"], r["rejected"]) for r in rows] == [("x", "x3"), ("z", "z3")]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="min_margin"):
            metric_pairs(sets, reward, min_margin=bad)
    with pytest.raises(ValueError, match="at least 2"):
        metric_pairs(sets[:1], reward)


def write_vhed(path: Path) -> Path:
    # columns in VHED_COLUMNS' order: sent1 sent2 label story_id model_base model_comp agreement img_seq
    # avg_rank_base avg_rank_comp order rank_norm
    cells = [
        ("A good story.", "A bad story.", -0.6, "s1", "reference", "kg", 5, "1 2 3", 1.2, 1.8, 5, -0.2),  # story1 better
        ("Plain words.", "Lively words.", 0.4, "s2", "kg", "pr", 2, "4 5", 2.0, 1.6, 5, 0.1),  # story2 better
        ("Same.", "Same too.", 0, "s3", "kg", "pr", 3, "6", 1.5, 1.5, 5, 0),  # zero gap: dropped by the loader
    ]
    rows = [dict(zip(VHED_COLUMNS, row)) for row in cells]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(VHED_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_vhed_pairs_are_the_loaders(tmp_path):
    vhed = write_vhed(tmp_path / "VHED.csv")
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--vhed", vhed, "-o", out)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip())
    assert summary["pairs"] == 2 and summary["dropped"] == {"zero_gap_pairs": 1}
    expected = vhed_pairs(load_vhed(vhed))
    rows = lines(out)
    assert [(r["chosen"], r["rejected"], r["story_id"], r["margin"], r["source"]) for r in rows] == [
        (p.better, p.worse, p.story_id, p.gap, p.source) for p in expected]
    assert [(r["chosen"], r["rejected"], r["margin"]) for r in rows] == [
        ("A good story.", "A bad story.", 0.6), ("Lively words.", "Plain words.", 0.4)]
    assert all(r["chosen_score"] is None and r["rejected_score"] is None and r["images"] == [] for r in rows)


def test_vist_edit_pairs_are_the_loaders(tmp_path):
    root = tmp_path / "vist_edit"
    (root / "AREL" / "dev").mkdir(parents=True)
    (root / "AREL" / "dev" / "1.json").write_text(json.dumps({
        "photo_sequence_id": "seq1", "photo_sequence_ids": ["p1", "p2"], "auto_story_text_normalized": "we went .",
        "model": "AREL", "edited_stories": [
            {"normalized_edited_story_text_sent": ["we went to the lake .", "it was cold ."]},
            {"normalized_edited_story_text_sent": ["we went ."]}]}))
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--vist-edit", root, "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip())["pairs"] == 2
    expected = vist_edit_pairs(load_vist_edit(root))
    rows = lines(out)
    assert [(r["chosen"], r["rejected"], r["story_id"], r["source"]) for r in rows] == [
        (p.better, p.worse, p.story_id, p.source) for p in expected]
    assert [r["chosen"] for r in rows] == ["we went to the lake . it was cold .", "we went ."]
    assert all(r["rejected"] == "we went ." and r["margin"] is None for r in rows)


def test_existing_output_needs_overwrite(tmp_path):
    vhed = write_vhed(tmp_path / "VHED.csv")
    out = tmp_path / "p.jsonl"
    out.write_text("keep me\n")
    result = run("pairs", "--vhed", vhed, "-o", out)
    assert result.exit_code != 0 and "exists" in result.output and "--overwrite" in result.output
    assert out.read_text() == "keep me\n"
    result = run("pairs", "--vhed", vhed, "-o", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert len(lines(out)) == 2


@pytest.mark.parametrize("extra, message", [
    ([], "exactly one source"),
    (["--vhed", "{vhed}", "{a}", "{b}", "-m", "repetition"], "exactly one source"),
    (["--vhed", "{vhed}", "-m", "repetition"], "come from people"),
    (["{a}", "-m", "repetition"], "two or more STORIES"),
    (["{a}", "{b}"], "exactly one reward"),
    (["{a}", "{b}", "-m", "repetition,length"], "exactly one reward"),
    (["{a}", "{a}", "-m", "repetition"], "given twice"),
    (["{a}", "{b}", "-m", "no_such_reward"], "no_such_reward"),
    (["{a}", "{b}", "-m", "repetition", "--min-margin", "-1"], "--min-margin"),
])
def test_bad_options_are_one_line_errors(tmp_path, story_sets, extra, message):
    a, b, _ = story_sets
    vhed = write_vhed(tmp_path / "VHED.csv")
    args = [x.format(a=a, b=b, vhed=vhed) for x in extra]
    out = tmp_path / "p.jsonl"
    result = run("pairs", *args, "-o", out)
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and message in error[0], result.output
    assert not out.exists()


def test_out_must_be_jsonl(tmp_path, story_sets):
    a, b, _ = story_sets
    result = run("pairs", a, b, "-m", "repetition", "-o", tmp_path / "p.csv")
    assert result.exit_code == 2 and "*.jsonl" in result.output
