"""Every shipped configs/training/*.yaml holds only real options of its
trainer, with values of the declared types inside the declared bounds (the
data paths in them are placeholders, so files are not required to exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "training").glob("*.yaml"))


def trainer_of(path: Path) -> str:
    """The trainer a file's usage line names (``storyrl train NAME --config ...``), else its stem."""
    found = re.search(r"storyrl train (\w+) --config \S*" + re.escape(path.name), path.read_text(encoding="utf-8"))
    return found.group(1) if found else path.stem


def option_problems(cls: type, data: dict) -> list[str]:
    """Unknown keys, missing required ones, wrong types and out-of-bounds
    values, as the config class checks them, without its file checks."""
    from storyrl.config import _bound_problem, check_type, option_info

    infos = {info.name: info for info in option_info(cls)}
    problems = [f"unknown key {key!r}" for key in data if key not in infos]
    problems += [f"missing {name!r}" for name, info in infos.items() if info.required and name not in data]
    for key, value in data.items():
        if key not in infos:
            continue
        try:
            value = check_type(value, infos[key].type)  # nested options (lora: ...) are built and checked whole
        except (TypeError, ValueError) as exc:
            problems.append(f"{key}: {exc}")
            continue
        if problem := _bound_problem(infos[key], value):
            problems.append(problem)
    return problems


def test_every_trainer_has_a_shipped_config():
    from storyrl.training import TRAINERS

    shipped = {trainer_of(path) for path in CONFIGS}
    assert {"reward_model", "dpo", "sft", "tapm", "coherence", "vrank"} <= shipped
    assert shipped <= set(TRAINERS.names())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_holds_only_valid_options(path):
    from storyrl.config import load_yaml
    from storyrl.training import TRAINERS

    data = load_yaml(path)
    assert isinstance(data, dict) and data
    cls = TRAINERS.get(trainer_of(path)).config_class
    assert option_problems(cls, data) == []


def test_the_check_finds_typos_wrong_types_and_bounds():
    from storyrl.config import load_yaml
    from storyrl.training.reward_model import RewardModelRunConfig

    good = load_yaml(next(p for p in CONFIGS if p.name == "reward_model.yaml"))
    assert option_problems(RewardModelRunConfig, good) == []
    typo = {**{k: v for k, v in good.items() if k != "eval_fraction"}, "eval_fractoin": 0.1}
    assert option_problems(RewardModelRunConfig, typo) == ["unknown key 'eval_fractoin'"]
    assert option_problems(RewardModelRunConfig, {**good, "eval_fraction": 1.5}) == [
        "eval_fraction must be <= 0.9, got 1.5"]
    assert option_problems(RewardModelRunConfig, {**good, "max_steps": "1000"}) == [
        "max_steps: expected an integer, got str '1000'"]
    (problem,) = option_problems(RewardModelRunConfig, {**good, "lora": {**good["lora"], "rank": 8}})
    assert problem.startswith("lora:") and "unknown" in problem and "'rank'" in problem
    assert option_problems(RewardModelRunConfig, {k: v for k, v in good.items() if k != "model"}) == [
        "missing 'model'"]
