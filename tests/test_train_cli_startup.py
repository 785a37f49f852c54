"""`storyrl train <name>` answers before importing torch, transformers or TRL
(issue 31 item 12): `--help`, a bad option, a config error and a second run
on a locked output directory. Which modules a command imported is read from
``sys.modules`` in a fresh process; how long it takes is
benchmarks/cli_startup.py's business, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from storyrl.config import option_info
from storyrl.training import TRAINERS
from storyrl.training.runs import lock_directory

HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")

# Runs each case's command line in turn in one process, recording after each
# which heavy libraries are imported by then (a case that imports one leaves
# it there for the next: the first case that imports it is the one at fault).
_CASES = r"""
import contextlib, io, json, sys
from storyrl.cli import main
cases, seen = json.loads(sys.argv[1]), {}
for name, args in cases.items():
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main.main(args=args, prog_name="storyrl")
            code = 0
        except SystemExit as exc:
            code = exc.code
    heavy = [m for m in HEAVY if m in sys.modules]
    seen[name] = {"exit": code, "heavy": heavy, "stdout": out.getvalue()[-600:], "stderr": err.getvalue()[-600:]}
print(json.dumps(seen))
""".replace("HEAVY", repr(HEAVY))


def _locked_config(tmp_path, name: str, output_dir) -> dict:
    """A config whose output_dir is locked; its required keys name a dummy
    file or directory, ``model`` a local model directory (telling a local
    policy's kind when the config is checked imports transformers)."""
    dummy, folder, model = tmp_path / "dummy.json", tmp_path / "folder", tmp_path / "model"
    dummy.write_text("{}\n")
    folder.mkdir(exist_ok=True)
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    values = {"output_dir": str(output_dir)}
    for info in option_info(TRAINERS.get(name).config_class):
        if info.name == "model":
            values["model"] = str(model)
        elif info.required and info.name not in values:
            values[info.name] = str(folder) if info.path == "dir" else ["repetition"] if info.name == "rewards" \
                else [str(dummy)] if str(info.type).startswith("list") else str(dummy)
    return values


def _run_cases(tmp_path, name: str) -> dict:
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    run_dir = tmp_path / "run"
    locked = tmp_path / "locked.yaml"
    locked.write_text(json.dumps(_locked_config(tmp_path, name, run_dir)))
    cases = {"help": ["train", name, "--help"], "bad_option": ["train", name, "--no-such-option"],
             "config_error": ["train", name, "--config", str(bad)],
             "locked": ["train", name, "--config", str(locked)]}
    with lock_directory(run_dir):  # a run in progress on it
        done = subprocess.run([sys.executable, "-c", _CASES, json.dumps(cases)], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("STORYRL_DEBUG", "STORYRL_VERBOSE")}
    return {**env, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("name", TRAINERS.names())
def test_train_answers_before_importing_model_libraries(tmp_path, name):
    seen = _run_cases(tmp_path, name)
    assert seen["help"]["exit"] == 0 and "Show this message and exit." in seen["help"]["stdout"]
    assert seen["bad_option"]["exit"] == 2 and "no-such-option" in seen["bad_option"]["stderr"]
    assert seen["config_error"]["exit"] == 1 and "no_such_key" in seen["config_error"]["stderr"]
    assert seen["locked"]["exit"] == 1 and "in use by another run" in seen["locked"]["stderr"], seen["locked"]
    assert {case: s["heavy"] for case, s in seen.items()} == dict.fromkeys(seen, [])


def test_the_trainer_list_imports_no_trainer(tmp_path):
    done = subprocess.run([sys.executable, "-c", _CASES, json.dumps({"list": ["train", "--help"]})],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=_env())
    seen = json.loads(done.stdout.splitlines()[-1])["list"]
    assert seen["exit"] == 0 and seen["heavy"] == []


def _run_config(tmp_path, name: str, values: dict) -> dict:
    """``storyrl train NAME --config`` a file of ``values``, in a fresh process."""
    path = tmp_path / f"{name}_config.yaml"
    path.write_text(json.dumps(values))
    done = subprocess.run([sys.executable, "-c", _CASES, json.dumps({"run": ["train", name, "--config", str(path)]})],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])["run"]


@pytest.mark.parametrize("name", ["sft", "rl"])
def test_a_missing_data_file_is_reported_before_importing_model_libraries(tmp_path, name):
    # The config names a local model: telling its kind (transformers) is only
    # needed for a visual setting, and RL's TRL config only once the rest is right.
    values = {**_locked_config(tmp_path, name, tmp_path / "run"), "data": str(tmp_path / "missing.json")}
    seen = _run_config(tmp_path, name, values)
    assert seen["exit"] == 1 and "no such file" in seen["stderr"] and "missing.json" in seen["stderr"], seen
    assert seen["heavy"] == []


@pytest.mark.parametrize("key, value", [("async_rewards", "yes"), ("limit", "3")])
def test_rl_top_level_type_error_is_reported_before_importing_trl(tmp_path, key, value):
    seen = _run_config(tmp_path, "rl", {**_locked_config(tmp_path, "rl", tmp_path / "run"), key: value})
    assert seen["exit"] == 1 and repr(key) in seen["stderr"], seen
    assert seen["heavy"] == []


def test_a_ppo_run_config_imports_no_trl(tmp_path):
    values = {**_locked_config(tmp_path, "rl", tmp_path / "run"), "algorithm": "ppo", "policy": "causal_lm",
              "ppo": {"learning_rate": 1e-5}}
    code = ("import json, sys\nfrom storyrl.training.storyteller.rl.config import RLConfig\n"
            "config = RLConfig.from_mapping(json.loads(sys.argv[1]))\n"
            "print(json.dumps([type(config.ppo).__name__, config.ppo.learning_rate, 'trl' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(values)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["PPOConfig", 1e-5, False]


def test_rovist_vg_trainer_default_backbone_is_the_models():
    # storyrl.training.judges.rovist_vg spells the default ViT out (the model module imports torch)
    from storyrl.models.rovist_vg import DEFAULT_VIT
    from storyrl.training.judges.rovist_vg import DEFAULT_VIT as TRAINER_DEFAULT, RovistVGTrainConfig

    assert TRAINER_DEFAULT == DEFAULT_VIT == RovistVGTrainConfig.__dataclass_fields__["vit"].default
