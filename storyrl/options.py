"""Strict option types shared by reward options and training configs.

Every option is checked against its declared annotation and never converted
from another type: ``"false"`` is not a boolean (``bool("false")`` is True, so
conversion would turn ``trust_checkpoint: "false"`` into unpickling), ``true``
is not an integer, ``"3"`` is not a number. The only changes made to a value
are lossless ones: an integer given for a float becomes that float, and a
``pathlib.Path`` given for a string becomes its string.

YAML files are read with :func:`load_yaml`, which resolves ``1e-5`` as the
float YAML 1.2 says it is (PyYAML's YAML 1.1 rules read it as a string).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import types
import typing
import collections.abc as cabc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

__all__ = ["check_type", "check_arguments", "checked_init", "load_yaml", "ConfigFileError"]


class ConfigFileError(ValueError):
    """A config file that cannot be read or parsed; the message names the file."""


_SEQUENCES = {list, tuple, cabc.Sequence, cabc.MutableSequence}
_MAPPINGS = {dict, cabc.Mapping, cabc.MutableMapping}


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return {"bool": "true/false", "int": "an integer", "float": "a number", "str": "a string"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp).replace("typing.", "")


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def check_type(value: Any, tp: Any) -> Any:
    """``value`` if it has the annotated type ``tp`` (after the lossless
    changes above); TypeError with a short reason otherwise. Annotations this
    function does not understand (callables, type variables) are not checked."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise TypeError(f"expected {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_type(value, arg)
            except TypeError as exc:
                errors.append(str(exc))
        raise TypeError(errors[0] if len(errors) == 1 else f"expected {_type_name(tp)}, got {_got(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise TypeError(f"expected one of {list(choices)}, got {_got(value)}")
    if origin in _SEQUENCES:
        args = typing.get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {_got(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise TypeError(f"expected {len(args)} items, got {len(value)}")
            return tuple(check_type(v, a) for v, a in zip(value, args))
        items = [check_type(v, args[0] if args else Any) for v in value]
        return tuple(items) if origin is tuple else items
    if origin in _MAPPINGS:
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping, got {_got(value)}")
        return {check_type(k, key_tp): check_type(v, value_tp) for k, v in value.items()}
    if origin is not None or not isinstance(tp, type):
        return value  # e.g. Callable[...]: not checked here
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
    elif isinstance(value, tp):
        return value
    raise TypeError(f"expected {_type_name(tp)}, got {_got(value)}")


def check_arguments(func: Callable, bound: inspect.BoundArguments, owner: str) -> None:
    """Check the bound arguments of ``func`` against its annotations, in place
    (lossless changes applied). TypeError names ``owner`` and the option."""
    hints = _hints(func)
    for name, value in bound.arguments.items():
        param = bound.signature.parameters[name]
        if name not in hints or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        try:
            bound.arguments[name] = check_type(value, hints[name])
        except TypeError as exc:
            raise TypeError(f"{owner}: option {name!r}: {exc}") from None


@functools.lru_cache(maxsize=None)
def _hints(func: Callable) -> dict[str, Any]:
    # Resolved on first use: with `from __future__ import annotations` the
    # annotations are strings naming things of the function's module.
    return typing.get_type_hints(func)


def checked_init(init: Callable, owner: Callable[[Any], str]) -> Callable:
    """Wrap an ``__init__`` so that its arguments are type-checked first.
    ``owner(self)`` names the object being created in errors."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{owner(self)}: {exc}") from None
        check_arguments(init, bound, owner(self))
        return init(*bound.args, **bound.kwargs)

    wrapper.__checks_options__ = True
    return wrapper


# -- YAML ---------------------------------------------------------------------

_YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that also reads ``1e-5`` (no dot) as a float, as YAML 1.2 does."""

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    return Loader


def load_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; ConfigFileError naming the file (and line) when it
    cannot be read or parsed."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigFileError(f"{path}: invalid YAML{where}: {' '.join(str(problem).split())}") from None
