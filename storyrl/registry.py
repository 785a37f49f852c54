"""One registry mechanism for rewards, trainers and generators (timm-style).

A :class:`Registry` maps names to components. Built-ins are added by import
path (``"module:attr"``) with a one-line description, so listing them
(``storyrl rewards``) imports nothing heavy; the component is imported on
first :meth:`Registry.get`. Your own components are added with the
:meth:`Registry.register` class decorator. Each package keeps its registry
and a ``create_*`` factory beside it: ``storyrl.rewards.REWARDS`` /
``create_reward``, ``storyrl.training.TRAINERS``,
``storyrl.generators.GENERATORS`` / ``create_generator``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


def _first_line(doc: str | None) -> str:
    """The first sentence-line of a docstring (its summary)."""
    lines = (doc or "").strip().splitlines()
    return lines[0].strip() if lines else ""


class Registry(Generic[T]):
    """Named components of one ``kind`` ("reward", "trainer", ...).

    ``aliases`` maps old or alternative spellings to names (they resolve but
    are not listed)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}
        self._descriptions: dict[str, str] = {}
        self._aliases: dict[str, str] = {}

    def add(self, name: str, target: T | str, description: str | None = None, aliases: tuple[str, ...] = (),
            *, replace: bool = False) -> None:
        """Register ``target`` (an object or a lazy ``"module:attr"`` path)
        under ``name``; ``description`` defaults to the first line of its
        docstring (required for lazy targets, which are not imported here).
        A name or alias already taken is a ValueError unless ``replace``:
        a second component of one name would silently win."""
        if not name:
            raise ValueError(f"a registered {self.kind} needs a name")
        if not replace:
            for key in (name, *aliases):
                if key in self:
                    raise ValueError(f"{self.kind} {key!r} is already registered (as {self.resolve(key)!r}); "
                                     "choose another name, or pass replace=True to replace it")
        if description is None:
            if isinstance(target, str):
                raise ValueError(f"{self.kind} {name!r}: a lazily imported target needs a description")
            description = _first_line(target.__doc__)
        self._aliases.pop(name, None)  # (a replaced alias would shadow the new entry)
        self._entries[name] = target
        self._descriptions[name] = description
        for alias in aliases:
            self._aliases[alias] = name

    def register(self, name: str | None = None, *, description: str | None = None,
                 replace: bool = False) -> Callable[[T], T]:
        """Class decorator: register under ``name`` (default: the class's
        ``name`` attribute); see :meth:`add` for ``replace``."""

        def decorator(target: T) -> T:
            self.add(name or getattr(target, "name", ""), target, description, replace=replace)
            return target

        return decorator

    def resolve(self, name: str) -> str:
        """The registered name for ``name`` or one of its aliases (KeyError
        listing the available names otherwise)."""
        name = self._aliases.get(name, name)
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return name

    def get(self, name: str) -> T:
        """The component registered as ``name``, imported on first use."""
        name = self.resolve(name)
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attr)
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self, name: str) -> str:
        """The one-line description of ``name``."""
        return self._descriptions[self.resolve(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
