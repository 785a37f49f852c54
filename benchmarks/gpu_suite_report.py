"""The report machinery of benchmarks/gpu_suite.py: sections and their
tables, skips, the time budget, a part's context, one row's error handling
and the timing/peak-memory helpers."""

from __future__ import annotations

import gc
import math
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# -- the report ---------------------------------------------------------------------------------


class Skip(Exception):
    """A part or a row that cannot run here; the message is the reason."""


@dataclass
class Section:
    key: str
    title: str
    lines: list[str] = field(default_factory=list)
    status: str = "ok"  # ok, skipped, failed
    seconds: float = 0.0

    def table(self, rows: list[dict], columns: list[str] | None = None) -> None:
        if not rows:
            return
        columns = columns or list(rows[0])
        self.lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        self.lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
        self.lines.append("")

    def skip(self, what: str, reason: str) -> None:
        self.lines.append(f"- skipped: {what}: {reason}")

    def note(self, text: str) -> None:
        self.lines.append(f"- {text}")


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "/")


class Budget:
    def __init__(self, minutes: float) -> None:
        self.total = minutes * 60
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)

    def check(self, seconds: float, what: str) -> None:
        if seconds > self.left():
            raise Skip(f"time budget: needs ~{seconds / 60:.1f} min, {max(self.left(), 0) / 60:.1f} min left "
                       f"of {self.total / 60:g} ({what})")


@dataclass
class Context:
    tiny: bool
    device: str  # cpu or cuda
    budget: Budget
    root: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def need_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"no CUDA device ({what} needs one)")


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def need(module: str, extra: str) -> None:
    if not _have(module):
        raise Skip(f"{module} is not installed ({extra})")


def _is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def free_memory() -> None:
    from storyrl.models.runtime import release_models

    release_models()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def row(section: Section, what: str):
    """Run one row: a Skip or an out-of-memory error becomes a skip line, any
    other error a FAILED line that fails the part; either way the part goes on
    with its other rows (one GPU run should keep every figure it can get)."""
    try:
        yield
    except Skip as exc:
        section.skip(what, str(exc))
    except Exception as exc:  # noqa: BLE001  (reported in the section)
        if _is_oom(exc):
            section.skip(what, f"out of memory: {_one_line(exc)}")
        else:
            section.status = "failed"
            section.lines.append(f"- FAILED: {what}: {type(exc).__name__}: {_one_line(exc)}")
            traceback.print_exc()
        free_memory()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:300] + "…") if len(text) > 300 else text


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def timed(fn, device: str, *args, **kwargs):
    """(seconds, ``fn(*args, **kwargs)``), the device synchronised around it."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - t0, out
