"""Reading the text of input files the same way everywhere: UTF-8 with an
optional byte-order mark (Excel writes one at the start of CSV/TSV/JSONL),
and JSON whose size limits (nesting depth, digits of an integer) are parse
errors with a position, like any other malformed JSON, so that the readers'
one-line errors name the file and the record."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import IO, Any

__all__ = ["ENCODING", "csv_problem", "json_loads", "open_text", "read_text"]

#: UTF-8; a leading byte-order mark is dropped.
ENCODING = "utf-8-sig"


def read_text(path: str | os.PathLike) -> str:
    """The file's text (UTF-8, a leading byte-order mark dropped)."""
    return Path(path).read_text(encoding=ENCODING)


def open_text(path: str | os.PathLike) -> IO[str]:
    """The file opened for the csv module (UTF-8, a leading byte-order mark dropped)."""
    return open(path, encoding=ENCODING, newline="")  # noqa: SIM115


def _deepest(text: str) -> int:
    """Where the nesting of ``text`` first reaches its greatest depth
    (outside strings)."""
    depth = best = where = 0
    in_string = escaped = False
    for k, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > best:
                best, where = depth, k
        elif ch in "]}":
            depth -= 1
    return where


def json_loads(text: str, **kwargs: Any) -> Any:
    """:func:`json.loads`, with JSON too deeply nested for Python's recursion
    limit or an integer longer than Python converts
    (:func:`sys.get_int_max_str_digits`) raised as :class:`json.JSONDecodeError`
    at the place of the fault, instead of RecursionError / a bare ValueError."""
    try:
        return json.loads(text, **kwargs)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, _deepest(text)) from None
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise  # e.g. a hook's own error
        limit = sys.get_int_max_str_digits()
        match = re.search(rf"\d{{{limit + 1},}}", text)
        raise json.JSONDecodeError(f"a number with more than {limit} digits", text,
                                   match.start() if match else 0) from None


def csv_problem(exc: Exception) -> str:
    """A csv.Error's message for a one-line error."""
    message = " ".join(str(exc).split())
    match = re.fullmatch(r"field larger than field limit \((\d+)\)", message)
    if match:
        return f"a field longer than {int(match.group(1)):,} characters (the csv module's limit)"
    return message
