"""The one config mechanism (issue 9): options declared once on a Config
dataclass give validation from Python and YAML, nested configs (storyrl's and
TRL's), to_dict/to_yaml, and the reward's config(), repr and attributes."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, make_dataclass

import pytest

from storyrl.config import REQUIRED, Config, option, option_info
from storyrl.rewards import create_reward
from storyrl.rewards.groovist import GROOViST, GROOViSTConfig
from storyrl.rewards.repetition import Repetition, RepetitionConfig


@dataclass
class Inner(Config):
    size: int = option(2, "A size.", min=1, max=8)


@dataclass
class Outer(Config):
    name: str = option(help="Required name.")
    mode: str = option("a", "A mode.", choices=("a", "b"))
    rate: float = option(0.5, "A rate.", min=0.0)
    tags: list[str] = option(factory=list, help="Tags.")
    inner: Inner = option(factory=Inner, help="Nested.")

    def _problems(self) -> list[str]:
        return ["name must not be 'bad'"] if self.name == "bad" else []


def test_declarations_are_introspectable():
    infos = {i.name: i for i in option_info(Outer)}
    assert list(infos) == ["name", "mode", "rate", "tags", "inner"]
    assert infos["name"].required and infos["name"].default is REQUIRED and infos["name"].help == "Required name."
    assert infos["mode"].choices == ("a", "b") and infos["rate"].type is float and infos["tags"].type == list[str]
    assert infos["tags"].default == [] and isinstance(infos["inner"].default, Inner)


def test_values_are_checked_and_every_problem_listed():
    with pytest.raises(TypeError, match="Outer: option 'rate': expected a number, got str '0.1'"):
        Outer(name="x", rate="0.1")
    with pytest.raises(ValueError) as info:
        Outer(name="bad", mode="c", rate=-1)
    message = str(info.value)
    assert message.startswith("Outer: ") and "mode must be one of a, b, got 'c'" in message
    assert "rate must be >= 0.0, got -1.0" in message and "name must not be 'bad'" in message
    with pytest.raises(ValueError, match="size must be <= 8, got 9"):
        Inner(size=9)
    assert Outer(name="x", rate=1).rate == 1.0  # an int is a number


def test_nested_configs_come_from_mappings_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: n\ninner: {size: 4}\ntags: [x, y]\n")
    config = Outer.from_yaml(path, mode="b", rate=None)  # None: an unset override
    assert config.inner == Inner(size=4) and config.mode == "b" and config.rate == 0.5 and config.tags == ["x", "y"]
    config.to_yaml(tmp_path / "back.yaml")
    assert Outer.from_yaml(tmp_path / "back.yaml") == config
    path.write_text("name: n\ninner: {size: 0}\n")
    with pytest.raises(ValueError, match=rf"{path}: .*size must be >= 1"):
        Outer.from_yaml(path)
    path.write_text("name: n\ninner: {sise: 3}\n")
    with pytest.raises(ValueError, match=rf"{path}: .*unknown option 'sise'; valid options: size"):
        Outer.from_yaml(path)
    path.write_text("mode: a\n")
    with pytest.raises(ValueError, match=rf"{path}: Outer: missing required option\(s\) 'name'"):
        Outer.from_yaml(path)


def test_a_trl_config_embeds_and_is_built_from_yaml(tmp_path):
    # The seam for the RL configs: TRL's GRPOConfig as a field, set from YAML.
    import storyrl  # noqa: F401  # torchvision fallback before trl
    from trl import GRPOConfig

    # make_dataclass: real (not string) annotations for a class local to a test.
    RLConfig = make_dataclass("RLConfig", [
        ("reward", str, option("repetition", "Reward name.")),
        ("grpo", GRPOConfig | None, option(None, "TRL's GRPO settings.", cli=False)),
    ], bases=(Config,))

    path = tmp_path / "rl.yaml"
    path.write_text(
        f"grpo:\n  output_dir: {tmp_path}\n  learning_rate: 1e-6\n  num_generations: 4\n"
        "  use_cpu: true\n  bf16: false\n  report_to: none\n"
    )
    config = RLConfig.from_yaml(path)
    assert isinstance(config.grpo, GRPOConfig)
    assert config.grpo.learning_rate == 1e-6 and config.grpo.num_generations == 4
    path.write_text(f"grpo:\n  output_dir: {tmp_path}\n  learning_rat: 1e-6\n")
    with pytest.raises(ValueError, match=rf"{path}: .*'grpo': GRPOConfig: .*learning_rat"):
        RLConfig.from_yaml(path)


def test_reward_options_come_from_its_config():
    reward = create_reward("groovist", theta="vwp", bounded=True, top_b=4)
    assert isinstance(reward.args, GROOViSTConfig) and reward.args.theta == "vwp"
    assert reward.theta == pytest.approx(0.6193549522736276)  # derived value wins over the setting
    assert reward.bounded is True and reward.top_b == 4  # options read as attributes
    config = reward.config()
    assert config == reward.args.to_dict() and config["theta"] == "vwp" and config["top_b"] == 4
    assert set(config) == {i.name for i in option_info(GROOViSTConfig)}
    assert repr(reward).startswith("GROOViST(") and "theta='vwp'" in repr(reward)
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.config() == config and clone.theta == reward.theta
    with pytest.raises(AttributeError):
        reward.no_such_option  # noqa: B018


def test_a_config_object_or_options_not_both():
    assert Repetition(RepetitionConfig(chunk_size=3)).chunk_size == 3
    with pytest.raises(TypeError, match="give a RepetitionConfig or keyword options"):
        Repetition(RepetitionConfig(), chunk_size=2)
    with pytest.raises(TypeError, match="give a RepetitionConfig"):
        Repetition(GROOViSTConfig())


def test_errors_name_the_reward_when_built_from_options_and_the_config_class_otherwise():
    with pytest.raises(ValueError, match="^reward 'groovist': units must be one of noun_phrases, nouns, got 'x'$"):
        GROOViST(units="x")
    with pytest.raises(ValueError, match="^GROOViSTConfig: units must be one of"):
        GROOViSTConfig(units="x")
    with pytest.raises(ValueError, match="reward 'groovist': theta: unknown theta preset 'mars'"):
        create_reward("groovist", theta="mars")
