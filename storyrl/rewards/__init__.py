"""Rewards: ``create_reward("repetition", **options)``, or from a spec (a
name, a reward config YAML file or an inline mapping):
``build_reward("configs/rewards/dhm.yaml")``.

Built-in rewards are registered in :data:`REWARDS` by import path, with a
one-line description, so listing them or creating a model-free reward never
imports torch. Register your own with :func:`register_reward`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from storyrl.config import ConfigError, ConfigTypeError
from storyrl.registry import Registry
from storyrl.rewards.base import ModelConfig, Reward, RewardConfig, completion_text

__all__ = [
    "REWARDS",
    "SPEC_HELP",
    "AsyncReward",
    "ModelConfig",
    "Reward",
    "RewardConfig",
    "build_reward",
    "completion_text",
    "create_reward",
    "get_reward_class",
    "is_async_reward",
    "list_rewards",
    "load_reward_config",
    "register_reward",
    "resolve_reward",
]

REWARDS: Registry[type[Reward]] = Registry("reward")
REWARDS.add("repetition", "storyrl.rewards.repetition:Repetition",
            "RoViST-NR non-redundancy: 1 minus n-gram overlap within and across sentences (no model).")
REWARDS.add("groovist", "storyrl.rewards.groovist:GROOViST",
            "GROOViST visual grounding: CLIP noun-phrase / image-region alignment with a θ penalty.")
REWARDS.add("clipscore", "storyrl.rewards.clipscore:CLIPScore",
            "CLIPScore of each sentence against its image, averaged over the sequence.")
REWARDS.add("coherence", "storyrl.rewards.coherence:Coherence",
            "RoViST-C coherence: mean P(sentence follows) from an ALBERT sentence-order model.")
REWARDS.add("rovist_vg", "storyrl.rewards.rovist_vg:RovistVG",
            "RoViST-VG visual grounding: GloVe nouns / ViT regions, idf-weighted log-sum-exp.",
            aliases=("rovist-vg",))
REWARDS.add("bleu", "storyrl.rewards.bleu:BLEU",
            "Sentence BLEU (sacreBLEU) of the story against its references, in [0, 1].")
REWARDS.add("rouge_l", "storyrl.rewards.rouge:RougeL",
            "ROUGE-L (rouge-score) of the story against its best reference, in [0, 1].", aliases=("rouge-l",))
REWARDS.add("vrank", "storyrl.rewards.vrank:Vrank",
            "Vrank (VHED): learned pairwise story judge; the candidate against its reference, positive = better.")
REWARDS.add("cosmic", "storyrl.rewards.cosmic:COSMiC",
            "COSMiC Vanilla: learned coherence-aware caption metric, each sentence with its image, mean.")
REWARDS.add("dhm", "storyrl.rewards.dhm:DHM",
            "Minus d_HM to the human story: weighted mean |human - model| of grounding, coherence, repetition.")
REWARDS.add("remote", "storyrl.rewards.remote:RemoteReward",
            "A reward scored by a `storyrl serve` server over HTTP (retries, timeouts, failures are None).")
REWARDS.add("reward_model", "storyrl.rewards.reward_model:RewardModel",
            "A learned story reward model (storyrl train reward_model): the model's logit of the story.")
REWARDS.add("weighted", "storyrl.rewards.weighted:Weighted",
            "Weighted sum of rewards, each optionally normalised (batch or group z-score, fixed range).")


def __getattr__(name: str) -> Any:
    # Lazy, so that listing rewards imports no component module.
    if name in ("AsyncReward", "is_async_reward"):
        from storyrl.rewards import concurrent

        return getattr(concurrent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_reward(name: str | None = None, *, description: str | None = None, replace: bool = False):
    """Class decorator adding a :class:`Reward` subclass to :data:`REWARDS`
    under ``name`` (default: the class's ``name`` attribute; description:
    the first line of its docstring). A name already taken is an error
    unless ``replace``."""
    return REWARDS.register(name, description=description, replace=replace)


def list_rewards() -> list[str]:
    return REWARDS.names()


def get_reward_class(name: str) -> type[Reward]:
    return REWARDS.get(name)


def create_reward(name: str, **options: Any) -> Reward:
    """Instantiate a registered reward. Every option is checked against the
    type its config declares (TypeError naming the reward and the option;
    nothing is converted), then its value (ValueError)."""
    return get_reward_class(name)(**options)


SPEC_HELP = "a registered reward name, a reward config YAML file, or an inline mapping {reward: <name>, <options>}"


def build_reward(spec: Any, options: Mapping[str, Any] | None = None, *, expect: str | None = None) -> Reward:
    """The reward of ``spec``: a registered name (``repetition``), a reward
    config YAML file (``reward: <name>`` plus its options) or an inline
    mapping ``{reward: coherence, model: ..., ...}``; ``options`` replace the
    file's or mapping's. Models are not loaded yet. See
    :func:`resolve_reward` for ``expect`` and the errors."""
    cls, config = resolve_reward(spec, options, expect=expect)
    return cls(config)


def resolve_reward(
    spec: Any, options: Mapping[str, Any] | None = None, *, expect: str | None = None
) -> tuple[type[Reward], RewardConfig]:
    """The reward class and validated config of ``spec`` (see
    :func:`build_reward`), without creating the reward. ``expect``: the
    registered name the reward must have (an inline mapping may then leave
    out ``reward``). Errors are :class:`~storyrl.config.ConfigError` naming
    the file or reward at fault (a TypeError too for an unknown or ill-typed
    option)."""
    if isinstance(spec, Mapping):
        data = dict(spec)
        data.setdefault("reward", expect)
        if not isinstance(data["reward"], str):
            raise ConfigError(f"an inline reward is a mapping with a 'reward: <name>' key, got {dict(spec)!r}")
        return _configured(data, options, None, expect)
    if isinstance(spec, str) and spec in REWARDS:
        return _configured({"reward": spec}, options, None, expect)
    if isinstance(spec, str) and (spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec):
        if not Path(spec).is_file():
            raise ConfigError(f"no such reward config file {spec}")
        return _configured(_read_reward_file(spec), options, spec, expect)
    if isinstance(spec, str):
        raise ConfigError(f"unknown reward {spec!r}; give {SPEC_HELP} (rewards: {', '.join(REWARDS.names())})")
    raise ConfigTypeError(f"a reward is {SPEC_HELP}, got {type(spec).__name__} {spec!r}")


def load_reward_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Reward:
    """Create a reward from a YAML file: ``reward: <name>`` plus its options.
    ``overrides`` (e.g. command-line options; None = not given) replace file
    options; ones the reward does not declare are ignored. Errors are
    ValueErrors (:class:`~storyrl.config.ConfigError`) naming the file."""
    from storyrl.config import option_info

    data = _read_reward_file(path)
    declared = set()
    if data["reward"] in REWARDS:
        declared = {info.name for info in option_info(get_reward_class(data["reward"]).config_class)}
    given = {k: v for k, v in (overrides or {}).items() if k in declared and v is not None}
    cls, config = _configured(data, given, str(path), None)
    return cls(config)


def _read_reward_file(path: str | Path) -> dict[str, Any]:
    from storyrl.config import load_yaml

    data = load_yaml(Path(path))
    if not isinstance(data, dict) or not isinstance(data.get("reward"), str):
        raise ConfigError("a reward config is a mapping with a 'reward: <name>' key", source=str(path))
    return dict(data)


def _configured(
    data: dict[str, Any], options: Mapping[str, Any] | None, source: str | None, expect: str | None
) -> tuple[type[Reward], RewardConfig]:
    """The class and config of ``data`` (``reward: <name>`` plus options),
    ``options`` replacing its own; ``source``: the file it came from."""
    name = data.pop("reward")
    try:
        cls = REWARDS.get(name)
    except KeyError as exc:
        raise ConfigError(exc.args[0], source=source) from None
    if expect is not None and REWARDS.resolve(name) != REWARDS.resolve(expect):
        raise ConfigError(f"the reward is {name!r}, not {expect!r}", source=source)
    try:
        config = cls.config_class.from_mapping({**data, **(options or {})})
    except (TypeError, ValueError) as exc:
        # Named as users call the reward, not by its config class.
        raise ConfigError.of(exc).named(f"reward {cls.name or name!r}", cls.config_class._label(),
                                        source=source) from None
    return cls, config
