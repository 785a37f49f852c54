"""spaCy is checked when a reward is set up, not when scoring starts, and
text units given with the stories make it unnecessary (issue 21 item 2)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

import storyrl  # noqa: F401  (torchvision fallback before timm)
from storyrl.cli import main
from storyrl.noun_phrases import PipelineNotInstalled, require_pipeline
from storyrl.rewards.base import RewardError
from storyrl.rewards.rovist_vg import RovistVG

MISSING = "no_such_spacy_pipeline_xyz"


def _one_error(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_require_pipeline_names_it_and_the_download_command(tmp_path):
    with pytest.raises(PipelineNotInstalled, match=f"'{MISSING}' is not installed; install it with: "
                                                   f"python -m spacy download {MISSING}"):
        require_pipeline(MISSING)
    require_pipeline(str(tmp_path))  # a pipeline directory is spaCy's to load


def test_rovist_vg_setup_checks_the_pipeline_before_loading(rovist_vg_dir, glove_path, monkeypatch):
    loads = []
    monkeypatch.setattr("storyrl.models.rovist_vg.rovist_vg_embedder", lambda *a: loads.append(a))
    reward = RovistVG(model=rovist_vg_dir, glove=glove_path, device="cpu", spacy_pipeline=MISSING)
    with pytest.raises(RewardError, match=f"reward 'rovist_vg': spaCy pipeline '{MISSING}' is not installed.*"
                                          f"python -m spacy download {MISSING}.*nouns"):
        reward.setup()
    assert loads == []
    reward.text_units_given = True
    reward.setup()  # nouns come with the stories: no spaCy needed
    assert len(loads) == 1


def test_score_groovist_without_the_pipeline_fails_before_models_load(tmp_path, images, monkeypatch):
    loads = []
    monkeypatch.setattr("storyrl.models.clip.clip_embedder", lambda *a, **k: loads.append(a) or 1 / 0)
    data = tmp_path / "s.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "the dog saw a cat.", "images": images}) + "\n")
    args = ["score", data, "-m", "groovist", "--spacy-pipeline", MISSING, "-o", tmp_path / "o.csv", "-q"]
    line = _one_error(CliRunner().invoke(main, [str(a) for a in args]))
    assert f"spaCy pipeline '{MISSING}' is not installed" in line and f"python -m spacy download {MISSING}" in line
    assert "--noun-phrases" in line and loads == []
    # With --noun-phrases, spaCy is not needed: setup goes on to load CLIP.
    nps = tmp_path / "nps.json"
    nps.write_text(json.dumps({"s0": ["the dog", "a cat"]}))
    line = _one_error(CliRunner().invoke(main, [str(a) for a in [*args, "--noun-phrases", nps]]))
    assert "spaCy" not in line and "division by zero" in line and len(loads) == 1


def test_score_rovist_vg_reads_records_nouns_without_spacy(tmp_path, images, rovist_vg_dir, glove_path):
    records = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images, "nouns": ["dog", "cat"]},
               {"story_id": "s1", "story": "a man by the tree.", "images": images[:2], "nouns": ["man", "tree"]}]
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "o.csv"
    args = ["score", data, "-m", "rovist_vg", "--rovist-vg-model", rovist_vg_dir, "--glove", glove_path,
            "--regions", "whole", "--spacy-pipeline", MISSING, "--device", "cpu", "-o", out, "-q"]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    with out.open() as f:
        got = {row["story_id"]: float(row["rovist_vg"]) for row in csv.DictReader(f)}
    direct = RovistVG(model=rovist_vg_dir, glove=glove_path, device="cpu", regions="whole", spacy_pipeline=MISSING)
    want = direct.score([r["story"] for r in records], images=[r["images"] for r in records],
                        nouns=[r["nouns"] for r in records])
    assert np.isfinite(want).all()
    assert got == pytest.approx({"s0": want[0], "s1": want[1]}, rel=1e-5)


def _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, records, name, *extra):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / f"{name}.csv"
    args = ["score", data, "-m", "rovist_vg", "--rovist-vg-model", rovist_vg_dir, "--glove", glove_path,
            "--regions", "whole", "--spacy-pipeline", MISSING, "--device", "cpu", "-o", out, "-q", *extra]
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exit_code != 0:
        return _one_error(result)
    with out.open() as f:
        return {row["story_id"]: float(row["rovist_vg"]) for row in csv.DictReader(f)}


def test_score_rovist_vg_nouns_file_scores_as_records_nouns(tmp_path, images, rovist_vg_dir, glove_path):
    nouns = {"s0": ["dog", "cat"], "s1": ["man", "tree"]}
    bare = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images},
            {"story_id": "s1", "story": "a man by the tree.", "images": images[:2]}]
    carrying = [{**r, "nouns": nouns[r["story_id"]]} for r in bare]
    want = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, carrying, "carrying")
    assert set(want) == {"s0", "s1"} and all(np.isfinite(list(want.values())))
    noun_file = tmp_path / "nouns.json"
    noun_file.write_text(json.dumps(nouns))
    got = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, bare, "file", "--nouns", noun_file)
    assert got == pytest.approx(want, rel=1e-6)
    # the file's nouns are the ones scored: other nouns, other scores
    noun_file.write_text(json.dumps({"s0": ["man", "tree"], "s1": ["dog", "cat"]}))
    swapped = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, bare, "swapped", "--nouns", noun_file)
    assert swapped["s0"] != pytest.approx(want["s0"]) and swapped["s1"] != pytest.approx(want["s1"])
    # without nouns, the missing pipeline is named with --nouns as the way around it
    line = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, bare, "none")
    assert f"spaCy pipeline '{MISSING}' is not installed" in line and "--nouns" in line


@pytest.mark.parametrize(("content", "needles"), [
    ({"s0": ["dog", None], "s1": ["man"]}, ["'s0'", "nouns"]),  # ints pass, as in records
    ({"s0": "dog", "s1": ["man"]}, ["'s0'", "nouns"]),
    ({"s0": ["dog"]}, ["no entry for story 's1'"]),
    (["dog"], ["expected a JSON object {story_id: [nouns]}"]),
])
def test_malformed_nouns_file_is_one_line_naming_file_and_record(tmp_path, images, rovist_vg_dir, glove_path,
                                                                  content, needles):
    bare = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images},
            {"story_id": "s1", "story": "a man by the tree.", "images": images[:2]}]
    noun_file = tmp_path / "nouns.json"
    noun_file.write_text(json.dumps(content))
    line = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, bare, "bad", "--nouns", noun_file)
    assert str(noun_file) in line
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "bad.csv").exists()


def test_score_refuses_when_one_record_lacks_its_noun_phrases(tmp_path, images, monkeypatch):
    # the record without phrases would need spaCy: setup must refuse before anything loads
    loads = []
    monkeypatch.setattr("storyrl.models.clip.clip_embedder", lambda *a, **k: loads.append(a) or 1 / 0)
    records = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images, "noun_phrases": ["the dog"]},
               {"story_id": "s1", "story": "a man by the tree.", "images": images}]
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "o.csv"
    args = ["score", data, "-m", "groovist", "--spacy-pipeline", MISSING, "-o", out, "-q"]
    line = _one_error(CliRunner().invoke(main, [str(a) for a in args]))
    assert f"spaCy pipeline '{MISSING}' is not installed" in line and "--noun-phrases" in line
    assert loads == [] and not out.exists()
    # with both records carrying phrases, setup goes on to load CLIP
    records[1]["noun_phrases"] = ["a man"]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    line = _one_error(CliRunner().invoke(main, [str(a) for a in args]))
    assert "spaCy" not in line and len(loads) == 1


def test_score_rovist_vg_reads_records_noun_phrases_without_spacy(tmp_path, images, rovist_vg_dir, glove_path):
    # noun_phrases stand in for nouns (a one-word phrase is that noun)
    records = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images, "noun_phrases": ["dog", "cat"]},
               {"story_id": "s1", "story": "a man by the tree.", "images": images[:2], "noun_phrases": ["man", "tree"]}]
    got = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, records, "phrases")
    assert isinstance(got, dict), got  # not the missing pipeline's error
    as_nouns = [{k: v for k, v in r.items() if k != "noun_phrases"} | {"nouns": r["noun_phrases"]} for r in records]
    want = _rovist_scores(tmp_path, images, rovist_vg_dir, glove_path, as_nouns, "nouns")
    assert got == pytest.approx(want, rel=1e-6)


def test_nouns_and_noun_phrases_files_reach_their_own_fields(tmp_path, images, rovist_vg_dir, glove_path,
                                                             monkeypatch):
    from storyrl.rewards.groovist import GROOViST

    seen = {}

    def spy(cls):
        def score(self, texts, **context):
            seen[self.name] = {k: context.get(k) for k in ("nouns", "noun_phrases")}
            return [0.5] * len(texts)

        monkeypatch.setattr(cls, "setup", lambda self: self)
        monkeypatch.setattr(cls, "score", score)

    spy(GROOViST)
    spy(RovistVG)
    bare = [{"story_id": "s0", "story": "the dog saw a cat.", "images": images},
            {"story_id": "s1", "story": "a man by the tree.", "images": images[:2]}]
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in bare))
    nouns, phrases = tmp_path / "nouns.json", tmp_path / "nps.json"
    nouns.write_text(json.dumps({"s0": ["dog"], "s1": ["man"]}))
    phrases.write_text(json.dumps({"s0": ["the big dog"], "s1": ["the old man"]}))
    args = ["score", data, "-m", "groovist,rovist_vg", "--rovist-vg-model", rovist_vg_dir, "--glove", glove_path,
            "--nouns", nouns, "--noun-phrases", phrases, "--spacy-pipeline", MISSING, "-o", tmp_path / "o.csv", "-q"]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    want = {"nouns": [["dog"], ["man"]], "noun_phrases": [["the big dog"], ["the old man"]]}
    assert seen == {"groovist": want, "rovist_vg": want}
