"""A training run's output directory: one run per directory, never two mixed.

Every trainer (``storyrl train <name>`` and the library functions behind it)
runs inside :func:`run_directory`:

* the directory is locked (``flock`` on ``OUTPUT_DIR/.storyrl-run.lock``)
  for the whole run, so a second run on it fails at once naming it;
* a run that does not resume refuses a directory that already holds files
  (another run's history, checkpoints, ``final/``/``best/``) unless
  ``overwrite`` is given, which clears it first: a later ``--resume`` can
  never mix two runs' checkpoints;
* ``resume`` and ``overwrite`` exclude each other.

Only the main process (global rank 0, read from the launcher's ``RANK``
before any accelerate state exists) checks, clears and locks; the others of
a multi-process run share its lock.

:func:`process_state` is accelerate's process state on the device the
trainers' accelerators use: a bare ``PartialState()`` on a CPU machine under
``torchrun``/``accelerate launch`` sees one process, and being created first
it made every later accelerator of that process see one too (N copies of a
single-process run).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

__all__ = ["LOCK_FILE", "RunDirectoryError", "RunFailedError", "guarded", "is_main_process", "lock_directory",
           "process_state", "run_directory"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".storyrl-run.lock"


class RunDirectoryError(ValueError):
    """An output directory a run may not use (in use, holds another run)."""


class RunFailedError(ValueError):
    """A run that ended without training anything worth keeping (no step, no
    scorable story); it writes no final policy."""


def process_state():
    """accelerate's ``PartialState`` with the trainers' device choice (CPU when
    there is no CUDA), so that it and every later ``Accelerator`` agree."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def is_main_process() -> bool:
    """Global rank 0 of the launch (``RANK`` as torchrun and accelerate set
    it; a plain process is rank 0). Creates no accelerate state."""
    return int(os.environ.get("RANK", "0") or 0) == 0


@contextlib.contextmanager
def lock_directory(directory: str | os.PathLike) -> Iterator[Path]:
    """Hold ``directory`` (created if needed) exclusively until the block
    ends; a second holder fails at once naming it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunDirectoryError(f"{directory}: in use by another run (it holds {directory / LOCK_FILE}); "
                                        "wait for it to end or use another output_dir") from None
        yield directory
    finally:
        os.close(fd)  # releases the lock


def _clear(directory: Path, entries: list[Path]) -> None:
    for path in entries:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    logger.warning("--overwrite: removed the earlier run in %s (%d entries)", directory, len(entries))


@contextlib.contextmanager
def run_directory(output_dir: str | os.PathLike, resume: bool = False, overwrite: bool = False) -> Iterator[Path]:
    """Hold ``output_dir`` for one run (module docs)."""
    if resume and overwrite:
        raise RunDirectoryError("resume and overwrite exclude each other: --resume continues the run in "
                                f"{output_dir}, --overwrite replaces it")
    directory = Path(output_dir)
    if not is_main_process():
        yield directory
        return
    if directory.exists() and not directory.is_dir():
        raise RunDirectoryError(f"{directory}: exists and is not a directory")
    with lock_directory(directory):
        entries = sorted(p for p in directory.iterdir() if p.name != LOCK_FILE)
        if entries and not resume:
            if not overwrite:
                shown = ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")
                raise RunDirectoryError(f"{directory} already holds a run ({shown}); continue it with --resume, "
                                        "replace it with --overwrite, or use another output_dir")
            _clear(directory, entries)
        yield directory


def guarded(train: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a trainer's ``train(config, resume=False, progress=True, ...)``
    so that it runs inside :func:`run_directory` and takes ``overwrite``."""

    @functools.wraps(train)
    def run(config, resume: bool = False, progress: bool = True, *args, overwrite: bool = False, **kwargs):
        with run_directory(config.output_dir, resume=resume, overwrite=overwrite):
            return train(config, resume, progress, *args, **kwargs)

    run.storyrl_guarded = True
    return run
