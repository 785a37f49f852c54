"""A generation run on disk (issue 21 item 6): the story file and its
sidecar change together (sidecar first, recording the story file's digest),
a sidecar of the wrong shape is a one-line error, a resume from another data
file is refused, and the prompting options are validated, not coerced."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

import storyrl.output_files
from storyrl.cli import main
from storyrl.config import option
from storyrl.data import StoryRecord
from storyrl.generators import Generator, GeneratorConfig, register_generator
from storyrl.generators.runs import generate_to_file, pair_is_whole, sidecar_path


@dataclass
class _UpperConfig(GeneratorConfig):
    suffix: str = option("!", "Appended to each story.")


@register_generator()
class _Upper(Generator):
    """Test generator: the record's story upper-cased."""

    name = "test_runs_upper"
    config_class = _UpperConfig

    def _generate_batch(self, records):
        return [r.story.upper() + self.suffix for r in records]


def _records(n=3):
    return [StoryRecord(f"s{i}", f"story {i}", image_ids=[f"img{i}"]) for i in range(n)]


def _data(path, n=3, word="story"):
    path.write_text("".join(json.dumps({"story_id": f"s{i}", "story": f"{word} {i}", "image_ids": [f"img{i}"]})
                            + "\n" for i in range(n)))
    return path


def _one_line(result) -> str:
    assert result.exit_code != 0 and result.exception is None or isinstance(result.exception, SystemExit), \
        result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def _kill_on_write(monkeypatch, name, nth=1):
    """Make the ``nth`` replace of the file called ``name`` raise, as a kill there would stop the run."""
    real = storyrl.output_files.LockedOutput.replace
    seen = {"n": 0}

    def replace(self, text):
        if self.path.name == name:
            seen["n"] += 1
            if seen["n"] == nth:
                raise KeyboardInterrupt("killed")
        return real(self, text)

    monkeypatch.setattr(storyrl.output_files.LockedOutput, "replace", replace)


@pytest.mark.parametrize("nth", [1, 2])
def test_a_kill_between_the_sidecar_and_the_story_file_still_resumes(tmp_path, monkeypatch, nth):
    out = tmp_path / "stories.json"
    gen = _Upper(batch_size=1)
    with monkeypatch.context() as m:
        _kill_on_write(m, "stories.json", nth)  # the second write of a save: the sidecar is already new
        with pytest.raises(KeyboardInterrupt):
            generate_to_file(gen, _records(), out, progress=False)
    meta = json.loads(sidecar_path(out).read_text())
    assert not pair_is_whole(meta, out.read_text())  # a reader (a sweep) sees the pair is not whole
    run = generate_to_file(gen, _records(), out, resume=True, progress=False)
    assert run.stories == {f"s{i}": f"STORY {i}!" for i in range(3)} and run.resumed == nth - 1
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["complete"] and pair_is_whole(meta, out.read_text())
    assert json.loads(out.read_text()) == run.stories


def test_a_kill_before_the_sidecar_leaves_the_old_pair(tmp_path, monkeypatch):
    out = tmp_path / "stories.json"
    gen = _Upper(batch_size=1)
    with monkeypatch.context() as m:
        _kill_on_write(m, "stories.meta.json", 2)
        with pytest.raises(KeyboardInterrupt):
            generate_to_file(gen, _records(), out, progress=False)
    meta = json.loads(sidecar_path(out).read_text())
    assert pair_is_whole(meta, out.read_text()) and json.loads(out.read_text()) == {"s0": "STORY 0!"}
    assert generate_to_file(gen, _records(), out, resume=True, progress=False).resumed == 1


@pytest.mark.parametrize("options", [[], None, "x"])
def test_a_sidecar_whose_options_are_not_an_object_is_a_one_line_error(tmp_path, options):
    out = tmp_path / "stories.json"
    generate_to_file(_Upper(), _records(1), out, progress=False)
    meta = json.loads(sidecar_path(out).read_text())
    sidecar_path(out).write_text(json.dumps({**meta, "options": options}))
    with pytest.raises(ValueError, match=r"stories\.meta\.json: not a sidecar storyrl wrote \('options' must be "
                                         r"a JSON object"):
        generate_to_file(_Upper(), _records(2), out, resume=True, progress=False)
    data = _data(tmp_path / "d.jsonl", 2)
    line = _one_line(CliRunner().invoke(main, ["generate", "--generator", "test_runs_upper", "-d", str(data),
                                               "-o", str(out), "--resume", "-q"]))
    assert "stories.meta.json" in line and "'options'" in line


def test_resume_from_another_data_file_is_refused(tmp_path):
    out = tmp_path / "stories.json"
    first, second = _data(tmp_path / "a.jsonl"), _data(tmp_path / "b.jsonl", word="tale")
    runner = CliRunner()
    args = ["generate", "--generator", "test_runs_upper", "-o", str(out), "-q"]
    assert runner.invoke(main, [*args, "-d", str(first), "--limit", "1"]).exit_code == 0
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["inputs"]["data"] == str(first) and len(meta["inputs"]["data_sha256"]) == 64
    line = _one_line(runner.invoke(main, [*args, "-d", str(second), "--resume"]))
    assert str(first) in line and str(second) in line and "generated from" in line
    assert json.loads(out.read_text()) == {"s0": "STORY 0!"}  # untouched
    # The same content under another name is the same data.
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(first.read_bytes())
    assert runner.invoke(main, [*args, "-d", str(copy), "--resume"]).exit_code == 0
    assert json.loads(out.read_text()) == {f"s{i}": f"STORY {i}!" for i in range(3)}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--temperature", "inf", "temperature must be a finite number, got inf"),
    ("--temperature", "nan", "temperature must be a number, got nan"),
    ("--sequence-image-size", "100000x100000", "at most 16,777,216 (MAX_SEQUENCE_IMAGE_PIXELS, 4096x4096)"),
])
def test_prompting_options_are_validated_in_one_line(tmp_path, flag, value, message):
    data = _data(tmp_path / "d.jsonl", 1)
    out = tmp_path / "o.json"
    line = _one_line(CliRunner().invoke(main, ["generate", "-d", str(data), "-o", str(out), flag, value]))
    assert message in line
    assert not out.exists() and not sidecar_path(out).exists()


def test_a_large_sequence_image_size_within_the_bound_is_kept():
    from storyrl.generators.prompting import PromptingConfig

    assert PromptingConfig(sequence_image_size="4096x4096").sequence_image_size == "4096x4096"
    with pytest.raises(ValueError, match="4097x4096 is 16,781,312 pixels"):
        PromptingConfig(sequence_image_size="4097x4096")


def test_a_sweep_cell_whose_pair_is_not_whole_is_not_reused(tmp_path, monkeypatch):
    from storyrl.eval.sweep import Cell, _generated

    cell = Cell("m", "visual", "P1", "test_runs_upper", {}, tmp_path / "cell")
    ids = [r.story_id for r in _records()]
    with monkeypatch.context() as m:
        _kill_on_write(m, "stories.json", 1)
        with pytest.raises(KeyboardInterrupt):
            generate_to_file(_Upper(batch_size=3), _records(), cell.stories, progress=False)
    meta = json.loads(sidecar_path(cell.stories).read_text())
    assert meta["complete"] is False
    # The sidecar says complete over a story file it was not written with (hand-made: the story file changed).
    cell.stories.write_text(json.dumps({sid: "edited" for sid in ids}))
    sidecar_path(cell.stories).write_text(json.dumps({**meta, "complete": True}))
    assert not _generated(cell, ids)
    generate_to_file(_Upper(batch_size=3), _records(), cell.stories, resume=True, progress=False)
    assert _generated(cell, ids)


def test_a_sidecar_written_before_digests_were_recorded_counts_as_whole(tmp_path):
    # Cells generated before stories_sha256 existed must be reused, not regenerated.
    from storyrl.eval.sweep import Cell, _generated
    from storyrl.generators.runs import pair_is_whole

    cell = Cell("m", "visual", "P1", "test_runs_upper", {}, tmp_path / "cell")
    ids = [r.story_id for r in _records()]
    generate_to_file(_Upper(batch_size=3), _records(), cell.stories, progress=False)
    meta = json.loads(sidecar_path(cell.stories).read_text())
    old = {k: v for k, v in meta.items() if k != "stories_sha256"}
    sidecar_path(cell.stories).write_text(json.dumps(old))
    text = cell.stories.read_text()
    assert pair_is_whole(old, text) and pair_is_whole(meta, text)
    assert not pair_is_whole(meta, text + " ")
    assert _generated(cell, ids)
