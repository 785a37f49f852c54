"""What a config file needs (a reward, RL or sweep config), what named
rewards need, and the paper's whole setup when nothing is named."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from storyrl.doctor.pieces import (
    _OPTION_HINTS,
    PAPER_DATA,
    PAPER_REWARDS,
    VIST_URL,
    Piece,
    Requirements,
    _data_piece,
    _four_bit_piece,
    _gpu_piece,
    _model_piece,
)
from storyrl.doctor.rewards import reward_requirements

def _generator_requirements(generator: str, options: Mapping[str, Any], reqs: Requirements, owner: str) -> None:
    """The model and files of one generator with ``options`` (the
    generator's declared defaults for what is not given)."""
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    for info in option_info(GENERATORS.get(generator).config_class):
        value = options.get(info.name, None if info.required else info.default)
        if not isinstance(value, str):
            continue
        if info.name == "model" and info.path is None:
            reqs.add(_model_piece(value, f"{owner} model", None, True), owner)
        elif info.path in ("file", "dir", "any"):
            hint = "storyrl train tapm --config configs/training/tapm.yaml" if info.name == "model" else \
                _OPTION_HINTS.get(info.name, f"the path set as {info.name}")
            reqs.add(Piece("path", value, f"{owner} {info.name}", hint, True), owner)
    if options.get("backend") == "vllm":
        reqs.add(Piece("package", "vllm", "vllm (backend: vllm)", 'pip install -e ".[vllm]"', True), owner)
    if options.get("load_in_4bit"):
        reqs.add(_four_bit_piece(), owner)


def _sweep_requirements(path: Path, reqs: Requirements) -> None:
    from storyrl.eval.sweep import SweepConfig, plan_cells

    config = SweepConfig.from_yaml(path)
    owner = path.name
    reqs.add(_gpu_piece(True), owner)
    reqs.add(_data_piece(config.data, f"{owner} data", config.data_format), owner)
    seen = set()
    for cell in plan_cells(config):
        if cell.model not in seen:  # settings and prompts do not change what a model needs
            seen.add(cell.model)
            _generator_requirements(cell.generator, cell.options, reqs, f"{owner}:{cell.model}")
    for key, value in config.rewards.items():
        reward_requirements(value, reqs, owner=owner, expect=key)
    if config.human_scores:
        reqs.add(Piece("path", config.human_scores, f"{owner} human_scores", "the score CSV of the human stories",
                       True), owner)


# RLConfig is not built: it imports TRL (seconds) and refuses a config whose
# data file is missing -- which is what the doctor must report. Its keys that
# name things to get are read from the file, with RLConfig's defaults.
_RL_PATH_KEYS = ("image_root", "prompts_file", "sequence_image_dir")


def _rl_cuda_only(data: Mapping[str, Any]) -> list[str]:
    """The keys of an RL config that cannot run without CUDA: 4-bit loading
    (storyrl refuses it on the CPU), vLLM, and TRL's fp16 (refused without
    CUDA). Anything else trains on the CPU too, only slower."""
    keys = ["load_in_4bit"] if data.get("load_in_4bit") is True else []
    for name in ("grpo", "rloo"):
        section = data.get(name)
        if isinstance(section, Mapping):
            keys += [f"{name}.{key}" for key in ("use_vllm", "fp16") if section.get(key) is True]
    return keys


def _rl_requirements(path: Path, data: Mapping[str, Any], reqs: Requirements) -> None:
    from storyrl.models.vlm import DEFAULT_VLM

    owner = path.name
    cuda_only = _rl_cuda_only(data)
    reqs.add(_gpu_piece(bool(cuda_only)), f"{owner} ({', '.join(cuda_only)})" if cuda_only else owner)
    if any(key.endswith(".use_vllm") for key in cuda_only):
        reqs.add(Piece("package", "vllm", "vllm (use_vllm: true)", 'pip install -e ".[vllm]"', True), owner)
    model = data.get("model", DEFAULT_VLM)
    if isinstance(model, str):
        reqs.add(_model_piece(model, f"{owner} policy model", None, True), owner)
    if isinstance(data.get("data"), str):
        reqs.add(_data_piece(data["data"], f"{owner} data", data.get("data_format")), owner)
    for key in _RL_PATH_KEYS:
        if isinstance(data.get(key), str):
            reqs.add(Piece("path", data[key], f"{owner} {key}", _OPTION_HINTS.get(key, f"the path set as {key}"),
                           True), owner)
    if data.get("load_in_4bit") is True:
        reqs.add(_four_bit_piece(), owner)
    rewards = data.get("rewards")
    if not isinstance(rewards, list) or not rewards:
        raise ValueError(f"{path}: rewards: a list of rewards (names, reward config files or mappings)")
    for i, entry in enumerate(rewards):
        try:
            reward_requirements(entry, reqs, owner=owner)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: rewards[{i}]: {exc}") from None


def config_requirements(path: str | os.PathLike, reqs: Requirements) -> None:
    """Add the pieces of a reward config (``reward:``), an RL config
    (``configs/rl``: ``rewards:`` a list) or a sweep config
    (``configs/sweeps``: ``models:``). ValueError naming the file otherwise."""
    from storyrl.config import load_yaml

    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping (a reward, RL or sweep config)")  # noqa: TRY004
    try:
        if "reward" in data:
            reward_requirements(str(path), reqs, owner=path.name)
        elif isinstance(data.get("models"), list):
            _sweep_requirements(path, reqs)
        elif isinstance(data.get("rewards"), list) or "algorithm" in data:
            _rl_requirements(path, data, reqs)
        else:
            raise ValueError(f"{path}: not a reward config (reward:), an RL config (configs/rl: rewards: [...]) "
                             "or a sweep config (configs/sweeps: models:); the doctor reads those")
    except TypeError as exc:
        raise ValueError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None
    except ValueError as exc:
        message = " ".join(str(exc).split())
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def paper_requirements(reqs: Requirements) -> None:
    """Everything, as when nothing is named: the paper's setup required (GPU
    torch, the d_HM rewards at their defaults, the prompting generator's
    default model -- LLaVA-NeXT --, VIST), every other registered reward's
    pieces optional."""
    from storyrl.generators import GENERATORS
    from storyrl.rewards import REWARDS

    reqs.add(_gpu_piece(True), "paper")
    for name in REWARDS.names():
        try:
            reward_requirements(name, reqs, required=name in PAPER_REWARDS)
        except (TypeError, ValueError):
            continue  # no usable defaults (weighted needs components, remote a URL): named ones only
    prompting = GENERATORS.get("prompting").config_class
    from storyrl.config import option_info

    model = next(i.default for i in option_info(prompting) if i.name == "model")
    reqs.add(_model_piece(model, "generator model (prompting default)", None, True), "prompting")
    reqs.add(Piece("path", PAPER_DATA, f"VIST data ({PAPER_DATA}, as configs/sweeps/dhm_vist.yaml reads it)",
                   VIST_URL, True), "paper")


def requirements(metrics: Iterable[str] = (), configs: Iterable[str | os.PathLike] = ()) -> Requirements:
    """The pieces of the named rewards and config files, or of everything
    (:func:`paper_requirements`) when none is named. KeyError for an unknown
    reward name, ValueError for a bad config."""
    from storyrl.rewards import REWARDS

    metrics, configs = list(metrics), list(configs)
    names = [REWARDS.resolve(m) for m in metrics]  # KeyError first: a usage error
    reqs = Requirements()
    if not names and not configs:
        paper_requirements(reqs)
        return reqs
    for name in names:
        reward_requirements(name, reqs)
    for path in configs:
        config_requirements(path, reqs)
    return reqs

