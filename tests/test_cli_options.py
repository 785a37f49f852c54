"""Command-line options generated from the config declarations (issue 9):
every declared reward option reaches its reward from the command line,
shared and per-reward spellings route as documented, a reward registered
later gets its options everywhere at once, and trainer options override the
YAML file."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.cli.reward_options import make_rewards
from storyrl.cli.score import score
from storyrl.config import Config, option, option_info
from storyrl.rewards import REWARDS, Reward, RewardConfig, register_reward

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "human.jsonl"
BUILTIN = ["repetition", "groovist", "clipscore", "coherence", "rovist_vg"]


def _flag(*parts: str) -> str:
    return "--" + "-".join(p.replace("_", "-") for p in parts)


def _other_value(info, tmp_path: Path):
    """A valid value that is not the option's default, as (command-line text,
    expected config value)."""
    if info.path in ("file", "any"):
        path = tmp_path / f"{info.name}.txt"
        path.write_text("image_id,bbox\n")  # read at creation only as a region table
        return str(path), str(path)
    if info.path == "dir":
        return str(tmp_path), str(tmp_path)
    if info.path == "new-dir":
        return str(tmp_path / "new"), str(tmp_path / "new")
    if info.choices:
        # Region sources "table" and "crops" would need a region table.
        choice = next(c for c in reversed(info.choices) if c not in (info.default, "table", "crops"))
        return choice, choice
    base = info.type
    if base is bool:
        return None, not info.default
    if base == float | str:  # GROOViST's theta: given as text
        return "0.5", "0.5"
    if base in (int, int | None):
        value = (info.default if isinstance(info.default, int) else info.min or 1) + 1
        return str(value), value
    if base in (float, float | None):
        return "0.25", 0.25
    return "some-value", "some-value"


def _info(reward: str, name: str):
    return next(i for i in option_info(REWARDS.get(reward).config_class) if i.name == name)


def _parse(args: list[str]) -> dict:
    """The parameters `storyrl score` gets for ``args`` (parsing only)."""
    return score.make_context("score", [str(EXAMPLE), "-o", "out.csv", *args]).params


@pytest.mark.parametrize("reward", BUILTIN)
def test_every_declared_option_reaches_its_reward_from_the_command_line(reward, tmp_path):
    """Break tried: dropping the prefixed spelling for shared options, and
    routing shared options only to the first reward declaring them."""
    infos = [i for i in option_info(REWARDS.get(reward).config_class) if i.cli]
    flags = {f for p in score.get_params(score.make_context("score", ["--help"], resilient_parsing=True)) for f in p.opts}
    assert infos
    for info in infos:
        text, expected = _other_value(info, tmp_path)
        assert _flag(reward, info.name) in flags
        for flag in (_flag(reward, info.name), _flag(info.name)):
            if flag not in flags or flag == "--batch-size":
                continue  # no shared spelling (e.g. --model: a file for one reward, a directory for another),
                # or score's own --batch-size
            args = [flag, text] if text is not None else [flag if expected else f"--no-{flag[2:]}"]
            if info.name == "crops_dir":  # crops are named by the table's boxes: it needs one
                args += ["--region-table", _other_value(_info(reward, "region_table"), tmp_path)[0]]
            values = _parse(args)
            (made,) = make_rewards([reward], (), {k: v for k, v in values.items() if k not in _OWN})
            assert getattr(made.args, info.name) == expected, (flag, info.name)


_OWN = {p.name for p in score.params}


# The hand-kept options before issue 9: each must still be accepted.
OLD_OPTIONS = [
    "--image-root", "--image-ids", "--regions", "--region-table", "--crops-dir", "--top-b", "--clip-model",
    "--clip-pretrained", "--device", "--precision", "--theta", "--spacy-pipeline", "--noun-phrases",
    "--concreteness", "--cache-dir", "--coherence-model", "--trust-checkpoint", "--no-trust-checkpoint", "--mode",
    "--rovist-vg-model", "--glove", "--idf-corpus",
]


@pytest.mark.parametrize("command", ["score", "groovist-calibrate"])
def test_the_old_option_names_still_exist(command):
    cmd = main.get_command(None, command)
    flags = {f for p in cmd.get_params(cmd.make_context(command, ["--help"], resilient_parsing=True))
             for f in (*p.opts, *p.secondary_opts)}
    assert not [o for o in OLD_OPTIONS if o not in flags]


def test_per_reward_spelling_wins_over_the_shared_one():
    values = _parse(["--top-b", "3", "--rovist-vg-top-b", "5", "--precision", "fp32"])
    groovist, rovist_vg = make_rewards(["groovist", "rovist_vg"], (), {k: v for k, v in values.items() if k not in _OWN})
    assert (groovist.top_b, rovist_vg.top_b) == (3, 5)
    assert groovist.precision == rovist_vg.precision == "fp32"


def test_command_line_values_are_validated_by_the_config():
    result = CliRunner().invoke(main, ["score", str(EXAMPLE), "-m", "repetition", "-o", "o.csv", "--chunk-size", "0"])
    assert result.exit_code == 2 and "--chunk-size" in result.output  # usage error, nothing run
    result = CliRunner().invoke(main, ["score", str(EXAMPLE), "-m", "groovist", "-o", "o.csv", "--theta", "mars"])
    assert result.exit_code == 1 and "reward 'groovist': theta: unknown theta preset 'mars'" in result.output


@dataclass
class _KnobConfig(RewardConfig):
    knob: float = option(1.0, "The score every story gets.")


@register_reward()
class _Knob(Reward):
    """Test reward: every story scores `knob`."""

    name = "test_knob"
    config_class = _KnobConfig

    def _score_batch(self, stories, **context):
        return np.full(len(stories), self.knob)


def test_a_new_reward_option_appears_everywhere_at_once(tmp_path):
    """Declared once on _KnobConfig: it is in `score --help`, in
    `storyrl rewards test_knob`, in YAML configs and on the command line."""
    runner = CliRunner()
    assert "--knob" in runner.invoke(main, ["score", "--help"]).output
    assert "knob" in runner.invoke(main, ["rewards", "test_knob"]).output
    config = tmp_path / "knob.yaml"
    config.write_text("reward: test_knob\nknob: 0.5\n")
    for args, expected in [(["-m", "test_knob", "--knob", "2.5"], 2.5), (["--config", str(config)], 0.5),
                           (["--config", str(config), "--test-knob-knob", "3"], 3.0)]:
        out = tmp_path / f"{expected}.csv"
        result = runner.invoke(main, ["score", str(EXAMPLE), *args, "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        with out.open(newline="") as fh:
            values = [float(row["test_knob"]) for row in csv.DictReader(fh)]
        assert values and all(math.isclose(v, expected) for v in values)


# -- trainers ---------------------------------------------------------------------------


@dataclass
class _ToyTrainConfig(Config):
    _field_word = "key"
    output_dir: str = option(help="Output.", path="new-dir")
    lr: float = option(0.1, "Learning rate.")
    epochs: int = option(3, "Epochs.", min=1)
    names: list[str] = option(factory=list, help="Names.")


def test_trainer_options_are_generated_and_override_the_file(tmp_path):
    from storyrl.training import TRAINERS, Trainer
    from storyrl.training.loop import FitResult

    seen = {}

    def train(config, resume=False, progress=True):
        seen.update(config=config, resume=resume)
        return FitResult(best_epoch=1, best_val_loss=0.5, epochs_run=config.epochs, stopped_early=False)

    TRAINERS.add("test_toy", Trainer(_ToyTrainConfig, train), "A toy trainer for tests.")
    path = tmp_path / "toy.yaml"
    path.write_text(f"output_dir: {tmp_path / 'run'}\nlr: 0.01\nnames: [a]\n")
    runner = CliRunner()
    assert "test_toy" in runner.invoke(main, ["train", "--help"]).output
    help_text = runner.invoke(main, ["train", "test_toy", "--help"]).output
    assert all(f"--{i.name.replace('_', '-')}" in help_text for i in option_info(_ToyTrainConfig))
    result = runner.invoke(main, ["train", "test_toy", "--config", str(path), "--epochs", "2",
                                  "--names", "x", "--names", "y", "--resume", "-q"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.lr, config.epochs, config.names, seen["resume"]) == (0.01, 2, ["x", "y"], True)
    assert '"epochs_run": 2' in result.output
    result = runner.invoke(main, ["train", "test_toy", "--config", str(path), "--epochs", "0"])
    assert result.exit_code == 2 and "--epochs" in result.output
    path.write_text("lr: 0.01\n")
    result = runner.invoke(main, ["train", "test_toy", "--config", str(path)])
    assert result.exit_code == 1 and f"{path}: _ToyTrainConfig: missing required key(s) 'output_dir'" in result.output
