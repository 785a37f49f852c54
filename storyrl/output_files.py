"""Result files that neither a kill nor a second process can corrupt.

Commands that write results as they go (score tables, ``--explain`` files,
region tables) and commands that write a whole table open their output with
:class:`LockedOutput`:

* The file is locked (``flock``, exclusive) from opening to closing, so a
  second writer fails at once with an error naming the file. The lock is on
  the file itself, and a replaced file is locked before it is renamed into
  place, so there is no moment at which another process can take it.
* It is created only when opened: open it once the job is ready to write
  (models loaded), so a failed start leaves nothing behind.
* Existing content is read back (:meth:`LockedOutput.read`), validated by the
  caller, and only then repaired: :meth:`LockedOutput.replace` writes the kept
  text aside, fsyncs it and renames it over the file, so a kill during a
  repair leaves either the old or the new file, never an empty one.

Locking needs ``fcntl`` (Linux, macOS); elsewhere files are not locked.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import tempfile
from pathlib import Path
from typing import Literal, TextIO

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here
    fcntl = None

__all__ = ["LockedOutput", "OutputError", "OutputExistsError", "check_output", "replace_file"]

Existing = Literal["refuse", "keep", "truncate"]


class OutputError(Exception):
    """An output file that cannot be written: in use, exists, unwritable."""


class OutputExistsError(OutputError):
    """A non-empty output file exists and may not be replaced."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _try_lock(fd: int) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _busy(path: Path) -> OutputError:
    return OutputError(f"{path}: in use by another process (it holds the file's lock); wait for it or write elsewhere")


def check_output(path: str | os.PathLike, existing: Existing = "refuse") -> None:
    """Cheap checks before a job starts (models load, ...): the file is not a
    directory, not locked by another writer, writable, and absent or empty
    when ``existing="refuse"``. Holds no lock: :class:`LockedOutput` checks
    again when the job opens the file."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OutputError(f"{path}: not a regular file")
    if path.exists():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise OutputError(f"{path}: cannot open: {_reason(exc)}") from None
        try:
            if not _try_lock(fd):
                raise _busy(path)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)  # releases the probe lock
        if not os.access(path, os.W_OK):
            raise OutputError(f"{path}: cannot write: permission denied")
        if size and existing == "refuse":
            raise OutputExistsError(f"{path}: exists")
        return
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise OutputError(f"{path}: cannot create: {parent} is not a writable directory")


class LockedOutput:
    """An output file held under an exclusive lock until :meth:`close`.

    ``existing`` says what to do with a non-empty file: ``"refuse"``
    (OutputError), ``"keep"`` (resume, or a later :meth:`replace`) or
    ``"truncate"`` (overwrite; done under the lock, so a running writer's
    file is never emptied). Missing parent directories are created."""

    def __init__(self, path: str | os.PathLike, existing: Existing = "refuse") -> None:
        self.path = Path(path)
        # Through a symlink, the linked file is the one written and replaced.
        self._file = Path(os.path.realpath(self.path))
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot create: {_reason(exc)}") from None
        try:
            if not _try_lock(fd):
                raise _busy(self.path)
            # Another process may have renamed a repaired file over the path
            # between our open and our lock: then we locked a dead inode.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # e.g. /dev/full: reads never end
                raise OutputError(f"{self.path}: not a regular file")
            try:
                now = os.stat(self._file)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise _busy(self.path)
            if st.st_size and existing == "refuse":
                raise OutputExistsError(f"{self.path}: exists")
            if st.st_size and existing == "truncate":
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        # Copies written aside by a process killed during a repair: only a
        # holder of this file's lock writes them, and that is now us.
        for stale in self._file.parent.glob(f".{glob.escape(self._file.name)}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        self._fd: int | None = fd
        self._stream: TextIO | None = None

    # -- reading and repairing ----------------------------------------------
    def read(self) -> tuple[str, str]:
        """The file's text split into ``(complete, partial)``: ``complete``
        ends at the last newline, ``partial`` is a last line cut by a kill
        (empty when the file ends with a newline)."""
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self._fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        cut = data.rfind(b"\n") + 1
        try:
            # A kill can cut a multi-byte character only in the partial line.
            return data[:cut].decode("utf-8"), data[cut:].decode("utf-8", errors="replace")
        except UnicodeDecodeError as exc:
            raise OutputError(f"{self.path}: not UTF-8 text at byte {exc.start}; not a file storyrl wrote") from None

    def replace(self, text: str) -> None:
        """Make ``text`` the file's content atomically: write it aside,
        fsync, lock the new file, rename it over the old one, fsync the
        directory. A kill at any point leaves the old or the new content."""
        fd, tmp = tempfile.mkstemp(dir=self._file.parent, prefix=f".{self._file.name}.", suffix=".tmp")
        try:
            data = text.encode("utf-8")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            _try_lock(fd)  # a fresh file: nobody else can hold it
            os.chmod(tmp, os.stat(self._file).st_mode & 0o7777)
            os.replace(tmp, self._file)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise OutputError(f"{self.path}: cannot write: {_reason(exc)}") from None
        _fsync_dir(self._file.parent)
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        os.close(self._fd)  # releases the old inode's lock; the new one is held
        self._fd = fd

    # -- appending ----------------------------------------------------------
    def stream(self) -> TextIO:
        """A text stream appending at the end of the file (``newline=""``:
        the csv module writes its own line ends)."""
        if self._stream is None:
            os.lseek(self._fd, 0, os.SEEK_END)
            self._stream = open(self._fd, "a", encoding="utf-8", newline="", closefd=False)  # noqa: SIM115
        return self._stream

    def write(self, text: str) -> None:
        """Append ``text`` and flush it to the OS (a killed process loses
        nothing written before)."""
        try:
            stream = self.stream()
            stream.write(text)
            stream.flush()
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write: {_reason(exc)}") from None

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            if self._stream is not None:
                self._stream.close()
            os.fsync(self._fd)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot write: {_reason(exc)}") from None
        finally:
            os.close(self._fd)
            self._fd = self._stream = None

    def discard(self) -> None:
        """Delete the file (still under the lock, so no other writer's file
        is removed) and close it: for a run that produced nothing."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file)
        if self._stream is not None:
            self._stream.close()
        os.close(self._fd)
        self._fd = self._stream = None

    def __enter__(self) -> LockedOutput:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def replace_file(path: str | os.PathLike, text: str, overwrite: bool = False) -> None:
    """Write a whole file atomically under the lock (refusing an existing
    non-empty file unless ``overwrite``)."""
    with LockedOutput(path, existing="keep" if overwrite else "refuse") as out:
        out.replace(text)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
