"""Score files that no crash, second process or failing start can corrupt
(issue 8, items 2, 3 and 7), tried as users meet them: real ``storyrl score``
processes killed at random points and resumed, concurrent writers, malformed
and half-written files, models that fail to load, outputs that are inputs or
unwritable, ``dhm --per-story`` and ``--explain`` with ``--resume``.

The model-free ``repetition`` metric with ``--batch-size 1`` keeps runs fast
while writing one row at a time, so that a run lasts long enough to be killed.
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO, shared_path
from storyrl.data import ScoreWriter, read_scores
from storyrl.output_files import LockedOutput, OutputError

HEADER = "story_id,repetition"
WORDS = "the dog ran to a park and saw big red ball near old tree while kids played happily at home".split()


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    # The checkout under test, not whatever storyrl the venv points at (the
    # deliberate-break runs use a copy of the tree); no inherited debug mode.
    env = {k: v for k, v in os.environ.items() if k != "STORYRL_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _command(*args) -> list[str]:
    return [sys.executable, "-m", "storyrl", *map(str, args)]


def storyrl(*args, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), capture_output=True, text=True, env=_env(**env), timeout=timeout)


def start(*args) -> subprocess.Popen:
    return subprocess.Popen(_command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())


def invoke(*args, **env):
    """In-process run (for monkeypatched faults); stderr is part of output."""
    from storyrl.cli import main

    env.setdefault("STORYRL_DEBUG", None)
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def make_stories(path: Path, n: int, seed: int = 0) -> list[str]:
    """A JSONL story set of ``n`` stories; returns the ids in order. Some ids
    need CSV quoting and some stories are unscorable (one sentence), so both
    quoted ids and empty cells go through every kill and repair."""
    rng = random.Random(seed)
    ids, lines = [], []
    for k in range(n):
        sid = f"s{k:05d}" if k % 397 else f's{k:05d}, "q" é'
        count = 1 if k % 211 == 5 else rng.randint(2, 6)
        sentences = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) for _ in range(count))
        story = " ".join(sentence.capitalize() + "." for sentence in sentences)
        ids.append(sid)
        lines.append(json.dumps({"story_id": sid, "story": story}, ensure_ascii=False) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return ids


def raw(path: Path) -> str:
    """A score file's exact text (the csv module ends lines with \\r\\n,
    which read_text would turn into \\n)."""
    return path.read_bytes().decode("utf-8")


def lines_of(path: Path) -> list[str]:
    return raw(path).splitlines()


def crlf(lines: list[str]) -> str:
    return "".join(line + "\r\n" for line in lines)


def data_rows(path: Path) -> int:
    """Complete data lines in a score file (0 when absent or header only)."""
    try:
        return max(0, path.read_bytes().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def check_lines(path: Path, ids: list[str]) -> None:
    """Line by line: the header once, then exactly one well-formed row per
    story (a repaired file must not hide a malformed line that a lenient
    reader would skip)."""
    text = raw(path)
    assert text.endswith("\n"), "last line is not complete"
    lines = text.splitlines()
    assert lines[0] == HEADER
    seen = []
    for lineno, line in enumerate(lines[1:], 2):
        cells = next(csv.reader([line]))
        assert len(cells) == 2, f"line {lineno}: {line!r}"
        assert cells[1] == "" or math.isfinite(float(cells[1])), f"line {lineno}: {line!r}"
        seen.append(cells[0])
    assert len(seen) == len(set(seen)), "a story is written twice"
    assert sorted(seen) == sorted(ids)


def assert_same_table(path: Path, reference: Path) -> None:
    got, want = read_scores(path), read_scores(reference)
    assert got.metrics == want.metrics and got.ids == want.ids
    for metric in want.metrics:
        for sid in want.ids:
            a, b = got.scores[metric][sid], want.scores[metric][sid]
            assert a == b or (math.isnan(a) and math.isnan(b)), (metric, sid, a, b)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def score_args(stories: Path, out: Path, *extra) -> list:
    return ["score", stories, "-m", "repetition", "-o", out, "--batch-size", "1", "-q", *extra]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """30 stories and their uninterrupted score file."""
    root = tmp_path_factory.mktemp("small")
    stories = root / "stories.jsonl"
    ids = make_stories(stories, 30, seed=3)
    reference = root / "reference.csv"
    done = storyrl(*score_args(stories, reference))
    assert done.returncode == 0, done.stderr
    return {"stories": stories, "ids": ids, "reference": reference}


# ---------------------------------------------------------------------------
# 1. kills at random points, then --resume
# ---------------------------------------------------------------------------


def test_random_kills_then_resume_equal_an_uninterrupted_run(tmp_path):
    stories = tmp_path / "stories.jsonl"
    ids = make_stories(stories, 5000, seed=1)
    total = len(ids)
    # The uninterrupted run, timed: start-up until its first row, then rows/s.
    reference = tmp_path / "reference.csv"
    began = time.monotonic()
    proc = start(*score_args(stories, reference))
    while data_rows(reference) == 0 and proc.poll() is None:
        time.sleep(0.002)
    start_up = time.monotonic() - began
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    rate = total / max(time.monotonic() - began - start_up, 1e-3)

    out = tmp_path / "out.csv"
    rng = random.Random(20240508)
    mid_run = 0
    # At least 6 starts; more (at most 24) when a loaded machine let runs finish
    # before their kill: the series then starts again from an empty OUT.
    for k in range(24):
        if k >= 6 and mid_run >= 3:
            break
        before = data_rows(out) if out.exists() else 0
        proc = start(*score_args(stories, out, *(["--resume"] if out.exists() else [])))
        if k % 2 == 0:
            # Kill once OUT reaches a random row count: certainly mid-run.
            target = before + rng.randint(1, max(1, (total - before) // 3))
            while data_rows(out) < target and proc.poll() is None:
                time.sleep(0.002)
        else:
            # Kill at a random time before the run would end: in start-up
            # (nothing, an empty file or a header written) or mid-run.
            time.sleep(rng.uniform(0.0, start_up + 0.5 * (total - before) / rate))
        proc.kill()
        proc.wait(timeout=30)
        rows = data_rows(out)
        assert rows >= before, "a resumed run lost rows"
        if proc.returncode == -signal.SIGKILL and before < rows < total:
            mid_run += 1
        if rows == total:  # this series is complete: it must equal the uninterrupted run
            check_lines(out, ids)
            assert out.read_bytes() == reference.read_bytes()
            out.unlink()
    assert mid_run >= 3, f"only {mid_run} kills landed mid-run"

    final = storyrl(*score_args(stories, out, *(["--resume"] if out.exists() else [])))
    assert final.returncode == 0, final.stderr
    check_lines(out, ids)
    assert_same_table(out, reference)
    assert out.read_bytes() == reference.read_bytes()


# ---------------------------------------------------------------------------
# 2. a second writer
# ---------------------------------------------------------------------------


def test_second_writer_fails_at_once_and_first_file_is_intact(tmp_path):
    stories = tmp_path / "stories.jsonl"
    ids = make_stories(stories, 12000, seed=2)
    out = tmp_path / "out.csv"
    first = start(*score_args(stories, out))
    try:
        deadline = time.monotonic() + 60
        while data_rows(out) < 10 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.poll() is None, "the first writer ended before the test could start a second"
        began = time.monotonic()
        contenders = {flag: subprocess.Popen(_command(*score_args(stories, out, flag)), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=_env())
                      for flag in ("--resume", "--overwrite")}
        results = {flag: (p.wait(timeout=60), p.stderr.read()) for flag, p in contenders.items()}
        elapsed = time.monotonic() - began
        # Still running: the contenders did not wait for its lock.
        assert first.poll() is None, "the first writer ended before the contenders did: make the story set bigger"
        assert elapsed < 20
        for flag, (code, stderr) in results.items():
            assert code != 0, flag
            assert str(out) in stderr and "in use" in stderr, (flag, stderr)
            assert "Traceback" not in stderr
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    check_lines(out, ids)
    assert read_scores(out).ids == ids


def test_second_score_writer_in_process_is_refused(tmp_path):
    path = tmp_path / "scores.csv"
    with ScoreWriter(path, ["repetition"]) as writer:
        writer.write(["a"], {"repetition": [0.5]})
        for kwargs in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(OutputError, match="in use") as info:
                ScoreWriter(path, ["repetition"], **kwargs)
            assert str(path) in str(info.value)
        writer.write(["b"], {"repetition": [0.25]})
    assert raw(path) == crlf([HEADER, "a,0.5", "b,0.25"])  # the refused --overwrite emptied nothing


# ---------------------------------------------------------------------------
# 3. --resume on malformed and half-written files
# ---------------------------------------------------------------------------

MALFORMED = {
    # name: (edit of the reference lines, line the error must name)
    "cell count": (lambda lines: lines[:10] + [lines[10] + ",0.5"] + lines[11:], 11),
    "not a number": (lambda lines: lines[:15] + [lines[15].split(",")[0] + ",abc"] + lines[16:], 16),
    "header": (lambda lines: ["story_id,coherence"] + lines[1:], 1),
    "duplicate id": (lambda lines: lines[:20] + [lines[3]] + lines[20:], 21),
}


@pytest.mark.parametrize("half_line", [False, True], ids=["complete", "half-line"])
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_resume_refuses_a_malformed_file_and_leaves_it_unchanged(small, tmp_path, case, half_line):
    edit, bad_line = MALFORMED[case]
    all_lines = lines_of(small["reference"])
    lines = all_lines[:25]
    text = crlf(edit(lines))
    if half_line:
        text += all_lines[25][:4]  # a kill while writing the next row
    out = tmp_path / "out.csv"
    out.write_bytes(text.encode("utf-8"))
    result = storyrl(*score_args(small["stories"], out, "--resume"))
    assert result.returncode != 0
    assert out.read_bytes() == text.encode("utf-8"), "a refused file was modified"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]  # and no repaired copy set aside
    [error] = error_lines(result.stderr)
    assert str(out) in error and re.search(rf"line {bad_line}\b", error), error
    assert "already scored" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("cut", ["mid-score", "mid-id", "mid-header", "after-quote"])
def test_resume_repairs_a_half_written_last_line(small, tmp_path, cut):
    lines = lines_of(small["reference"])
    if cut == "mid-header":
        partial = "story_i"
    else:
        n = 0 if cut == "after-quote" else 12  # story 0 has an id that needs CSV quotes
        head, row = crlf(lines[: n + 1]), lines[n + 1]
        at = row.index("q") + 1 if cut == "after-quote" else 3 if cut == "mid-id" else row.index(",") + 4
        partial = head + row[:at]
    out = tmp_path / "out.csv"
    out.write_bytes(partial.encode("utf-8"))
    result = storyrl(*score_args(small["stories"], out, "--resume"))
    assert result.returncode == 0, result.stderr
    check_lines(out, small["ids"])
    assert out.read_bytes() == small["reference"].read_bytes()


# A kill in the middle of the repair: the child writes half of any large
# buffer (the rewritten file) or truncates, then SIGKILLs itself.
_KILL_IN_REPAIR = """
import os, signal, sys
write, ftruncate = os.write, os.ftruncate
def dying_write(fd, data):
    if len(data) < 1000:
        return write(fd, data)
    write(fd, bytes(data)[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
def dying_ftruncate(fd, length):
    ftruncate(fd, length)
    os.kill(os.getpid(), signal.SIGKILL)
os.write, os.ftruncate = dying_write, dying_ftruncate
sys.argv = ["storyrl", *sys.argv[1:]]
from storyrl.__main__ import main
main()
"""


def test_kill_during_the_repair_keeps_the_file(tmp_path):
    stories = tmp_path / "stories.jsonl"
    ids = make_stories(stories, 200, seed=4)
    reference = tmp_path / "reference.csv"
    assert storyrl(*score_args(stories, reference)).returncode == 0
    lines = lines_of(reference)
    text = crlf(lines[:151]) + lines[151][:5]  # 150 rows and half a row
    out = tmp_path / "out.csv"
    out.write_bytes(text.encode("utf-8"))
    killed = subprocess.run([sys.executable, "-c", _KILL_IN_REPAIR, *map(str, score_args(stories, out, "--resume"))],
                            capture_output=True, text=True, env=_env(), timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # it did die inside the repair
    kept = raw(out)
    assert kept in (text, text[: text.rfind("\n") + 1]), "a kill during the repair lost rows"
    again = storyrl(*score_args(stories, out, "--resume"))
    assert again.returncode == 0, again.stderr
    check_lines(out, ids)
    assert out.read_bytes() == reference.read_bytes()


def test_resume_through_a_symlink_repairs_the_linked_file(small, tmp_path):
    # A symlinked OUT (results kept on another disk) must stay a link: the
    # repaired text and the new rows belong in the file it points to.
    (tmp_path / "data").mkdir()
    target, link = tmp_path / "data" / "out.csv", tmp_path / "out.csv"
    lines = lines_of(small["reference"])
    target.write_bytes((crlf(lines[:11]) + lines[11][:4]).encode())
    link.symlink_to(target)
    result = storyrl(*score_args(small["stories"], link, "--resume"))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink()
    assert target.read_bytes() == small["reference"].read_bytes()


# ---------------------------------------------------------------------------
# 4. a model that fails to load
# ---------------------------------------------------------------------------


def test_failed_model_load_leaves_no_output(small, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "README.txt").write_text("nothing to load here\n")
    out = tmp_path / "results" / "out.csv"
    args = ["score", small["stories"], "-m", "coherence", "--coherence-model", not_a_model, "-o", out, "-q"]
    for attempt in range(2):  # the same command again fails the same way, not with "exists"
        result = storyrl(*args)
        assert result.returncode != 0
        [error] = error_lines(result.stderr)
        assert "coherence" in error and "cannot load" in error and str(not_a_model) in error, (attempt, error)
        assert "exists" not in error and "Traceback" not in result.stderr
        assert not out.exists()
        assert not out.parent.exists() or not list(out.parent.iterdir())


# The models' load is where the run ends: killed (the OOM killer, a batch
# system) or failing. Reward._setup is the load hook every reward goes through.
_DIE_WHILE_LOADING = """
import os, signal, sys
from storyrl.rewards.base import Reward
fault = sys.argv[1]
def dying_setup(self):
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError("model file truncated")
Reward._setup = dying_setup
sys.argv = ["storyrl", *sys.argv[2:]]
from storyrl.__main__ import main
main()
"""


@pytest.mark.parametrize("fault", ["kill", "error"])
def test_output_is_touched_only_once_the_models_are_loaded(small, tmp_path, fault):
    def run(*args):
        return subprocess.run([sys.executable, "-c", _DIE_WHILE_LOADING, fault, *map(str, args)],
                              capture_output=True, text=True, env=_env(), timeout=60)

    out = tmp_path / "new.csv"
    result = run(*score_args(small["stories"], out))
    assert result.returncode == (-signal.SIGKILL if fault == "kill" else 1), result.stderr
    assert not out.exists()  # a header-only file would make the rerun fail with "exists"

    # --overwrite of an old table by a run that never started keeps the old table.
    old = tmp_path / "old.csv"
    old.write_bytes(small["reference"].read_bytes())
    result = run(*score_args(small["stories"], old, "--overwrite"))
    assert result.returncode != 0
    assert old.read_bytes() == small["reference"].read_bytes()


# ---------------------------------------------------------------------------
# 5. outputs that are inputs, not CSV, or both --resume and --overwrite
# ---------------------------------------------------------------------------


def test_output_equal_to_an_input_is_refused(small, tmp_path):
    jsonl = tmp_path / "S.jsonl"
    jsonl.write_bytes(small["stories"].read_bytes())
    result = storyrl("score", jsonl, "-m", "repetition", "-o", jsonl, "--overwrite", "-q")
    assert result.returncode != 0 and str(jsonl) in result.stderr
    assert jsonl.read_bytes() == small["stories"].read_bytes()

    # A JSON story set named *.csv passes the CSV check: the same-file check must
    # catch it, under another spelling of the path too.
    story_csv = tmp_path / "S.csv"
    story_csv.write_text(json.dumps({"a": "A dog ran. A cat sat.", "b": "One. Two."}))
    before = story_csv.read_bytes()
    (tmp_path / "sub").mkdir()
    for target in (story_csv, tmp_path / "sub" / ".." / "S.csv"):
        result = storyrl("score", story_csv, "-m", "repetition", "-o", target, "--overwrite", "-q")
        assert result.returncode != 0
        [error] = error_lines(result.stderr)
        assert "input" in error and "S.csv" in error, error
        assert story_csv.read_bytes() == before


def test_json_output_is_refused(small, tmp_path):
    out = tmp_path / "scores.json"
    result = storyrl("score", small["stories"], "-m", "repetition", "-o", out, "-q")
    assert result.returncode != 0
    [error] = error_lines(result.stderr)
    assert "CSV" in error and str(out) in error, error
    assert not out.exists()


def test_resume_with_overwrite_is_refused(small, tmp_path):
    out = tmp_path / "out.csv"
    text = crlf(lines_of(small["reference"])[:6])
    out.write_bytes(text.encode())
    result = storyrl(*score_args(small["stories"], out, "--resume", "--overwrite"))
    assert result.returncode != 0
    [error] = error_lines(result.stderr)
    assert "--resume" in error and "--overwrite" in error, error
    assert raw(out) == text


# ---------------------------------------------------------------------------
# 6. dhm --per-story
# ---------------------------------------------------------------------------


def test_dhm_per_story_needs_overwrite(tmp_path):
    human, model, per_story = tmp_path / "human.csv", tmp_path / "model.csv", tmp_path / "per_story.csv"
    human.write_text(f"{HEADER}\na,0.5\nb,0.75\nc,1.0\n")
    model.write_text(f"{HEADER}\na,0.25\nb,0.75\nc,\n")
    old = "story_id,repetition\nold,1.0\n"
    per_story.write_text(old)
    args = ["dhm", "--human", human, "--model", model, "--per-story", per_story]

    refused = storyrl(*args)
    assert refused.returncode != 0
    [error] = error_lines(refused.stderr)
    assert str(per_story) in error and "--overwrite" in error, error
    assert refused.stdout == ""  # refused before any work, not after printing the result
    assert per_story.read_text() == old

    replaced = storyrl(*args, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["n"] == 2
    table = read_scores(per_story)
    assert table.ids == ["a", "b"] and table.scores["repetition"] == {"a": 0.25, "b": 0.0}


# ---------------------------------------------------------------------------
# 7. --explain with --resume
# ---------------------------------------------------------------------------


def _rounded(value):
    # Explain records compared to 1e-9: the same CLIP computation, but not
    # promised bit for bit across runs.
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_explain_file_is_resumed_consistently(tmp_path, tiny_clip, images, one_thread):
    groovist_dir = shared_path("groovist")
    stories, phrases = tmp_path / "stories.jsonl", tmp_path / "nps.json"
    all_phrases = ["the dog", "the sky", "a car", "the bride"]
    stories.write_text("".join(
        json.dumps({"story_id": f"s{k}", "story": "The dog ran. The sky was blue. A car. The bride smiled.",
                    "images": images[: 1 + k % 3]}) + "\n" for k in range(6)
    ))
    phrases.write_text(json.dumps({f"s{k}": all_phrases[: 1 + k % 4] for k in range(6)}))
    common = ["-m", "groovist", "--regions", "grid", "--clip-model", tiny_clip, "--noun-phrases", phrases,
              "--concreteness", groovist_dir / "concreteness_ratings.csv", "--batch-size", "1", "-q"]
    env = {"STORYRL_CACHE": str(groovist_dir)}  # pronoun list from the "asset cache"

    full, full_explain = tmp_path / "full.csv", tmp_path / "full.jsonl"
    result = invoke("score", stories, "-o", full, "--explain", full_explain, *common, **env)
    assert result.exit_code == 0, result.output
    want = [json.loads(line) for line in full_explain.read_text().splitlines()]
    assert [r["story_id"] for r in want] == [f"s{k}" for k in range(6)]

    # As kills leave them: s0 and s1 in OUT, s2 half written there; the
    # explain file (written before the rows) also holds s2 and s3 (a batch
    # scored but never written) and half of s4.
    score_lines, explain_lines = lines_of(full), lines_of(full_explain)
    out, explain = tmp_path / "out.csv", tmp_path / "out.jsonl"
    out.write_bytes((crlf(score_lines[:3]) + score_lines[3][:4]).encode())
    explain.write_bytes(("".join(line + "\n" for line in explain_lines[:4]) + explain_lines[4][:30]).encode())

    result = invoke("score", stories, "-o", out, "--explain", explain, "--resume", *common, **env)
    assert result.exit_code == 0, result.output
    assert_same_table(out, full)
    got = [json.loads(line) for line in explain.read_text().splitlines()]
    assert [r["story_id"] for r in got] == read_scores(out).ids  # one line per story in OUT, in order
    assert _rounded(got) == _rounded(want)


def test_run_failing_before_its_first_row_leaves_neither_out_nor_explain(tmp_path, tiny_clip, images, one_thread,
                                                                          monkeypatch):
    # The explain lines of a batch are written before its score rows: a run
    # that dies between the two (disk full here) must not leave an explain
    # file that makes the same command refuse with "exists".
    groovist_dir = shared_path("groovist")
    stories, phrases = tmp_path / "stories.jsonl", tmp_path / "nps.json"
    stories.write_text(json.dumps({"story_id": "s0", "story": "The dog ran.", "images": images[:1]}) + "\n")
    phrases.write_text(json.dumps({"s0": ["the dog"]}))
    out, explain = tmp_path / "out.csv", tmp_path / "out.jsonl"
    args = ["score", stories, "-o", out, "--explain", explain, "-m", "groovist", "--regions", "grid",
            "--clip-model", tiny_clip, "--noun-phrases", phrases,
            "--concreteness", groovist_dir / "concreteness_ratings.csv", "-q"]
    env = {"STORYRL_CACHE": str(groovist_dir)}

    def full_disk(self, ids, columns):
        raise OutputError(f"{self.path}: cannot write: {os.strerror(errno.ENOSPC)}")

    with monkeypatch.context() as patch:
        patch.setattr(ScoreWriter, "write", full_disk)
        failed = invoke(*args, **env)
    assert failed.exit_code != 0 and "No space left" in failed.output
    assert not out.exists() and not explain.exists()
    again = invoke(*args, **env)
    assert again.exit_code == 0, again.output
    assert read_scores(out).ids == ["s0"] and len(explain.read_text().splitlines()) == 1


def test_copies_left_by_a_killed_repair_are_removed(small, tmp_path):
    out = tmp_path / "out.csv"
    lines = lines_of(small["reference"])
    out.write_bytes((crlf(lines[:5]) + lines[5][:3]).encode())
    stale = tmp_path / ".out.csv.k1ll3d.tmp"
    stale.write_text("half of a repair\n")
    other = tmp_path / ".other.csv.x.tmp"  # another file's copy: not ours to remove
    other.write_text("x\n")
    result = storyrl(*score_args(small["stories"], out, "--resume"))
    assert result.returncode == 0, result.stderr
    assert not stale.exists() and other.exists()
    assert out.read_bytes() == small["reference"].read_bytes()


# ---------------------------------------------------------------------------
# 8. every row is flushed
# ---------------------------------------------------------------------------


def test_score_writer_flushes_each_row(tmp_path):
    path = tmp_path / "scores.csv"
    with ScoreWriter(path, ["repetition"]) as writer:
        assert raw(path) == crlf([HEADER])  # another reader sees the header at once
        writer.write(["a"], {"repetition": [0.5]})
        assert raw(path) == crlf([HEADER, "a,0.5"])
        writer.write(["b", "c"], {"repetition": [float("nan"), 1.0]})
        assert raw(path) == crlf([HEADER, "a,0.5", "b,", "c,1.0"])


# ---------------------------------------------------------------------------
# 9. unwritable outputs: one line naming the file, traceback only on request
# ---------------------------------------------------------------------------


def _check_one_line_error(result, path: Path, fault: str, debug: bool) -> None:
    assert result.exit_code != 0
    [error] = error_lines(result.output)
    assert str(path) in error and fault in error, error
    assert ("Traceback" in result.output) == debug, result.output


def test_parent_is_a_regular_file(small, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory\n")
    out = blocker / "sub" / "out.csv"
    result = storyrl(*score_args(small["stories"], out))
    assert result.returncode != 0
    assert error_lines(result.stderr) == [result.stderr.strip()]  # the only thing printed
    [error] = error_lines(result.stderr)
    assert str(out) in error and "not a writable directory" in error, error
    assert blocker.read_text() == "a file, not a directory\n"


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "STORYRL_DEBUG"])
def test_parent_is_a_regular_file_past_the_start_up_check(small, tmp_path, monkeypatch, debug):
    # The file is checked again when it is opened (another process may have
    # changed things since the start-up check): that error is one line too.
    import storyrl.output_files

    monkeypatch.setattr(storyrl.output_files, "check_output", lambda path, existing="refuse": None)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker / "sub" / "out.csv"
    result = invoke(*score_args(small["stories"], out), STORYRL_DEBUG="1" if debug else None)
    _check_one_line_error(result, out, "cannot create", debug)


@pytest.mark.parametrize("where", ["start-up check", "open"])
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "STORYRL_DEBUG"])
def test_read_only_target(small, tmp_path, monkeypatch, where, debug):
    # We run as root, so permissions never refuse: simulate a read-only file.
    out = tmp_path / "out.csv"
    text = crlf(lines_of(small["reference"])[:6])
    out.write_bytes(text.encode())
    real_open, real_access = os.open, os.access

    def read_only_open(path, flags, *args, **kwargs):
        if Path(path) == out and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    def read_only_access(path, mode, *args, **kwargs):
        return False if Path(path) == out and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    if where == "start-up check":
        monkeypatch.setattr(os, "access", read_only_access)
    result = invoke(*score_args(small["stories"], out, "--resume"), STORYRL_DEBUG="1" if debug else None)
    fault = "permission denied" if where == "start-up check" else "Permission denied"
    _check_one_line_error(result, out, fault, debug)
    assert raw(out) == text


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "STORYRL_DEBUG"])
def test_disk_full_while_writing_rows(small, tmp_path, monkeypatch, debug):
    out = tmp_path / "out.csv"
    real_stream = LockedOutput.stream
    written = []

    class FullDisk:
        # The disk fills after three rows: the fourth write fails as the OS would.
        def __init__(self, stream):
            self._stream = stream

        def write(self, text):
            if len(written) >= 4:  # header + 3 rows
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(text)
            return self._stream.write(text)

        def __getattr__(self, name):
            return getattr(self._stream, name)

    def stream(self):
        real = real_stream(self)
        return FullDisk(real) if self.path == out else real

    monkeypatch.setattr(LockedOutput, "stream", stream)
    result = invoke(*score_args(small["stories"], out), STORYRL_DEBUG="1" if debug else None)
    _check_one_line_error(result, out, "No space left on device", debug)
    assert raw(out) == "".join(written)  # what was written before stays, whole

    monkeypatch.undo()  # space again: the run resumes to the uninterrupted result
    again = invoke(*score_args(small["stories"], out, "--resume"))
    assert again.exit_code == 0, again.output
    assert out.read_bytes() == small["reference"].read_bytes()


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "STORYRL_DEBUG"])
def test_disk_full_during_the_repair(small, tmp_path, monkeypatch, debug):
    out = tmp_path / "out.csv"
    text = crlf(lines_of(small["reference"])[:8]) + "s00"
    out.write_bytes(text.encode())
    real_write = os.write

    def full_write(fd, data):
        if len(data) > 50:  # the rewritten file, not a one-row append
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_write)
    result = invoke(*score_args(small["stories"], out, "--resume"), STORYRL_DEBUG="1" if debug else None)
    _check_one_line_error(result, out, "No space left on device", debug)
    assert raw(out) == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # the aside copy is removed
