"""docs/extending/adding_a_trainer.md, run as written: its module code and
its registry line are read from the page and executed (the module under the
name its ``TRAINERS.add`` line gives), with a stand-in for the TRL training
inside ``train``, and the trainer is driven through ``storyrl train sft`` as
a user would."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

import storyrl.training
from storyrl.cli import main
from storyrl.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending" / "adding_a_trainer.md"


def page_blocks() -> list[str]:
    """The page's Python blocks: the module, then the registry line."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    assert len(blocks) == 2, f"{PAGE}: expected the module and the TRAINERS.add line, found {len(blocks)} blocks"
    return blocks


def registered_module(registry_line: str) -> str:
    """The module the page's ``TRAINERS.add`` line names (``pkg.mod:TRAINER`` -> ``pkg.mod``)."""
    [target] = re.findall(r'TRAINERS\.add\("\w+", "([\w.]+):TRAINER"', registry_line)
    return target


def test_the_page_puts_the_trainer_where_storyrl_keeps_it():
    """The example's file (its first line) is the module its registry line
    names, and storyrl registers its own sft trainer there: a page left behind
    by a move of the trainers fails here."""
    module_code, registry_line = page_blocks()
    name = registered_module(registry_line)
    assert module_code.splitlines()[0] == f"# {name.replace('.', '/')}.py"
    assert (ROOT / f"{name.replace('.', '/')}.py").is_file()
    assert f'"{name}:TRAINER"' in (ROOT / "storyrl" / "training" / "__init__.py").read_text(encoding="utf-8")


@pytest.fixture
def sft(monkeypatch):
    """The page's module under the name its registry line gives (train
    replaced by a stand-in that records its call) and a registry holding
    what the page's TRAINERS.add line registers."""
    module_code, registry_line = page_blocks()
    name = registered_module(registry_line)
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # before exec: dataclasses look the module up
    exec(compile(module_code, str(PAGE), "exec"), module.__dict__)  # noqa: S102  (the page's own code)
    calls = []

    def stand_in(config, resume=False, progress=True):
        calls.append({"config": config, "resume": resume, "progress": progress})
        return module.SFTResult(config.output_dir, config.max_steps)

    module.TRAINER = dataclasses.replace(module.TRAINER, train=stand_in)
    registry = Registry("trainer")
    exec(compile(registry_line, str(PAGE), "exec"), {"TRAINERS": registry})  # noqa: S102
    monkeypatch.setattr(storyrl.training, "TRAINERS", registry)
    return module, calls


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_page_trainer_is_a_storyrl_train_command(sft, tmp_path):
    module, calls = sft
    runner = CliRunner()
    listing = flat(runner.invoke(main, ["train", "--help"]).output)
    assert "sft Supervised fine-tuning of a storyteller on human stories." in listing
    help_text = flat(runner.invoke(main, ["train", "sft", "--help"]).output)
    # what the Trainer entry says, not fit's layout
    assert "Checkpoints OUTPUT_DIR/checkpoint-<step> and the model in OUTPUT_DIR/final." in help_text
    assert "Training config YAML (configs/sft/<name>.yaml)." in help_text
    assert "Continue from the latest OUTPUT_DIR/checkpoint-<step>." in help_text
    assert "OUTPUT_DIR/best" not in help_text
    assert all(f"--{o}" in help_text for o in ("model", "data", "output-dir", "max-steps", "learning-rate"))

    data = tmp_path / "stories.jsonl"
    data.write_text(json.dumps({"story_id": "s1", "story": "We went to the sea."}) + "\n", encoding="utf-8")
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: tiny\ndata: {data}\noutput_dir: {tmp_path / 'run'}\nlearning_rate: 0.001\n",
                      encoding="utf-8")
    result = runner.invoke(main, ["train", "sft", "--config", str(config), "--max-steps", "7", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == {"output_dir": str(tmp_path / "run"), "steps": 7}
    [call] = calls
    assert isinstance(call["config"], module.SFTRunConfig)
    assert (call["config"].learning_rate, call["config"].max_steps) == (0.001, 7)  # the file, then the option
    assert (call["resume"], call["progress"]) == (False, False)

    result = runner.invoke(main, ["train", "sft", "--config", str(config), "--max-steps", "0"])
    assert result.exit_code == 2 and "--max-steps" in result.output  # the option's bound, from the dataclass


def test_a_result_without_summary_is_refused_in_one_line(sft, tmp_path):
    module, _ = sft
    module.TRAINER = dataclasses.replace(module.TRAINER, train=lambda config, resume=False, progress=True: {"steps": 1})
    data = tmp_path / "stories.jsonl"
    data.write_text(json.dumps({"story_id": "s1", "story": "We went to the sea."}) + "\n", encoding="utf-8")
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: tiny\ndata: {data}\noutput_dir: {tmp_path / 'run'}\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["train", "sft", "--config", str(config), "-q"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: trainer sft: its train function returned dict, which has no summary() (storyrl.training.TrainResult)"]
