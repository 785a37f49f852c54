"""The d_HM authors' post-processing of generated text (reference notes,
"Zero-shot prompting")."""

from __future__ import annotations

import re

__all__ = ["clean_generation", "join_sentence_outputs"]

_BLANK_LINES = re.compile(r"\n\s*\n")


def clean_generation(decoded: str) -> str:
    """A decoded generation (special tokens skipped) as the authors kept it:
    the text after the last ``[/INST]``, é/ê as e, blank lines as a space,
    surrounding whitespace stripped."""
    text = decoded.rsplit("[/INST]", 1)[-1]
    text = text.replace("é", "e").replace("ê", "e")
    return _BLANK_LINES.sub(" ", text).strip()


def join_sentence_outputs(text: str) -> str:
    """The story of the sentence-per-image settings: split on '.', each piece
    stripped of spaces and quotes, empty pieces dropped, joined with ' . '
    and ended with ' .' (the authors' format)."""
    pieces = [p.strip().strip("\"'").strip() for p in text.split(".")]
    pieces = [p for p in pieces if p]
    return " . ".join(pieces) + " ." if pieces else ""
