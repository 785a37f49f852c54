"""The grounding commands as users run them: storyrl score with groovist and
clipscore (images, regions, CLIP and θ options, --explain, --noun-phrases,
--resume), groovist-calibrate, regions, assets, and the reward configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO, shared_path

from storyrl.cli import main
from storyrl.data import read_scores


def run(*args, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_clip, images):
    root = tmp_path_factory.mktemp("cli")
    image_root = Path(images[0]).parent  # img0.png, img1.png, img2.png
    stories = root / "stories.jsonl"
    lines = [
        {"story_id": "s1", "story": "The dog ran. The sky was blue. A car.", "images": images},
        {"story_id": "s2", "story": "A church. The bride smiled.", "image_ids": ["img0", "img1"]},
        {"story_id": "s3", "story": "Nothing to see.", "images": [str(root / "missing.png")]},
    ]
    stories.write_text("".join(json.dumps(x) + "\n" for x in lines))
    nps = root / "nps.json"
    nps.write_text(json.dumps({"s1": ["the dog", "the sky", "a car"], "s2": ["a church", "the bride"], "s3": ["the void"]}))
    groovist_dir = shared_path("groovist")
    common = [
        "--clip-model", tiny_clip, "--image-root", image_root, "--noun-phrases", nps,
        "--concreteness", groovist_dir / "concreteness_ratings.csv", "-q",
    ]
    env = {"STORYRL_CACHE": str(groovist_dir)}  # pronoun list from the "asset cache"
    return {"root": root, "stories": stories, "common": common, "env": env, "clip": tiny_clip}


def test_score_groovist_and_clipscore(setup, tmp_path):
    out, explain = tmp_path / "scores.csv", tmp_path / "explain.jsonl"
    result = run("score", setup["stories"], "-m", "groovist,clipscore", "-o", out, "--theta", "vwp",
                 "--regions", "grid", "--explain", explain, *setup["common"], env=setup["env"])
    assert result.exit_code == 0, result.output
    table = read_scores(out)
    assert table.metrics == ["groovist", "clipscore"] and table.ids == ["s1", "s2", "s3"]
    for metric in table.metrics:
        assert np.isfinite(table.scores[metric]["s1"]) and np.isfinite(table.scores[metric]["s2"])
        assert np.isnan(table.scores[metric]["s3"])  # missing image: unscorable, reported, no crash
    assert "unscorable: images" in result.output
    rows = [json.loads(line) for line in explain.read_text().splitlines()]
    assert [r["story_id"] for r in rows] == ["s1", "s2", "s3"]
    assert [p["phrase"] for p in rows[0]["phrases"]] == ["the dog", "the sky", "a car"]
    assert rows[0]["score"] == pytest.approx(table.scores["groovist"]["s1"], abs=1e-9)
    assert rows[2]["reason"].startswith("images")


def test_resume_and_config_with_overrides(setup, tmp_path):
    out = tmp_path / "scores.csv"
    config = REPO / "configs" / "rewards" / "groovist_bounded.yaml"
    first = run("score", setup["stories"], "--config", config, "-o", out, *setup["common"], env=setup["env"])
    assert first.exit_code == 0, first.output
    full = read_scores(out)
    assert abs(full.scores["groovist"]["s1"]) <= 1  # bounded (tanh) from the config
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")  # interrupted after s1
    again = run("score", setup["stories"], "--config", config, "-o", out, "--resume", *setup["common"], env=setup["env"])
    assert again.exit_code == 0, again.output
    resumed = read_scores(out)
    assert resumed.ids == full.ids and resumed.scores["groovist"]["s2"] == pytest.approx(full.scores["groovist"]["s2"])


def test_groovist_calibrate(setup):
    result = run("groovist-calibrate", setup["stories"], *setup["common"], env=setup["env"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["n_phrases"] == 5 and out["n_stories"] == 3 and out["n_unscorable"] == 1
    assert np.isfinite(out["theta"])


def test_bad_inputs_give_clear_errors(setup, tmp_path):
    bad_nps = tmp_path / "nps.json"
    bad_nps.write_text(json.dumps({"s1": ["a"]}))
    result = run("score", setup["stories"], "-m", "groovist", "-o", tmp_path / "o.csv",
                 "--noun-phrases", bad_nps, "--clip-model", setup["clip"])
    assert result.exit_code != 0 and "no entry for story 's2'" in result.output and str(bad_nps) in result.output
    result = run("score", setup["stories"], "-m", "repetition", "-o", tmp_path / "o2.csv", "--explain", tmp_path / "e")
    assert result.exit_code != 0 and "--explain" in result.output
    result = run("score", setup["stories"], "-m", "groovist", "-o", tmp_path / "o3.csv", "--theta", "imagenet")
    assert result.exit_code != 0 and "presets" in result.output


def test_regions_command_needs_weights(images, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # no cached checkpoint there
    result = run("regions", images[0], "-o", tmp_path / "regions.csv", "-q")
    assert result.exit_code != 0
    assert "fasterrcnn_resnet50_fpn_coco" in result.output and "--weights" in result.output


def test_assets_command(tmp_path, monkeypatch):
    result = run("assets", "not-an-asset")
    assert result.exit_code != 0 and "concreteness_ratings.csv" in result.output

    import storyrl.assets as assets

    def fake_download(names=None, dest=None, force=False):
        dest = Path(dest or assets.cache_dir())
        dest.mkdir(parents=True, exist_ok=True)
        paths = [dest / n for n in (names or assets.ASSETS)]
        for p in paths:
            p.write_text("x")
        return paths

    monkeypatch.setattr(assets, "download_assets", fake_download)
    monkeypatch.setenv("STORYRL_CACHE", str(tmp_path / "cache"))
    result = run("assets")
    assert result.exit_code == 0
    assert str(tmp_path / "cache" / "concreteness_ratings.csv") in result.output


@pytest.mark.parametrize("config", sorted((REPO / "configs" / "rewards").glob("*.yaml")), ids=lambda p: p.name)
def test_every_reward_config_loads(config):
    from storyrl.rewards import load_reward_config

    reward = load_reward_config(config)
    assert reward.name in config.name
