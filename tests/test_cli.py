"""The storyrl command line, run as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from conftest import REPO, shared_path
from storyrl.cli import main
from storyrl.data import read_scores


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result


def test_score_writes_table_and_summary(tmp_path):
    out = tmp_path / "scores.csv"
    result = run("score", REPO / "examples" / "model_a.jsonl", "--metrics", "repetition", "--out", out, "-q")
    assert result.exit_code == 0, result.output
    table = read_scores(out)
    assert table.metrics == ["repetition"] and len(table.ids) == 6
    assert "unscorable" in result.output and "repetition" in result.output


def test_score_with_config_file(tmp_path):
    out = tmp_path / "scores.csv"
    result = run(
        "score", REPO / "examples" / "human.jsonl", "--config", REPO / "configs" / "rewards" / "repetition.yaml", "-o", out, "-q"
    )
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("story_id,repetition\n")


def test_resume_skips_scored_ids(tmp_path):
    stories = tmp_path / "s.json"
    stories.write_text(json.dumps({"a": "A dog ran. A cat sat.", "b": "Only one.", "c": "X y. Y x."}))
    out = tmp_path / "o.csv"
    out.write_text("story_id,repetition\na,0.123\n")  # an interrupted earlier run
    result = run("score", stories, "-m", "repetition", "-o", out, "--resume", "-q")
    assert result.exit_code == 0, result.output
    table = read_scores(out)
    assert table.ids == ["a", "b", "c"] and table.scores["repetition"]["a"] == 0.123
    assert "1 of 3 stories already scored" in result.output
    # without --resume an existing table is never silently replaced
    refused = run("score", stories, "-m", "repetition", "-o", out, "-q")
    assert refused.exit_code != 0 and "--resume" in refused.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["-m", "nope"], "unknown reward 'nope'"),
        ([], "choose at least one metric"),
    ],
)
def test_score_errors(tmp_path, args, message):
    result = run("score", REPO / "examples" / "human.jsonl", *args, "-o", tmp_path / "o.csv")
    assert result.exit_code != 0 and message in result.output


def test_malformed_story_file_is_reported(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"story_id": "a", "story": 1}\n')
    result = run("score", bad, "-m", "repetition", "-o", tmp_path / "o.csv")
    assert result.exit_code != 0 and str(bad) in result.output and "story must be a string" in result.output


def test_dhm_published_vwp_figures(tmp_path):
    d = shared_path("dhm", "vwp")
    per_story = tmp_path / "per_story.csv"
    result = run(
        "dhm",
        "--human", f"groovist={d / 'gt_test_G.json'}", "--human", d / "gt_test_C.csv", "--human", d / "gt_test_R.csv",
        "--model", f"groovist={d / 'llava_vc_p3_G.json'}", "--model", d / "llava_vc_p3_C.csv", "--model", d / "llava_vc_p3_R.csv",
        "--metrics", "groovist,coherence,repetition", "--per-story", per_story,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert list(summary) == ["n", "grounding", "coherence", "repetition", "d_hm"]
    assert summary["n"] == 586
    assert [round(summary[k], 4) for k in ("grounding", "coherence", "repetition", "d_hm")] == [0.2295, 0.2145, 0.0948, 0.1796]
    assert len(read_scores(per_story).ids) == 586


def test_dhm_selected_dimension_only(tmp_path):
    d = shared_path("dhm", "vwp")
    result = run("dhm", "--human", d / "gt_test_R.csv", "--model", d / "llava_vc_p3_R.csv", "--metrics", "repetition")
    assert json.loads(result.output) == {"n": 586, "repetition": pytest.approx(0.0948, abs=5e-5), "d_hm": pytest.approx(0.0948, abs=5e-5)}


def test_help_and_repetition_do_not_import_torch(tmp_path):
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from storyrl.cli import main\n"
        "r = CliRunner().invoke(main, ['--help'])\n"
        "assert r.exit_code == 0\n"
        f"r = CliRunner().invoke(main, ['score', {str(REPO / 'examples' / 'human.jsonl')!r}, '-m', 'repetition', '-o', {str(tmp_path / 'o.csv')!r}, '-q'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = [m for m in ('torch', 'transformers', 'open_clip', 'spacy', 'torchvision') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_console_script_help_is_fast():
    import time

    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "storyrl.cli", "--help"], check=True, capture_output=True)
    # generous bound: the interpreter alone takes ~20 ms; torch would add seconds
    assert time.perf_counter() - start < 2.0


def test_readme_example_job(tmp_path):
    """README's main job on the bundled examples: score tables + d_HM summary."""
    env = {**os.environ, "STORYRL_EXAMPLE_OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / "examples" / "run.sh")], env=env, capture_output=True, text=True, check=True)
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 2 and all(s["n"] == 6 for s in summaries)
    # the repetitive captioner is further from the human stories than the fluent model
    assert summaries[0]["d_hm"] > summaries[1]["d_hm"]
    assert {p.name for p in tmp_path.iterdir()} >= {"human.csv", "model_a.csv", "model_b.csv", "model_a_dhm.csv"}
