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


def test_ablate_counts_unscorable_stories_in_the_console_format(tmp_path, tiny_clip, images):
    """Issue 31 item 13: no ``WARNING:storyrl...`` lines (the format
    open_clip's root-logger call used to leave behind) and no line per
    story; one count per metric and reason instead."""
    human = ["The dog ran to the park. It saw a red car.", "We ate cake at home. Then we went to sleep.",
             "They walked by the tree. The sky was blue.", "We had a party. It was a great day."]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s, "images": images}) + "\n"
                            for k, s in enumerate(human)))
    model = {"s0": "The dog ran. The dog ran to the car.", "s1": "A party.", "s2": "Cake.", "s3": "A cat. A cat sat."}
    stories = tmp_path / "model.json"
    stories.write_text(json.dumps(model))
    config = tmp_path / "ablation.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "out"), "stories": {"model": str(stories)},
        "eval": {"data": str(data), "dimensions": ["repetition"], "metrics": [
            "repetition", "bleu", {"reward": "clipscore", "clip_model": tiny_clip, "clip_pretrained": None,
                                   "device": "cpu"}]}}))
    env = {k: v for k, v in os.environ.items() if k not in ("STORYRL_VERBOSE", "STORYRL_DEBUG")}
    done = subprocess.run([sys.executable, "-m", "storyrl", "ablate", "--config", str(config), "-q"], cwd=REPO,
                          env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert not [line for line in lines if line.startswith("WARNING:") or "unscorable story" in line], done.stderr
    # by hand: the human stories have no reference (bleu scores none of them); two model stories have one sentence
    assert "ablate: the human stories: bleu: 4 unscorable: no reference" in lines
    assert "ablate: model: repetition: 2 unscorable: fewer than 2 sentences" in lines
