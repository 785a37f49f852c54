"""Offline hub: a model that must be downloaded from an unreachable hub is a
one-line error naming it, at once, before any download is tried (issue 21
item 2). No test touches the network: the probe is monkeypatched."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from PIL import Image

from storyrl.cli import main
from storyrl.models import hub


@pytest.fixture
def probe(monkeypatch):
    """The reachability probe, counted; answers False (no network)."""
    calls = []

    def fake(url, timeout=hub.PROBE_TIMEOUT_S):
        calls.append(url)
        return False

    monkeypatch.setattr(hub, "_probe", fake)
    hub._reset()
    yield calls
    hub._reset()


def test_offline_env_fails_at_once_naming_the_model(monkeypatch, probe):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubUnreachableError, match=r"model 'nobody/no-such-model' is not in the local .*"
                                                      r"HF_HUB_OFFLINE is set: use X"):
        hub.require_hub_model("nobody/no-such-model", hint="use X")
    assert probe == []  # HF_HUB_OFFLINE is honoured without a probe


def test_unreachable_hub_is_probed_once_per_process(monkeypatch, probe):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    for _ in range(3):
        with pytest.raises(hub.HubUnreachableError, match="cannot be reached"):
            hub.require_hub_model("nobody/no-such-model")
    assert len(probe) == 1


def test_the_probe_connects_to_the_proxy_when_one_is_set(monkeypatch):
    seen = []

    def connect(address, timeout):
        seen.append(address)
        raise OSError("no network in tests")

    monkeypatch.setattr(hub.socket, "create_connection", connect)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    assert hub._probe("https://huggingface.co") is False
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.local:3128")
    assert hub._probe("https://huggingface.co") is False
    assert seen == [("huggingface.co", 443), ("proxy.local", 3128)]


def test_local_paths_and_cached_repos_pass_offline(monkeypatch, probe, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.require_hub_model(str(tmp_path))  # a local directory
    snapshot = tmp_path / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(hub, "_cache_dir", lambda: tmp_path)
    hub.require_hub_model("org/cached")
    hub.require_hub_model("hf-hub:org/cached")
    with pytest.raises(hub.HubUnreachableError):
        hub.require_hub_model("org/not-cached")


def test_hub_ids_of_timm_and_open_clip_models():
    assert hub.timm_hub_id("hf-hub:timm/resnet50.a1_in1k") == "timm/resnet50.a1_in1k"
    assert hub.timm_hub_id("resnet50", {"file": "/w.pth"}) is None
    assert hub.open_clip_hub_id("hf-hub:org/clip", None) == "org/clip"
    assert hub.open_clip_hub_id("ViT-B-32", None) is None


def _one_error(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_generate_offline_names_the_model_and_loads_nothing(monkeypatch, probe, tmp_path):
    import transformers

    loads = []
    for cls in (transformers.AutoProcessor, transformers.AutoModelForImageTextToText):
        monkeypatch.setattr(cls, "from_pretrained", lambda *a, **k: loads.append(a) or 1 / 0)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "x", "image_ids": ["i0"]}) + "\n")
    out = tmp_path / "o.json"
    result = CliRunner().invoke(main, ["generate", "-m", "nobody/no-such-vlm", "-d", str(data), "-o", str(out), "-q"],
                                env={"HF_HUB_OFFLINE": "1"})
    line = _one_error(result)
    assert "'nobody/no-such-vlm'" in line and "--model DIR" in line
    assert loads == [] and probe == []
    assert not out.exists()


def test_features_offline_names_the_backbone_and_suggests_no_pretrained(monkeypatch, probe, tmp_path):
    import storyrl  # noqa: F401  (torchvision fallback before timm)
    import timm

    creates = []
    real = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda *a, **k: creates.append(k.get("pretrained")) or real(*a, **k))
    Image.new("RGB", (8, 8)).save(tmp_path / "i0.jpg")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "x", "images": [str(tmp_path / "i0.jpg")]}) + "\n")
    args = ["features", "--data", str(data), "-o", str(tmp_path / "feat"), "--backbone", "resnet18", "-q",
            "--device", "cpu"]
    line = _one_error(CliRunner().invoke(main, args, env={"HF_HUB_OFFLINE": "1"}))
    assert "timm backbone 'resnet18'" in line and "timm/resnet18" in line and "--no-pretrained" in line
    assert creates == [] and probe == []
    # --no-pretrained needs no hub
    assert CliRunner().invoke(main, [*args, "--no-pretrained"], env={"HF_HUB_OFFLINE": "1"}).exit_code == 0
    assert creates == [False]


def test_groovist_calibrate_offline_fails_before_any_work(monkeypatch, probe, tmp_path):
    import open_clip

    creates = []
    monkeypatch.setattr(open_clip, "create_model_and_transforms", lambda *a, **k: creates.append(a) or 1 / 0)
    calibrations = []
    monkeypatch.setattr("storyrl.rewards.groovist.calibrate_theta", lambda *a, **k: calibrations.append(a) or 1 / 0)
    Image.new("RGB", (8, 8)).save(tmp_path / "i0.jpg")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"story_id": "s0", "story": "A dog.", "images": [str(tmp_path / "i0.jpg")]}) + "\n")
    (tmp_path / "nps.json").write_text(json.dumps({"s0": ["a dog"]}))
    (tmp_path / "pronouns.txt").write_text("he\n")
    args = ["groovist-calibrate", str(data), "--noun-phrases", str(tmp_path / "nps.json"),
            "--pronouns", str(tmp_path / "pronouns.txt"), "--weighting", "none"]
    line = _one_error(CliRunner().invoke(main, args, env={"HF_HUB_OFFLINE": "1"}))
    assert "CLIP model 'ViT-B-32' (pretrained='openai')" in line and "--clip-pretrained FILE" in line
    assert creates == [] and probe == [] and calibrations == []  # checked at setup, before the calibration starts


@pytest.mark.parametrize("value", ["true", "yes", "on", "ON", "True", " 1 "])
def test_offline_env_spellings_set_at_runtime_skip_the_probe(monkeypatch, value):
    # huggingface_hub reads HF_HUB_OFFLINE once at import; a value set later must still count
    calls = []
    monkeypatch.setattr(hub, "_probe", lambda url, timeout=hub.PROBE_TIMEOUT_S: calls.append(url) or True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    hub._reset()
    try:
        assert hub.hub_reachable() is False
        assert calls == []
    finally:
        hub._reset()


def test_an_empty_snapshot_directory_is_not_cached(monkeypatch, probe, tmp_path):
    # an interrupted download leaves the folders without files: the model is not there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "models--org--name"
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub, "_cache_dir", lambda: tmp_path)
    assert hub.in_cache("org/name") is False
    with pytest.raises(hub.HubUnreachableError, match="'org/name'"):
        hub.require_hub_model("org/name")
    (folder / "snapshots" / "abc123" / "config.json").write_text("{}")
    assert hub.in_cache("org/name") is True
    hub.require_hub_model("org/name")


def test_open_clip_hub_id_is_the_repo_not_the_file():
    # open_clip's hf_hub for ViTamin-S/datacomp1b is "jienengchen/ViTamin-S/pytorch_model.bin"
    import storyrl  # noqa: F401  (torchvision fallback before open_clip)

    assert hub.open_clip_hub_id("ViTamin-S", "datacomp1b") == "jienengchen/ViTamin-S"
    assert hub.open_clip_hub_id("ViT-B-32", "openai") == "timm/vit_base_patch32_clip_224.openai"


def test_timm_hub_id_drops_the_revision():
    assert hub.timm_hub_id("hf-hub:org/name@rev") == "org/name"
    assert hub.timm_hub_id("hf_hub:org/name@v1.0") == "org/name"
    assert hub.timm_hub_id("hf-hub:org/name") == "org/name"
