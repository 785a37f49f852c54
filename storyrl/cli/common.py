"""Helpers shared by the command modules: the one-line error, output-file
checks, the JSON summary line and click's path types."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click


class CommandError(click.ClickException):
    """A one-line error ending the command with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fail(message: str, exit_code: int = 1) -> None:
    raise CommandError(message, exit_code)


_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def _metric_list(value: str | None) -> list[str]:
    return [m.strip() for m in (value or "").split(",") if m.strip()]


def _finite(value):
    """``value`` with NaN and infinities (not JSON) as None, inside dicts and lists too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _json(summary: dict) -> str:
    """One JSON line; NaN and infinities (not JSON) become null."""
    return json.dumps(_finite(summary))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b) or a.resolve() == b.resolve()
    except OSError:
        return False


def _check_outputs(
    outputs: dict[str, Path | None], inputs: list, existing: str,
    hint: str = "use --resume to continue it or --overwrite to replace it",
) -> None:
    """Before any work: no output is an input or another output, none is
    locked by another writer, unwritable, or (without --resume/--overwrite)
    already there."""
    from storyrl.output_files import OutputExistsError, check_output

    named = [(flag, path) for flag, path in outputs.items() if path is not None]
    for k, (flag, path) in enumerate(named):
        for source in inputs:
            if source is not None and _same_file(path, Path(source)):
                _fail(f"{flag} {path} is also an input file; it would be destroyed: write elsewhere")
        for other_flag, other in named[:k]:
            if _same_file(path, other):
                _fail(f"{flag} and {other_flag} are the same file {path}")
        try:
            check_output(path, existing)
        except OutputExistsError:
            _fail(f"{path} exists: {hint}")
