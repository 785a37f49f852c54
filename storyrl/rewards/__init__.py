"""Reward registry: ``create_reward("repetition", **config)``.

Built-in rewards are registered by import path so that listing or creating a
model-free reward never imports torch. Register your own with
:func:`register_reward`.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from storyrl.rewards.base import Reward, completion_text

__all__ = [
    "Reward",
    "accepted_options",
    "completion_text",
    "create_reward",
    "get_reward_class",
    "list_rewards",
    "load_reward_config",
    "register_reward",
]

_REGISTRY: dict[str, type[Reward] | str] = {
    "repetition": "storyrl.rewards.repetition:Repetition",
    "groovist": "storyrl.rewards.groovist:GROOViST",
    "clipscore": "storyrl.rewards.clipscore:CLIPScore",
    "coherence": "storyrl.rewards.coherence:Coherence",
    "rovist_vg": "storyrl.rewards.rovist_vg:RovistVG",
}


def register_reward(name: str | None = None):
    """Class decorator adding a :class:`Reward` subclass to the registry under
    ``name`` (default: the class's ``name`` attribute)."""

    def decorator(cls: type[Reward]) -> type[Reward]:
        key = name or cls.name
        if not key:
            raise ValueError(f"{cls.__name__}: a registered reward needs a name")
        _REGISTRY[key] = cls
        return cls

    return decorator


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_class(name: str) -> type[Reward]:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(list_rewards())}") from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return entry


def accepted_options(cls: type[Reward]) -> set[str]:
    """Constructor options of a reward class, following ``**kwargs`` that are
    passed on to base classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def create_reward(name: str, **config: Any) -> Reward:
    """Instantiate a registered reward with its configuration. Every option is
    checked against the type its constructor declares (TypeError naming the
    reward and the option; nothing is converted)."""
    cls = get_reward_class(name)
    allowed = accepted_options(cls)
    unknown = [k for k in config if k not in allowed]
    if unknown:
        raise TypeError(
            f"reward {name!r}: bad configuration: unknown option {unknown[0]!r}; "
            f"valid options: {', '.join(sorted(allowed))}"
        )
    return cls(**config)


def load_reward_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Reward:
    """Create a reward from a YAML file: ``reward: <name>`` plus its options.
    ``overrides`` (e.g. command-line options) replace file options the reward
    accepts; others are ignored. Errors are ValueErrors naming the file."""
    from storyrl.options import load_yaml

    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("reward"), str):
        raise ValueError(f"{path}: a reward config is a mapping with a 'reward: <name>' key")
    options = {k: v for k, v in data.items() if k != "reward"}
    try:
        if overrides:
            allowed = accepted_options(get_reward_class(data["reward"]))
            options.update({k: v for k, v in overrides.items() if k in allowed})
        return create_reward(data["reward"], **options)
    except KeyError as exc:
        raise ValueError(f"{path}: {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
