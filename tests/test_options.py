"""Strict option types (issue 8): reward options and training configs are
checked against their declared types, never converted, from Python, YAML and
the command line alike."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal

import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.config import ConfigFileError, check_type, load_yaml, option_info
from storyrl.rewards import create_reward, get_reward_class, load_reward_config
from storyrl.rewards.repetition import Repetition

BUILTIN = ["repetition", "groovist", "clipscore", "coherence", "rovist_vg"]
# A wrong value per declared type: what bool()/int() conversion would accept.
WRONG = {bool: "false", int: True, float: "0.5", str: 1}


def _declared_options(cls) -> list[tuple[str, object]]:
    """(option, declared scalar type) of the reward's config dataclass."""
    found = []
    for info in option_info(cls.config_class):
        scalar = [t for t in typing.get_args(info.type) or (info.type,) if t in WRONG]
        if scalar:
            found.append((info.name, scalar[0]))
    return found


@pytest.mark.parametrize("reward", BUILTIN)
def test_every_declared_option_rejects_a_wrong_type(reward):
    cls = get_reward_class(reward)
    options = _declared_options(cls)
    assert options, reward
    for name, tp in options:
        if reward == "groovist" and name == "theta":
            continue  # a number or a preset name (a string): both types are right
        with pytest.raises(TypeError, match=rf"reward '{reward}': option '{name}'"):
            create_reward(reward, **{name: WRONG[tp]})


def test_the_dangerous_cases_of_the_issue():
    with pytest.raises(TypeError, match="option 'trust_checkpoint': expected true/false, got str 'false'"):
        create_reward("coherence", trust_checkpoint="false")
    for reward, option in [("groovist", "bounded"), ("groovist", "penalty"), ("rovist_vg", "scaled")]:
        with pytest.raises(TypeError, match=f"option '{option}'"):
            create_reward(reward, **{option: "false"})
    with pytest.raises(TypeError, match="option 'chunk_size': expected an integer, got bool True"):
        create_reward("repetition", chunk_size=True)
    with pytest.raises(TypeError, match="option 'chunk_size'"):
        Repetition(chunk_size=4.0)  # the class itself, not only the factory


def test_right_types_pass_unchanged():
    assert create_reward("repetition", chunk_size=3).chunk_size == 3
    reward = create_reward("groovist", bounded=True, penalty=False, theta=0.6, top_b=5, cache_dir=Path("c"))
    assert reward.bounded is True and reward.penalty is False and reward.theta == 0.6
    assert reward.cache_dir == "c"  # a Path is a path string
    assert create_reward("groovist", theta=1).theta == 1.0  # an int is a number


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("reward: coherence\ntrust_checkpoint: 'false'\n", "trust_checkpoint"),
        ("reward: groovist\nbounded: 'no'\n", "bounded"),
        ("reward: groovist\npenalty: 'false'\n", "penalty"),
        ("reward: rovist_vg\nscaled: 'true'\n", "scaled"),
        ("reward: repetition\nchunk_size: true\n", "chunk_size"),
        ("reward: repetition\nchunk_size: '4'\n", "chunk_size"),
        ("reward: groovist\ntop_b: 2.5\n", "top_b"),
    ],
)
def test_yaml_and_command_line_name_the_file_and_key(tmp_path, yaml_text, key):
    path = tmp_path / "reward.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError) as info:
        load_reward_config(path)
    assert str(path) in str(info.value) and repr(key) in str(info.value)
    out = tmp_path / "o.csv"
    stories = Path(__file__).resolve().parents[1] / "examples" / "human.jsonl"
    result = CliRunner().invoke(main, ["score", str(stories), "--config", str(path), "-o", str(out), "-q"])
    assert result.exit_code == 1 and not out.exists()
    assert str(path) in result.output and repr(key) in result.output and "Traceback" not in result.output


def test_check_type_rules():
    assert check_type(None, int | None) is None
    assert check_type(2, float) == 2.0 and isinstance(check_type(2, float), float)
    assert check_type(["a", Path("b")], list[str]) == ["a", "b"]
    assert check_type({"x": 1}, dict[str, float]) == {"x": 1.0}
    assert check_type("adjacent", Literal["prefix", "adjacent"]) == "adjacent"
    assert check_type((1, 2), tuple[int, ...]) == (1, 2)
    for value, tp in [
        ("1", int), (1.0, int), (True, int), (True, float), ("true", bool), (1, bool), (0, bool),
        (1, str), ("ab", list[str]), ([1], list[str]), ({"x": "1"}, dict[str, float]),
        ("random", Literal["prefix", "adjacent"]), (None, int), ((1, 2, 3), tuple[int, int]),
    ]:
        with pytest.raises(TypeError):
            check_type(value, tp)


def test_load_yaml_reads_yaml12_floats_and_names_bad_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-5\nwd: -2E+3\nversion: 1.0\nname: '1e-5'\nn: 12\n")
    assert load_yaml(path) == {"lr": 1e-5, "wd": -2000.0, "version": 1.0, "name": "1e-5", "n": 12}
    path.write_text("a: [1, 2\n")
    with pytest.raises(ConfigFileError, match=rf"{path}: invalid YAML at line \d"):
        load_yaml(path)
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_yaml(tmp_path / "missing.yaml")


def test_training_configs_are_strict_in_python_too():
    from storyrl.training.judges.coherence import CoherenceTrainConfig

    with pytest.raises(TypeError, match="key 'epochs': expected an integer, got str '3'"):
        CoherenceTrainConfig(output_dir="o", stories=["a"], epochs="3")
    with pytest.raises(TypeError, match="key 'stories'"):
        CoherenceTrainConfig(output_dir="o", stories="a.json")
    assert CoherenceTrainConfig(output_dir="o", stories=["a"], lr=1).lr == 1.0


def test_every_reward_declares_its_options_in_its_own_config():
    # Options are validated by the reward's config dataclass wherever the
    # reward is created; an undeclared option is refused, not ignored.
    from storyrl.config import Config

    for name in BUILTIN:
        cls = get_reward_class(name)
        assert issubclass(cls.config_class, Config) and "config_class" in cls.__dict__, name
        with pytest.raises(TypeError, match=f"reward '{name}': bad configuration: unknown option 'bogus'"):
            cls(bogus=1)
