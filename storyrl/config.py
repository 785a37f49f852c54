"""storyrl's one config mechanism: typed dataclasses for rewards, trainers and
generators.

A component declares its options once, as the fields of a :class:`Config`
dataclass made with :func:`option` (type, default, help, allowed values). The
same declaration gives validation in Python, YAML files and on the command
line (the ``storyrl`` options are generated from it), the component's
``config()`` and its repr. Fields may themselves be dataclasses -- storyrl
configs or foreign ones such as TRL's ``GRPOConfig`` -- and are built from
YAML mappings.

Every option is checked against its declared annotation and never converted
from another type: ``"false"`` is not a boolean (``bool("false")`` is True, so
conversion would turn ``trust_checkpoint: "false"`` into unpickling), ``true``
is not an integer, ``"3"`` is not a number. The only changes made to a value
are lossless ones: an integer given for a float becomes that float, and a
``pathlib.Path`` given for a string becomes its string.

Numbers must be usable as they are: NaN and infinity are refused in every
float option (a learning rate of ``.inf`` trains every weight to NaN), unless
the option is declared with ``allow_inf=True``; an integer option named
``seed`` (or ``*_seed``) must be what numpy's and torch's seeding accept,
0 to 2**32 - 1.

YAML files are read with :func:`load_yaml`, which resolves ``1e-5`` as the
float YAML 1.2 says it is (PyYAML's YAML 1.1 rules read it as a string) and
refuses a mapping that gives a key twice (PyYAML keeps the last silently).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import re
import sys
import types
import typing
import collections.abc as cabc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

__all__ = ["Config", "ConfigError", "ConfigFileError", "ConfigTypeError", "Configurable", "check_type",
           "first_nonfinite", "load_yaml", "option", "option_info"]


class ConfigFileError(ValueError):
    """A config file that cannot be read or parsed; the message names the file."""


class ConfigError(ValueError):
    """A bad option value, built once where it is found. Its parts are kept
    (``source``: the file, ``owner``: whose options, e.g. a config class or
    ``reward 'bleu'``, ``option``, ``message``) so that a caller names the
    owner as users know it with :meth:`named` instead of rewriting the text;
    ``str()`` is the one line ``source: owner: message``."""

    def __init__(self, message: str, *, owner: str | None = None, option: str | None = None,
                 source: str | None = None) -> None:
        self.message, self.owner, self.option, self.source = message, owner, option, source
        super().__init__(str(self))

    def __str__(self) -> str:
        return ": ".join(part for part in (self.source, self.owner, self.message) if part)

    def __reduce__(self):  # keyword fields survive pickling (errors cross processes)
        return _rebuild_config_error, (type(self), self.message, self.owner, self.option, self.source)

    @classmethod
    def of(cls, exc: Exception) -> ConfigError:
        """``exc`` as a config error (TypeError stays a TypeError)."""
        if isinstance(exc, ConfigError):
            return exc
        return (ConfigTypeError if isinstance(exc, TypeError) else ConfigError)(str(exc))

    def named(self, owner: str, instead_of: str | None = None, *, source: str | None = None) -> ConfigError:
        """The same error said of ``owner``: it replaces the owner
        ``instead_of`` (e.g. the config class users never see); any other
        owner stays in the message. ``source`` (a file) is added."""
        message = self.message
        if self.owner and self.owner != instead_of:
            message = f"{self.owner}: {message}"
        return type(self)(message, owner=owner, option=self.option, source=source or self.source)

    def from_source(self, source: str) -> ConfigError:
        """The same error, read from the file ``source``; a ValueError (the
        file is at fault, whatever the kind of problem)."""
        if self.source:  # read through another file: both are named
            return ConfigError(str(self), option=self.option, source=source)
        return ConfigError(self.message, owner=self.owner, option=self.option, source=source)


class ConfigTypeError(ConfigError, TypeError):
    """An option of the wrong type, an unknown or a missing one: a
    TypeError, as Python's for a bad keyword argument, and a ConfigError."""


def _rebuild_config_error(cls, message, owner, option, source):
    return cls(message, owner=owner, option=option, source=source)


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
    if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
        return _dataclass_from_mapping(tp, value)
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

        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _check_alias_expansion(node)
            return node

        def construct_mapping(self, node, deep=False):
            _check_duplicate_keys(self, node)
            return super().construct_mapping(node, deep=deep)

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    return Loader


def _check_duplicate_keys(loader: Any, node: Any) -> None:
    """A mapping that gives a key twice is refused (ConstructorError at the
    second): PyYAML would keep the last one and nobody would notice. Keys
    a merge (``<<: *base``) brings in may be overridden: that is its purpose."""
    import yaml

    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: PyYAML's own error says so
            continue
        if first is not key_node:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first.start_mark.line + 1})",
                key_node.start_mark)


#: How many nodes YAML aliases may add to a document once expanded: nested
#: aliases ("billion laughs") make a few hundred bytes stand for billions of
#: values, which exhaust memory as soon as anything walks them.
MAX_ALIAS_NODES = 100_000


class _AliasBomb(Exception):
    pass


def _check_alias_expansion(root: Any) -> None:
    """Refuse a document whose aliases expand to more than
    :data:`MAX_ALIAS_NODES` nodes beyond its own, or that contains itself."""
    import yaml

    sizes: dict[int, int | None] = {}  # None: being counted (a cycle when met again)

    def size(node: Any) -> int:
        known = sizes.get(id(node), 0)
        if known is None:
            raise _AliasBomb("an alias refers to a node that contains it")
        if known:
            return known
        sizes[id(node)] = None
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(key) + size(value) for key, value in node.value)
        sizes[id(node)] = total
        if total - len(sizes) > MAX_ALIAS_NODES:
            raise _AliasBomb(f"its aliases expand to more than {MAX_ALIAS_NODES:,} values")
        return total

    size(root)


def load_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; ConfigFileError naming the file (and line) when it
    cannot be read or parsed."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506  (a SafeLoader subclass)
    except _AliasBomb as exc:
        raise ConfigFileError(f"{path}: refused: {exc}") from None
    except RecursionError:
        raise ConfigFileError(f"{path}: invalid YAML: nested too deeply") from None
    except ValueError as exc:  # int() of a longer number than Python converts
        if "integer string conversion" not in str(exc):
            raise
        limit = sys.get_int_max_str_digits()
        match = re.search(rf"\d{{{limit + 1},}}", text)
        where = f" at line {text.count(chr(10), 0, match.start()) + 1}" if match else ""
        raise ConfigFileError(f"{path}: invalid YAML{where}: a number with more than {limit} digits") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigFileError(f"{path}: invalid YAML{where}: {' '.join(str(problem).split())}") from None


# -- config dataclasses -----------------------------------------------------------

REQUIRED = dataclasses.MISSING
PATH_KINDS = ("file", "dir", "any", "new-dir")


def option(
    default: Any = REQUIRED,
    help: str = "",  # noqa: A002  (the word every CLI library uses)
    *,
    factory: Callable[[], Any] | None = None,
    choices: tuple | list | None = None,
    min: float | None = None,  # noqa: A002
    max: float | None = None,  # noqa: A002
    path: str | None = None,
    cli: bool = True,
    allow_inf: bool = False,
) -> Any:
    """A :class:`Config` field: its ``default`` (``factory`` for a mutable
    one; neither = required), a one-line ``help``, the allowed ``choices``,
    numeric bounds ``min``/``max`` (inclusive), and for the command line
    ``path`` ("file", "dir", "any": must exist; "new-dir": may not) and
    ``cli=False`` for fields set only in YAML or Python (mappings).
    ``allow_inf`` lets the option's numbers be infinite (NaN never is)."""
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"path must be one of {PATH_KINDS}, got {path!r}")
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "min": min, "max": max,
                "path": path, "cli": cli, "allow_inf": allow_inf}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class OptionInfo:
    """One declared option of a config class, its type resolved."""

    name: str
    type: Any
    default: Any  # REQUIRED when the option must be given
    help: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    path: str | None = None
    cli: bool = True
    allow_inf: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@functools.lru_cache(maxsize=None)
def option_info(cls: type) -> tuple[OptionInfo, ...]:
    """The options (init fields) a config dataclass declares, in order."""
    hints = typing.get_type_hints(cls)
    infos = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not REQUIRED else (
            f.default_factory() if f.default_factory is not REQUIRED else REQUIRED
        )
        meta = {k: v for k, v in f.metadata.items()
                if k in ("help", "choices", "min", "max", "path", "cli", "allow_inf")}
        infos.append(OptionInfo(f.name, hints[f.name], default, **meta))
    return tuple(infos)


@dataclasses.dataclass
class Config:
    """Base of storyrl's config dataclasses (rewards, trainers, generators).

    Subclasses declare fields with :func:`option`. Creating an instance
    checks every field's type strictly (:func:`check_type`; TypeError naming
    the option) and then its ``choices``/``min``/``max`` and the subclass's
    :meth:`_problems` (ValueError listing every problem)."""

    #: How errors name the fields.
    _field_word: ClassVar[str] = "option"

    def __post_init__(self) -> None:
        label, word = self._label(), self._field_word
        for info in option_info(type(self)):
            try:
                value = check_type(getattr(self, info.name), info.type)
            except TypeError as exc:
                raise ConfigTypeError(f"{word} {info.name!r}: {exc}", owner=label, option=info.name) from None
            except ValueError as exc:  # a nested config's value (a foreign dataclass's own checks)
                raise ConfigError(f"{word} {info.name!r}: {exc}", owner=label, option=info.name) from None
            object.__setattr__(self, info.name, value)
        problems = [p for info in option_info(type(self)) if (p := _bound_problem(info, getattr(self, info.name)))]
        problems += self._problems()
        if problems:
            raise ConfigError("; ".join(problems), owner=label)

    def _problems(self) -> list[str]:
        """Checks across options, for subclasses: one message per problem."""
        return []

    @classmethod
    def _label(cls) -> str:
        return cls.__name__

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], /, source: str | None = None, **overrides: Any):
        """Build from a mapping (e.g. parsed YAML) plus keyword ``overrides``
        (``None`` = not given, e.g. an unset command-line option). Unknown,
        missing or ill-typed options raise TypeError, bad values ValueError;
        with ``source`` (a file name) every error is a ValueError naming it.
        ``data`` is positional-only, so a config may have a ``data`` option."""
        try:
            return cls(**_known_options(cls, data, overrides))
        except (TypeError, ValueError) as exc:
            if source is None:
                raise
            raise ConfigError.of(exc).from_source(source) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any):
        """Read a YAML mapping of options; ``overrides`` (``None`` = not
        given) take precedence. Errors are ValueErrors naming the file."""
        path = Path(path)
        data = load_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping of settings, got {type(data).__name__}")
        return cls.from_mapping(data, source=str(path), **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (nested configs as mappings) that ``from_mapping``
        reads back."""
        return {info.name: _configs_as_dicts(getattr(self, info.name)) for info in option_info(type(self))}

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write the options so that :meth:`from_yaml` reads them back."""
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")


def _known_options(cls: type, data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    infos = option_info(cls)
    valid = [i.name for i in infos]
    word, label = cls._field_word, cls._label()
    values: dict[str, Any] = {}
    for mapping in (data, overrides):
        for key, value in mapping.items():
            if mapping is overrides and value is None:
                continue
            if key not in valid:
                raise ConfigTypeError(f"bad configuration: unknown {word} {key!r}; valid {word}s: {', '.join(valid)}",
                                      owner=label, option=key)
            values[key] = value
    missing = [i.name for i in infos if i.required and i.name not in values]
    if missing:
        raise ConfigTypeError(f"missing required {word}(s) {', '.join(map(repr, missing))}", owner=label)
    return values


def _dataclass_from_mapping(tp: type, value: Mapping[str, Any]) -> Any:
    """A nested dataclass option given as a mapping (YAML): storyrl configs
    are validated as usual; foreign dataclasses (TRL's ``GRPOConfig``...) get
    the mapping as keyword arguments and do their own checks."""
    if isinstance(tp, type) and issubclass(tp, Config):
        return tp.from_mapping(value)
    defaults = {f.name: f.default for f in dataclasses.fields(tp)}
    for key, item in value.items():
        default = defaults.get(key)
        bad = first_nonfinite(item, allow_inf=isinstance(default, float) and math.isinf(default))
        if bad is not None:  # a foreign config would take it (TRL's learning_rate: .inf trains NaN weights)
            raise ValueError(f"{tp.__name__}: {key} must be a {'' if math.isnan(bad) else 'finite '}number, got "
                             f"{bad!r}")
    try:
        return tp(**value)
    except TypeError as exc:
        raise TypeError(f"{tp.__name__}: {exc}") from None


def _configs_as_dicts(value: Any) -> Any:
    """``value`` with every config in it (storyrl's or a foreign dataclass) as a dict."""
    if isinstance(value, Config):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Foreign configs know best how to serialise themselves (TrainingArguments.to_dict).
        return value.to_dict() if callable(getattr(value, "to_dict", None)) else dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_configs_as_dicts(v) for v in value]
    if isinstance(value, dict):
        return {k: _configs_as_dicts(v) for k, v in value.items()}
    return value


#: What numpy's and torch's seeding accept (np.random.seed refuses the rest;
#: transformers' set_seed calls it): the bounds of an option named seed.
SEED_RANGE = (0, 2**32 - 1)


def _is_seed(info: OptionInfo) -> bool:
    return (info.name == "seed" or info.name.endswith("_seed")) and info.min is None and info.max is None


def first_nonfinite(value: Any, allow_inf: bool = False) -> float | None:
    """The first NaN (or, unless ``allow_inf``, infinite) float in ``value``
    and the lists, tuples and mapping values in it; None if there is none.
    Storyrl configs nested in it have checked their own options."""
    if isinstance(value, float):
        return value if math.isnan(value) or (math.isinf(value) and not allow_inf) else None
    if isinstance(value, (list, tuple)) or (isinstance(value, Mapping) and not isinstance(value, Config)):
        for item in (value.values() if isinstance(value, Mapping) else value):
            bad = first_nonfinite(item, allow_inf)
            if bad is not None:
                return bad
    return None


def _bound_problem(info: OptionInfo, value: Any) -> str | None:
    if value is None:
        return None
    bad = first_nonfinite(value, info.allow_inf)
    if bad is not None:
        return f"{info.name} must be a {'' if math.isnan(bad) else 'finite '}number, got {bad!r}"
    if _is_seed(info) and isinstance(value, int) and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        return f"{info.name} must be in {SEED_RANGE[0]}..2**32-1 (what numpy and torch seed with), got {value!r}"
    if info.choices is not None and value not in info.choices:
        return f"{info.name} must be one of {', '.join(map(str, info.choices))}, got {value!r}"
    if info.min is not None and value < info.min:
        return f"{info.name} must be >= {info.min}, got {value!r}"
    if info.max is not None and value > info.max:
        return f"{info.name} must be <= {info.max}, got {value!r}"
    return None


class Configurable:
    """A component built from a :class:`Config` dataclass (rewards,
    generators): ``Cls(**options)`` or ``Cls(config)``, both validated.
    ``self.args`` holds the config (as ``trainer.args`` does in TRL), options
    read as attributes, and ``config()`` and the repr come from it.

    Subclasses set ``config_class``, ``kind`` ("reward", ...) and ``name``."""

    kind: ClassVar[str] = "component"
    name: ClassVar[str] = ""
    config_class: ClassVar[type[Config]] = Config

    def __init__(self, config: Config | None = None, /, **options: Any) -> None:
        cls = type(self)
        if config is None:
            try:
                config = cls.config_class.from_mapping(options)
            except (TypeError, ValueError) as exc:
                # Name the component, not its config class, as users call it.
                owner = f"{self.kind} {self.name or cls.__name__!r}"
                raise ConfigError.of(exc).named(owner, cls.config_class._label()) from None
        elif options or not isinstance(config, cls.config_class):
            raise TypeError(
                f"{self.kind} {self.name!r}: give a {cls.config_class.__name__} or keyword options, "
                f"got {type(config).__name__}{' and options' if options else ''}"
            )
        self.args = config

    def __getattr__(self, name: str) -> Any:
        # Options read as attributes (reward.chunk_size); only called when
        # normal lookup fails, so derived attributes (GROOViST's resolved
        # theta) take precedence.
        args = self.__dict__.get("args")
        if args is None or name.startswith("_") or not hasattr(args, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(args, name)

    def config(self) -> dict[str, Any]:
        """The options that recreate this object (for configs and logs)."""
        return self.args.to_dict()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({params})"
