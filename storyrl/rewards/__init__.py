"""Rewards: ``create_reward("repetition", **options)``.

Built-in rewards are registered in :data:`REWARDS` by import path, with a
one-line description, so listing them or creating a model-free reward never
imports torch. Register your own with :func:`register_reward`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from storyrl.registry import Registry
from storyrl.rewards.base import ModelConfig, Reward, RewardConfig, completion_text

__all__ = [
    "REWARDS",
    "AsyncReward",
    "ModelConfig",
    "Reward",
    "RewardConfig",
    "completion_text",
    "create_reward",
    "get_reward_class",
    "is_async_reward",
    "list_rewards",
    "load_reward_config",
    "register_reward",
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
REWARDS.add("weighted", "storyrl.rewards.weighted:Weighted",
            "Weighted sum of rewards, each optionally normalised (batch or group z-score, fixed range).")


def __getattr__(name: str) -> Any:
    # Lazy, so that listing rewards imports no component module.
    if name in ("AsyncReward", "is_async_reward"):
        from storyrl.rewards import concurrent

        return getattr(concurrent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_reward(name: str | None = None, *, description: str | None = None):
    """Class decorator adding a :class:`Reward` subclass to :data:`REWARDS`
    under ``name`` (default: the class's ``name`` attribute; description:
    the first line of its docstring)."""
    return REWARDS.register(name, description=description)


def list_rewards() -> list[str]:
    return REWARDS.names()


def get_reward_class(name: str) -> type[Reward]:
    return REWARDS.get(name)


def create_reward(name: str, **options: Any) -> Reward:
    """Instantiate a registered reward. Every option is checked against the
    type its config declares (TypeError naming the reward and the option;
    nothing is converted), then its value (ValueError)."""
    return get_reward_class(name)(**options)


def load_reward_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Reward:
    """Create a reward from a YAML file: ``reward: <name>`` plus its options.
    ``overrides`` (e.g. command-line options) replace file options; ones the
    reward does not declare are ignored. Errors are ValueErrors naming the
    file."""
    from storyrl.config import load_yaml, option_info

    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("reward"), str):
        raise ValueError(f"{path}: a reward config is a mapping with a 'reward: <name>' key")
    options = {k: v for k, v in data.items() if k != "reward"}
    try:
        cls = get_reward_class(data["reward"])
        declared = {info.name for info in option_info(cls.config_class)}
        config = cls.config_class.from_mapping(options, **{k: v for k, v in (overrides or {}).items() if k in declared})
        return cls(config)
    except KeyError as exc:
        raise ValueError(f"{path}: {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
