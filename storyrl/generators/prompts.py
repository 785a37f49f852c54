"""Prompt templates for zero-shot story generation (data in ``configs/prompts/``).

A template has a ``name`` (P1, P2, ...), a ``kind`` -- ``visual`` (the whole
image sequence as one image, ``{n}`` = the number of sentences as a word) or
``sentence`` (one sentence per image, ``{context}`` = the story so far) --
and a ``text``. The chat wrapper is the model's business.

Quirk kept on request: the d_HM authors' script sent the visual prompts with
the count placeholder unfilled (the model read "exactly N sentences");
``fill_count=False`` reproduces that, so their story files can be regenerated.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AUTHORS_PLACEHOLDER", "KINDS", "PromptTemplate", "count_word", "load_prompts", "mistral_inst"]

KINDS = ("visual", "sentence")
_FIELDS = {"visual": {"n"}, "sentence": {"context"}}
_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen", "twenty"]
#: What the authors' prompts showed in place of the count.
AUTHORS_PLACEHOLDER = "N"


def count_word(n: int) -> str:
    """The count as an English word (up to twenty; digits beyond)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a sentence count is a non-negative integer, got {n!r}")
    return _WORDS[n] if n < len(_WORDS) else str(n)


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    kind: str
    text: str

    def render(self, n: int | None = None, context: str = "", fill_count: bool = True) -> str:
        """The prompt text: ``visual`` templates need ``n`` (filled in as a
        word, or the authors' ``N`` with ``fill_count=False``); ``sentence``
        templates take the ``context``."""
        if self.kind == "visual":
            if fill_count and n is None:
                raise ValueError(f"prompt {self.name}: a visual prompt needs the sentence count n")
            return self.text.format(n=count_word(n) if fill_count else AUTHORS_PLACEHOLDER)
        return self.text.format(context=context)


def mistral_inst(text: str) -> str:
    """The LLaVA-NeXT Mistral prompt of one image and ``text``, as the
    authors wrote it."""
    return f"[INST] <image>\n{text} [/INST]"


def load_prompts(path: str | os.PathLike) -> dict[tuple[str, str], PromptTemplate]:
    """Templates of a prompts file, keyed by ``(kind, name)``. Errors are
    ValueErrors naming the file, the entry and the fault."""
    from storyrl.config import load_yaml

    path = Path(path)
    data = load_yaml(path)
    entries = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a 'prompts' list")
    out: dict[tuple[str, str], PromptTemplate] = {}
    for i, entry in enumerate(entries, 1):
        where = f"{path}: prompt {i}"
        if not isinstance(entry, dict) or set(entry) != {"name", "kind", "text"}:
            raise ValueError(f"{where}: expected exactly the keys name, kind, text")
        if not all(isinstance(entry[k], str) and entry[k] for k in ("name", "kind", "text")):
            raise ValueError(f"{where}: name, kind and text must be non-empty strings")
        if entry["kind"] not in KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {entry['kind']!r}")
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(entry["text"]) if f is not None}
        except ValueError as exc:
            raise ValueError(f"{where}: bad placeholder in text: {exc}") from None
        if fields != _FIELDS[entry["kind"]]:
            want = ", ".join("{" + f + "}" for f in sorted(_FIELDS[entry["kind"]]))
            raise ValueError(f"{where}: a {entry['kind']} prompt uses exactly {want}, found {sorted(fields)}")
        key = (entry["kind"], entry["name"])
        if key in out:
            raise ValueError(f"{where}: a {key[0]} prompt named {key[1]!r} is already defined")
        out[key] = PromptTemplate(entry["name"], entry["kind"], entry["text"])
    return out
