"""The one config mechanism (issue 9): options declared once on a Config
dataclass give validation from Python and YAML, nested configs (storyrl's and
TRL's), to_dict/to_yaml, and the reward's config(), repr and attributes."""

from __future__ import annotations

import pickle
import re
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


# -- numbers a run can use: finite, seeds numpy and torch take (issue 31, items 4 and 8) ------------------


@dataclass
class Numbers(Config):
    rate: float = option(0.5, "A rate.", min=0.0)
    free: float = option(1.0, "No bounds.")
    weights: list[float] | None = option(None, "Weights.")
    table: dict[str, float] = option(factory=dict, help="Named numbers.")
    cap: float | None = option(None, "A cap; .inf = none.", allow_inf=True)
    seed: int = option(0, "A seed.")
    data_seed: int = option(0, "Another seed.")
    count: int = option(0, "Not a seed: any integer.")


@pytest.mark.parametrize("options,message", [
    ({"free": float("inf")}, "free must be a finite number, got inf"),
    ({"free": float("-inf")}, "free must be a finite number, got -inf"),
    ({"rate": float("nan")}, "rate must be a number, got nan"),
    ({"free": float("nan")}, "free must be a number, got nan"),  # no bounds: refused all the same
    ({"weights": [1.0, float("inf")]}, "weights must be a finite number, got inf"),
    ({"table": {"a": 1.0, "b": float("nan")}}, "table must be a number, got nan"),
    ({"cap": float("nan")}, "cap must be a number, got nan"),  # allow_inf allows no NaN
    ({"seed": 2**70}, "seed must be in 0..2**32-1 (what numpy and torch seed with), got 1180591620717411303424"),
    ({"seed": -1}, "seed must be in 0..2**32-1"),
    ({"data_seed": 2**32}, "data_seed must be in 0..2**32-1"),
])
def test_non_finite_numbers_and_unusable_seeds_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=f"^Numbers: {re.escape(message)}"):
        Numbers(**options)


def test_infinity_where_allowed_and_the_seed_bounds_are_what_numpy_and_torch_take():
    import numpy as np
    import torch

    assert Numbers(cap=float("inf")).cap == float("inf")
    assert Numbers(count=2**70).count == 2**70
    top = Numbers(seed=2**32 - 1, data_seed=0)
    np.random.seed(top.seed)
    torch.manual_seed(top.seed)
    with pytest.raises(ValueError):  # the reference: numpy's own bound, one past it
        np.random.seed(2**32)
    with pytest.raises(ValueError):
        np.random.seed(-1)


def test_every_trainer_refuses_a_non_finite_option_at_config_time(tmp_path):
    """The issue's cases: --learning-rate inf (SFT), --beta inf (DPO),
    epochs: .inf from a YAML file (the file and the key named), a TRL
    section's learning_rate."""
    import json

    from storyrl.training.config import TrainConfig
    from storyrl.training.storyteller.dpo import DPORunConfig
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.sft import SFTRunConfig

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"story_id": "s", "story": "a story .", "images": ["x.png"]}) + "\n")
    base = {"model": str(tmp_path), "policy": "causal_lm", "data": str(data), "output_dir": str(tmp_path / "o"),
            "prompt": "P1"}
    with pytest.raises(ValueError, match="SFTRunConfig: learning_rate must be a finite number, got inf"):
        SFTRunConfig.from_mapping(base, learning_rate=float("inf"))
    with pytest.raises(ValueError, match="DPORunConfig: beta must be a finite number, got inf"):
        DPORunConfig.from_mapping({**base, "pairs": str(data)}, beta=float("inf"))
    path = tmp_path / "sft.yaml"
    path.write_text(f"model: {tmp_path}\npolicy: causal_lm\ndata: {data}\noutput_dir: {tmp_path / 'o'}\n"
                    "prompt: P1\nepochs: .inf\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: SFTRunConfig: epochs must be a finite number"):
        SFTRunConfig.from_yaml(path)
    with pytest.raises(ValueError, match="TrainConfig: lr must be a number, got nan"):
        TrainConfig(output_dir=str(tmp_path / "o"), lr=float("nan"))
    with pytest.raises(ValueError, match="grpo: key 'learning_rate': expected a finite number, got inf"):
        RLConfig.from_mapping({**base, "rewards": ["rouge_l"], "grpo": {"learning_rate": float("inf")}})


@dataclass
class Foreign:  # a foreign (not storyrl) config dataclass, as TRL's
    lr: float = 1.0
    limit: float = float("inf")


@dataclass
class Holder(Config):
    foreign: Foreign = option(factory=Foreign, help="A foreign config.", cli=False)


def test_a_foreign_dataclass_refuses_non_finite_numbers_unless_its_default_is_one():
    with pytest.raises(ValueError, match="^Holder: option 'foreign': Foreign: lr must be a finite number, got inf"):
        Holder.from_mapping({"foreign": {"lr": float("inf")}})
    assert Holder.from_mapping({"foreign": {"limit": float("inf")}}).foreign.limit == float("inf")


# -- YAML: a key given twice (issue 31, item 7) ---------------------------------------------------------


@pytest.mark.parametrize("text,line,key", [
    ("lr: 0.1\nepochs: 2\nlr: 0.5\n", 3, "'lr' (first at line 1)"),
    ("lora:\n  r: 4\n  alpha: 8\n  r: 16\n", 4, "'r' (first at line 2)"),
    ("rewards:\n- reward: bleu\n  n: 2\n  n: 4\n", 4, "'n' (first at line 3)"),
    ("{a: 1, b: 2, a: 3}\n", 1, "'a' (first at line 1)"),
    ("1: one\n1: uno\n", 2, "1 (first at line 1)"),
])
def test_a_mapping_with_a_duplicate_key_is_refused_naming_file_line_and_key(tmp_path, text, line, key):
    from storyrl.config import ConfigFileError, load_yaml

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=f"^{re.escape(str(path))}: invalid YAML at line {line}: duplicate key "
                                              f"{re.escape(key)}$"):
        load_yaml(path)


def test_merge_keys_may_be_overridden_and_equal_keys_in_different_mappings_are_fine(tmp_path):
    from storyrl.config import load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {lr: 0.1, epochs: 2}\nrun:\n  <<: *b\n  lr: 0.5\nother:\n  lr: 0.3\n")
    assert load_yaml(path) == {"base": {"lr": 0.1, "epochs": 2}, "run": {"lr": 0.5, "epochs": 2},
                               "other": {"lr": 0.3}}


def test_a_config_file_with_a_duplicate_key_is_a_one_line_error(tmp_path):
    from storyrl.training.config import TrainConfig

    path = tmp_path / "train.yaml"
    path.write_text(f"output_dir: {tmp_path / 'o'}\nlr: 0.001\nbatch_size: 8\nlr: 0.1\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: invalid YAML at line 4: duplicate key 'lr'"):
        TrainConfig.from_yaml(path)
