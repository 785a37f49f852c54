"""Errors, not tracebacks, and honest exit codes (issue 8): every failure of a
command is one line naming the file, the reward or config and the fault, with
a non-zero exit; STORYRL_DEBUG=1 or --debug shows the traceback."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO
from storyrl.cli import main
from storyrl.rewards import Reward, register_reward

EXAMPLE = REPO / "examples" / "human.jsonl"


@register_reward()
class _Broken(Reward):
    """Raises for every story: a reward that is broken, not fed bad input."""

    name = "test_cli_broken"

    def _score_batch(self, stories, **context):
        raise RuntimeError("kernel exploded")


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def _one_error_line(result) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("batch_size", ["1", "3"])
def test_broken_reward_is_an_error_whatever_the_batch_size(tmp_path, batch_size):
    out = tmp_path / "o.csv"
    result = run("score", EXAMPLE, "-m", "test_cli_broken", "-o", out, "--batch-size", batch_size, "-q")
    line = _one_error_line(result)
    assert "test_cli_broken" in line and "kernel exploded" in line


def test_debug_switch_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("STORYRL_DEBUG", "0")  # restored after the test: --debug sets it to 1
    args = ["score", EXAMPLE, "-m", "test_cli_broken", "-o", tmp_path / "o.csv", "-q"]
    quiet = run(*args)
    assert "Traceback" not in quiet.output
    for result in (run(*args, env={"STORYRL_DEBUG": "1"}), run("--debug", *args)):
        assert result.exit_code == 1 and "Traceback" in result.output and "kernel exploded" in result.output
    assert not (tmp_path / "o.csv").exists()  # a run that wrote no row leaves no file behind


@pytest.mark.parametrize("command", ["train", "ablate", "dhm"])
def test_debug_shows_the_traceback_behind_a_commands_one_line_error(tmp_path, monkeypatch, command):
    """Commands that turn an exception into their own one-line error (train
    catches ValueError and FileNotFoundError) show its traceback under
    --debug / STORYRL_DEBUG=1 too (issue 31 item 3)."""
    monkeypatch.setenv("STORYRL_DEBUG", "0")  # restored after the test: --debug sets it to 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    table = tmp_path / "t.csv"
    table.write_text("story_id,repetition\na,0.5\na,0.6\n")  # a repeated story id
    args = {"train": ["train", "sft", "--config", bad], "ablate": ["ablate", "--config", bad],
            "dhm": ["dhm", "--human", table, "--model", table]}[command]
    line = _one_error_line(run(*args))
    for result in (run(*args, env={"STORYRL_DEBUG": "1"}), run("--debug", *args)):
        assert result.exit_code == 1 and "Traceback (most recent call last)" in result.output, result.output
        assert result.output.rstrip().splitlines()[-1] == line  # the same one line, after the traceback


def test_model_download_failure_names_the_reward_and_leaves_no_output(tmp_path):
    out = tmp_path / "o.csv"
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = run("score", EXAMPLE, "-m", "clipscore", "--clip-model", "hf-hub:nobody/no-such-clip", "-o", out, "-q",
                 env=env)
    line = _one_error_line(result)
    assert "reward 'clipscore': cannot load" in line
    assert not out.exists()  # created only once the rewards are ready


@pytest.mark.parametrize(
    "story_id, message",
    [("bad\ud800id", "lone surrogate"), ("x" * 200_000, "characters long")],
)
def test_story_ids_a_score_table_cannot_hold(tmp_path, story_id, message):
    stories = tmp_path / "s.json"
    stories.write_text(json.dumps({story_id: "A dog ran. A cat sat.", "ok": "A b. C d."}))
    out = tmp_path / "o.csv"
    line = _one_error_line(run("score", stories, "-m", "repetition", "-o", out, "-q"))
    assert str(stories) in line and message in line and not out.exists()


def test_run_that_scored_nothing_exits_non_zero_with_reasons(tmp_path):
    stories = tmp_path / "s.json"
    stories.write_text(json.dumps({"a": "One sentence only.", "b": "", "c": "! !"}))
    result = run("score", stories, "-m", "repetition", "-o", tmp_path / "o.csv", "-q")
    assert result.exit_code == 1
    assert "repetition: 2 unscorable: fewer than 2 sentences" in result.output
    assert "repetition: 1 unscorable: no inter-sentence comparison" in result.output
    assert "no story could be scored for repetition" in result.output

    stories.write_text("{}")
    empty = run("score", stories, "-m", "repetition", "-o", tmp_path / "e.csv", "-q")
    assert empty.exit_code == 1 and "no story could be scored" in empty.output

    stories.write_text(json.dumps({"a": "One sentence only.", "b": "A dog ran. A cat sat."}))
    partly = run("score", stories, "-m", "repetition", "-o", tmp_path / "p.csv", "-q")
    assert partly.exit_code == 0, partly.output


def test_dhm_without_shared_scorable_stories_prints_null_and_fails(tmp_path):
    human, model = tmp_path / "h.csv", tmp_path / "m.csv"
    human.write_text("story_id,repetition\na,0.5\nb,\n")
    model.write_text("story_id,repetition\na,\nb,0.9\n")
    result = run("dhm", "--human", human, "--model", model)
    assert result.exit_code == 1
    (line,) = [x for x in result.output.splitlines() if x.startswith("{")]
    assert json.loads(line) == {"n": 0, "repetition": None, "d_hm": None}  # valid JSON, no NaN
    assert "d_HM is undefined" in result.output


def test_train_summary_is_valid_json_when_no_epoch_finished():
    from storyrl.cli.common import _json

    line = _json({"best_val_loss": math.inf, "n": 3, "x": math.nan, "ok": 0.5})
    assert json.loads(line) == {"best_val_loss": None, "n": 3, "x": None, "ok": 0.5}


def _interrupt_after(delay: float, args: list[str]) -> tuple[int, str]:
    # Background processes of a non-interactive shell ignore SIGINT: restore
    # the default so that the child sees Ctrl-C as a user's terminal sends it.
    # The installed console script, as users run it (its entry point is
    # storyrl.__main__:main).
    script = Path(sys.executable).with_name("storyrl")
    proc = subprocess.Popen(
        [str(script) if script.exists() else shutil.which("storyrl"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.decode()


@pytest.mark.slow
def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    # Scoring with a learned metric imports torch and transformers first:
    # Ctrl-C during those seconds used to print a traceback.
    model = tmp_path / "not-a-model"
    model.mkdir()
    args = ["score", str(EXAMPLE), "-m", "coherence", "--coherence-model", str(model), "-o", str(tmp_path / "o.csv")]
    for delay in (0.3, 0.9):
        code, err = _interrupt_after(delay, args)
        assert "Traceback" not in err, err
        if code == 130:
            assert err.strip().splitlines()[-1] == "Error: interrupted"
        else:  # the machine was fast enough to finish first: the load error
            assert code == 1 and "reward 'coherence'" in err
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize("command", [["score", EXAMPLE], ["meta-eval", "original-vs-random", EXAMPLE]])
def test_unknown_metric_is_a_usage_error(tmp_path, command):
    """README: usage errors exit 2; an unknown ``-m`` name is one (issue 21 item 5)."""
    result = run(*command, "-m", "repetition,nosuch", "-o", tmp_path / "o.csv")
    assert result.exit_code == 2, result.output
    line = _one_error_line(result)
    assert "--metrics" in line and "unknown reward 'nosuch'" in line and "repetition" in line
    assert not (tmp_path / "o.csv").exists()
