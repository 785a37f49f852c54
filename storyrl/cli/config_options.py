"""Command-line options generated from config dataclasses.

No option list is kept by hand: ``storyrl score`` gets one option per reward
option declared in any registered reward's config, ``storyrl train <name>``
one per field of the trainer's config. Every generated option defaults to
"not given" (``None``), so the config's own default -- or a config file's
value -- applies unless the option is set; the value then goes through the
config's validation like any other.

Reward options come in two spellings:

* ``--<option>`` (e.g. ``--device``, ``--theta``) reaches every selected
  reward that declares the option. It exists when all rewards declaring it
  agree on its type, allowed values and path kind, and the command has no
  option of that name (``score --batch-size`` is stories per batch).
* ``--<reward>-<option>`` (e.g. ``--coherence-model``,
  ``--groovist-batch-size``) reaches only that reward and wins over the
  shared spelling. These are listed in ``--help`` only where no shared
  spelling exists; ``storyrl rewards NAME`` lists a reward's options.

Options are generated when a command's help or arguments are first needed,
so building the command line imports no reward module.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import click

from storyrl.config import REQUIRED, OptionInfo, option_info

__all__ = [
    "GeneratedOptionsCommand", "click_option", "config_options", "expressible", "given", "registry_options",
    "reward_options", "split_registry_options", "split_reward_options",
]

_SEP = "__"  # in the parameter name of --<reward>-<option>: "<reward>__<option>"


class GeneratedOptionsCommand(click.Command):
    """A click command whose options come from ``generate(own_names)`` when
    they are needed (help, parsing) -- each time, so that a reward registered
    after import has its options too."""

    def __init__(self, *args: Any, generate: Callable[[set[str]], list[click.Parameter]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._generate = generate

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        own = super().get_params(ctx)
        return [*own[:-1], *self._generate({p.name for p in own}), own[-1]]  # --help stays last


def _scalar(tp: Any) -> tuple[Any, bool]:
    """The scalar type behind an annotation and whether it is a list
    (``list[str]`` -> (str, True)); (None, False) for what the command line
    cannot express (mappings, nested configs)."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (list, tuple) and len(args) >= 1:
        inner, nested = _scalar(args[0])
        return (inner, True) if not nested else (None, False)
    if origin in (typing.Union, types.UnionType):
        if len(args) == 1:  # X | None
            return _scalar(args[0])
        scalars = {_scalar(a)[0] for a in args}
        if len(scalars) == 1:
            return scalars.pop(), False
        return (str, False) if str in scalars else (None, False)  # e.g. float | str: given as text
    if tp in (bool, int, float, str):
        return tp, False
    return None, False


def _click_type(info: OptionInfo, scalar: Any) -> click.ParamType:
    if info.choices is not None and all(isinstance(c, str) for c in info.choices):
        return click.Choice(list(info.choices))
    if info.path is not None:
        must_exist = info.path != "new-dir"
        return click.Path(exists=must_exist, file_okay=info.path in ("file", "any"), dir_okay=info.path != "file")
    if scalar is int:
        return click.IntRange(min=info.min, max=info.max) if info.min is not None or info.max is not None else click.INT
    if scalar is float:
        return click.FloatRange(min=info.min, max=info.max) if info.min is not None or info.max is not None else click.FLOAT
    return click.STRING


def expressible(info: OptionInfo) -> bool:
    return info.cli and _scalar(info.type)[0] is not None


def _with_default(text: str, default: Any) -> str:
    if default is REQUIRED or default is None or default == [] or default == ():
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} [default: {shown}]".strip()


def click_option(info: OptionInfo, flag: str, name: str, help: str | None = None, hidden: bool = False) -> click.Option:  # noqa: A002
    """A click option setting ``info`` (``flag`` like ``--top-b``, ``name`` the
    callback parameter; ``help`` replaces the declared help and default).
    Unset, it passes ``None``."""
    scalar, many = _scalar(info.type)
    text = _with_default(info.help, info.default) if help is None else help
    if scalar is bool and not many:
        return click.Option([f"{flag}/--no-{flag[2:]}", name], default=None, help=text, hidden=hidden)
    return click.Option([flag, name], type=_click_type(info, scalar), default=None, multiple=many,
                        help=text, hidden=hidden)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_options(config_class: type, own: Iterable[str] = ()) -> list[click.Option]:
    """One option per command-line-expressible field of ``config_class``
    (fields named like the command's ``own`` options are left to them)."""
    own = set(own)
    return [click_option(info, _flag(info.name), info.name) for info in option_info(config_class)
            if expressible(info) and info.name not in own]


def given(values: dict[str, Any]) -> dict[str, Any]:
    """The options that were set (unset ones are ``None`` or, for multiple
    options, empty); lists as lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None and v != ()}


def registry_options(registry, names: Iterable[str] | None = None, own: Iterable[str] = ()) -> list[click.Option]:
    """The options of the named entries of ``registry`` (rewards, generators;
    default: all registered), in both spellings (see the module docs)."""
    own = set(own)
    declared: dict[str, dict[str, OptionInfo]] = {}
    for entry in names or registry.names():
        for info in option_info(registry.get(entry).config_class):
            if expressible(info):
                declared.setdefault(info.name, {})[entry] = info
    options, shared = [], set()
    for name, by_entry in declared.items():
        kinds = {(info.type, info.choices, info.path) for info in by_entry.values()}
        if len(kinds) == 1 and name not in own:
            shared.add(name)
            infos = list(by_entry.values())
            helps = list(dict.fromkeys(info.help for info in infos))
            text = helps[0] if len(helps) == 1 else f"Sets {name} of each {registry.kind}; see --<{registry.kind}>-{_flag(name)[2:]}."
            if all(info.default == infos[0].default for info in infos):
                text = _with_default(text, infos[0].default)
            options.append(click_option(infos[0], _flag(name), name, help=f"{text} ({', '.join(by_entry)})"))
    for name, by_entry in declared.items():
        for entry, info in by_entry.items():
            flag = _flag(f"{entry}_{name}")
            options.append(click_option(info, flag, f"{entry}{_SEP}{name}", hidden=name in shared))
    flags = [f for o in options for f in o.opts]
    clash = next((f for f in flags if flags.count(f) > 1), None)
    if clash:
        raise RuntimeError(f"{registry.kind} options: {clash} is generated twice; rename an option")
    return options


def split_registry_options(registry, values: dict[str, Any], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The given options per entry: shared spellings reach every entry that
    declares the option, ``--<entry>-<option>`` only that entry and wins over
    the shared one."""
    values = given(values)
    out: dict[str, dict[str, Any]] = {}
    for entry in names:
        declared = {info.name for info in option_info(registry.get(entry).config_class)}
        mine = {k: v for k, v in values.items() if _SEP not in k and k in declared}
        prefix = f"{entry}{_SEP}"
        mine.update({k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)})
        out[entry] = mine
    return out


def reward_options(reward_names: Iterable[str] | None = None, own: Iterable[str] = ()) -> list[click.Option]:
    """The options of the named rewards (default: all registered)."""
    from storyrl.rewards import REWARDS

    return registry_options(REWARDS, reward_names, own)


def split_reward_options(values: dict[str, Any], reward_names: Iterable[str]) -> dict[str, dict[str, Any]]:
    from storyrl.rewards import REWARDS

    return split_registry_options(REWARDS, values, reward_names)
