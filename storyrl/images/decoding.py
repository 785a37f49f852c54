"""Decoding image sources to RGB uint8 arrays, in worker processes.

:func:`decode_rgb` decodes one source (a path or a PIL image) exactly as
the exact pipeline's ``load_region`` does (:func:`storyrl.images.
decode_worker.open_rgb`), with the same :class:`ImageError` reasons.

:class:`DecodePool` decodes files in persistent worker processes
(fresh interpreters: safe after CUDA is initialised, the caller's main
module is not re-run, and a worker imports PIL only). Results come back in order,
``prefetch`` files ahead, so decoding overlaps whatever the caller does
between results (the model's forward passes). A reader thread drains the
workers' sockets as results arrive, so a worker never waits for the caller.
A file that cannot be read is that file's :class:`ImageError`; a worker
that dies (crash, kill) has its files retried on a fresh worker, and a file
that kills a worker twice, or takes longer than ``timeout_s``, is that
file's :class:`ImageError`: no wait is unbounded and no batch is lost.
:func:`decode_sources` is the entry point: in-memory images and a handful
of files are decoded inline, more go through the shared pool
(:func:`shared_pool`, started on first use).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

import numpy as np

from storyrl.images.decode_worker import READ_ERRORS, failure_reason, open_rgb, settings
from storyrl.images.loading import ImageError, _is_pil, _source_name

log = logging.getLogger(__name__)

#: Fewer files than this are decoded inline: starting workers costs more.
INLINE_BELOW = 8
_SOCKET_BUFFER = 4 << 20
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def decode_rgb(source: Any) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB pixels of ``source`` (ImageError if unreadable)."""
    try:
        return np.array(open_rgb(source))  # writable (np.asarray's is not), for torch.from_numpy
    except READ_ERRORS as exc:
        raise ImageError(_source_name(source), failure_reason(exc)) from exc


@dataclass
class _Job:
    source: str
    alloc: Callable[[int], Any]
    tries: int = 0
    fatal: str | None = None  # the reason to give if its worker dies now (a timeout)
    abandoned: bool = False
    slot: _Slot | None = None  # where the worker writes the pixels


class _Slot:
    """A shared-memory buffer (a ``/dev/shm`` file) a worker writes one
    image's pixels into: a socket would copy them through the kernel at a
    fraction of memory speed. Its space is reserved when it is made, so a
    full ``/dev/shm`` is an OSError here (the socket is used instead), never
    a SIGBUS in a worker."""

    def __init__(self, capacity: int) -> None:
        import mmap
        import uuid
        from multiprocessing import resource_tracker

        self.name = f"storyrl-decode-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.capacity = capacity
        path = os.path.join("/dev/shm", self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)
            self.map = mmap.mmap(fd, capacity)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        # The resource tracker unlinks it should this process die without release().
        resource_tracker.register("/" + self.name, "shared_memory")

    def release(self) -> None:
        from multiprocessing import resource_tracker

        self.map.close()
        try:
            os.unlink(os.path.join("/dev/shm", self.name))
        except OSError:
            pass
        resource_tracker.unregister("/" + self.name, "shared_memory")


class _Worker:
    """One worker: a fresh interpreter (``python -c``, so no parent state:
    safe after CUDA is initialised, and the caller's main module is not
    re-run as multiprocessing's spawn would) that serves on a socket pair."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        for sock in (parent, child):
            try:  # large enough that a worker need not wait for the reader
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
            except OSError:
                pass
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        code = "import sys; from storyrl.images.decode_worker import serve_fd; serve_fd(int(sys.argv[1]))"
        try:
            self.process = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())],
                                            pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self.conn = connection.Connection(parent.detach())
        self.jobs: deque[int] = deque()  # sent and not answered, oldest (being decoded) first
        self.busy_since = time.monotonic()
        self.dead = False

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None


class DecodePool:
    """Worker processes that decode image files (module docs).

    ``workers`` processes (default: the CPU count, at most 16), started on
    first use; ``timeout_s`` bounds the decoding of one file."""

    def __init__(self, workers: int | None = None, timeout_s: float = 120.0) -> None:
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers or max(1, min(16, os.cpu_count() or 1))
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._results: dict[int, Any] = {}
        self._queue: deque[int] = deque()  # jobs waiting for a worker, retries first
        self._pool: list[_Worker] = []
        self._next_id = 0
        self._closed = False
        self._reader: threading.Thread | None = None
        self._wake_r, self._wake_w = connection.Pipe(duplex=False)
        self.pid = os.getpid()
        self.stats = {"decoded": 0, "failed": 0, "worker_deaths": 0}
        self._free_slots: list[_Slot] = []
        self._slot_count = 0
        self._slot_size = 4 << 20  # grows to the largest image met
        self._slots_ok = os.path.isdir("/dev/shm")
        self.slot_names: list[str] = []  # every slot made (tests check close() removes them)
        self.start_error: str | None = None

    # -- caller side -------------------------------------------------------------
    def imap(self, paths: Iterable[str], prefetch: int | None = None,
             alloc: Callable[[int], Any] | None = None) -> Iterator[tuple[Any, int, int] | ImageError]:
        """``(buffer, height, width)`` per path, in order (the RGB bytes in
        ``buffer``, from ``alloc(nbytes)``, default a numpy array), or the
        path's ImageError. Up to ``prefetch`` (default 4 per worker) files
        are decoded ahead of the one being consumed."""
        alloc = alloc or (lambda n: np.empty(n, dtype=np.uint8))
        prefetch = prefetch or 4 * self.workers
        paths = iter(paths)
        ids: deque[int] = deque()
        more = True
        try:
            while True:
                with self._cond:
                    self._start()
                    while more and len(ids) < prefetch:
                        path = next(paths, None)
                        if path is None:
                            more = False
                            break
                        ids.append(self._submit(path, alloc))
                    if not ids:
                        return
                    result = self._wait(ids[0])
                ids.popleft()
                yield result
        finally:
            with self._cond:
                for job_id in ids:
                    job = self._jobs.get(job_id)
                    if job is None:
                        continue
                    if self._results.pop(job_id, None) is not None or job_id in self._queue:
                        if job_id in self._queue:
                            self._queue.remove(job_id)
                        self._give_back(job)
                        del self._jobs[job_id]
                    else:
                        job.abandoned = True  # being decoded: the reader drops its answer

    def start(self) -> bool:
        """Start the workers now; False (decode inline instead) when none can start."""
        with self._cond:
            self._start()
            self._dispatch()
            return bool(self._pool)

    def worker_modules(self, timeout_s: float = 60.0) -> list[list[str]]:
        """The top-level modules each worker has loaded (to check that none imports torch)."""
        with self._cond:
            self._start()
            self._dispatch()
            ids = []
            for worker in self._pool:
                ids.append(self._new_job("<modules>", lambda n: None))
                self._jobs[ids[-1]].fatal = "no answer"
                self._send(worker, ids[-1])
            return [self._wait(job_id, timeout_s) for job_id in ids]

    def close(self) -> None:
        """Stop the workers and the reader (waits at most a few seconds)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, []
            self._cond.notify_all()
        for worker in pool:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in pool:
            if worker.exit_code() is None:
                worker.process.kill()
                worker.exit_code()
            worker.conn.close()
        self._wake_w.send_bytes(b"x")
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
        with self._cond:
            slots = self._free_slots + [job.slot for job in self._jobs.values() if job.slot is not None]
            self._free_slots = []
            for job in self._jobs.values():
                job.slot = None
        for slot in slots:
            slot.release()

    # -- bookkeeping (under self._cond) -------------------------------------------
    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the decode pool is closed")
        if os.getpid() != self.pid:
            raise RuntimeError("a decode pool cannot be used in a forked child; create a new one there")
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="storyrl-decode-reader", daemon=True)
            self._reader.start()

    def _new_job(self, source: str, alloc) -> int:
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = _Job(source, alloc)
        return job_id

    def _submit(self, path: str, alloc) -> int:
        job_id = self._new_job(path, alloc)
        self._queue.append(job_id)
        if any(not w.jobs for w in self._pool) or len(self._pool) < self.workers:
            self._dispatch()  # otherwise the reader sends it when a worker answers
        return job_id

    def _dispatch(self) -> None:
        """Replace dead workers, then hand queued jobs to the least busy (2
        each at most). If no worker can start, the queued files fail (a wait
        on them would never end)."""
        self._pool = [w for w in self._pool if not w.dead]
        while len(self._pool) < self.workers:
            try:
                self._pool.append(_Worker())
            except OSError as exc:
                self.start_error = f"no decode worker could start: {exc}"
                break
            self._wake_w.send_bytes(b"x")  # the reader watches the new socket from now on
        if not self._pool:
            while self._queue:
                job_id = self._queue.popleft()
                self._finish(job_id, ImageError(self._jobs[job_id].source, f"cannot read image: {self.start_error}"))
            self._cond.notify_all()
            return
        while self._queue:
            worker = min(self._pool, key=lambda w: len(w.jobs))
            if len(worker.jobs) >= 2:
                return
            self._send(worker, self._queue.popleft())

    def _send(self, worker: _Worker, job_id: int) -> None:
        if not worker.jobs:
            worker.busy_since = time.monotonic()
        worker.jobs.append(job_id)
        job = self._jobs[job_id]
        if job.slot is None:
            job.slot = self._take_slot()
        slot = None if job.slot is None else (job.slot.name, job.slot.capacity)
        try:
            worker.conn.send((job_id, job.source, settings(), slot))
        except OSError:
            pass  # the worker is gone: the reader sees it and retries the job

    def _take_slot(self) -> _Slot | None:
        while self._free_slots:
            slot = self._free_slots.pop()
            if slot.capacity >= self._slot_size:
                return slot
            slot.release()  # too small for the images met since
            self._slot_count -= 1
        if not self._slots_ok or self._slot_count >= 2 * self.workers + 2:
            return None
        try:
            slot = _Slot(self._slot_size)
        except OSError as exc:  # no /dev/shm or not enough room in it: sockets only
            log.debug("decode pool: no shared memory (%s); pixels go through sockets", exc)
            self._slots_ok = False
            return None
        self._slot_count += 1
        self.slot_names.append(slot.name)
        return slot

    def _give_back(self, job: _Job | None) -> None:
        if job is not None and job.slot is not None:
            self._free_slots.append(job.slot)
            job.slot = None

    def _wait(self, job_id: int, timeout_s: float | None = None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while job_id not in self._results:
            if self._reader is None or not self._reader.is_alive():
                raise RuntimeError("the decode pool's reader thread stopped")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the decode pool in {timeout_s} s")
            self._cond.wait(0.2)
            if any(w.dead for w in self._pool) or not any(w.jobs for w in self._pool):
                self._dispatch()  # a worker died (its jobs are queued again): replace it
            now = time.monotonic()
            for worker in self._pool:
                if worker.jobs and now - worker.busy_since > self.timeout_s and not worker.dead:
                    job = self._jobs[worker.jobs[0]]
                    job.fatal = f"cannot read image: decoding took longer than {self.timeout_s:g} s"
                    worker.process.kill()  # the reader sees it die and fails the job
        del self._jobs[job_id]
        return self._results.pop(job_id)

    def _finish(self, job_id: int, result: Any) -> None:
        job = self._jobs.get(job_id)
        self._give_back(job)
        if job is None or job.abandoned:
            self._jobs.pop(job_id, None)
            return
        self._results[job_id] = result
        self.stats["failed" if isinstance(result, ImageError) else "decoded"] += 1

    def _worker_died(self, worker: _Worker) -> None:
        worker.dead = True
        self.stats["worker_deaths"] += 1
        code = worker.exit_code()
        jobs = list(worker.jobs)
        worker.jobs.clear()
        retry = []
        for k, job_id in enumerate(jobs):
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if k == 0:  # the file being decoded when it died
                job.tries += 1
                if job.fatal or job.tries >= 2:
                    reason = job.fatal or f"cannot read image: the decoding process died twice on it (exit code {code})"
                    self._finish(job_id, ImageError(job.source, reason))
                    continue
            retry.append(job_id)
        self._queue.extendleft(reversed(retry))
        log.debug("decode worker %s died (exit code %s); %d files to retry", worker.process.pid, code, len(retry))

    # -- the reader thread ------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                by_conn = {w.conn: w for w in self._pool if not w.dead}
            ready = connection.wait([*by_conn, self._wake_r], timeout=1.0)
            for conn in ready:
                if conn is self._wake_r:
                    self._wake_r.recv_bytes()
                    continue
                worker = by_conn[conn]
                try:
                    job_id, size, reason = conn.recv()
                    buffer = None
                    if size is not None:
                        with self._cond:
                            job = self._jobs.get(job_id)
                        nbytes = size[0] * size[1] * 3
                        alloc = job.alloc if job is not None else (lambda n: np.empty(n, dtype=np.uint8))
                        buffer = alloc(nbytes)
                        view = np.asarray(buffer.numpy() if hasattr(buffer, "numpy") else buffer)
                        if reason != "slot":
                            conn.recv_bytes_into(memoryview(view).cast("B"))
                            with self._cond:  # too big for the slots: make them bigger
                                self._slot_size = max(self._slot_size, nbytes)
                        elif job is not None and job.slot is not None:
                            np.copyto(view[:nbytes], np.frombuffer(job.slot.map, np.uint8, nbytes))
                except (EOFError, OSError, ValueError):  # ValueError: a slot unmapped by close()
                    with self._cond:
                        if not self._closed:
                            self._worker_died(worker)
                        self._cond.notify_all()
                    continue
                with self._cond:
                    if worker.jobs and worker.jobs[0] == job_id:
                        worker.jobs.popleft()
                    worker.busy_since = time.monotonic()
                    if size is not None:
                        result: Any = (buffer, size[1], size[0])
                    elif isinstance(reason, list):
                        result = reason  # the modules answer
                    else:
                        result = ImageError(self._jobs[job_id].source if job_id in self._jobs else "?", reason)
                    self._finish(job_id, result)
                    # The next job goes out from here, at once: the worker does not idle, and the
                    # caller's thread does not wait for the GIL around a socket write.
                    self._dispatch()
                    self._cond.notify_all()


_shared: list[DecodePool] = []
_warned: list[int] = []
_shared_lock = threading.Lock()


def shared_pool() -> DecodePool:
    """The process-wide :class:`DecodePool` (a new one in a forked child)."""
    with _shared_lock:
        if not _shared or _shared[0].pid != os.getpid() or _shared[0]._closed:
            _shared[:] = [DecodePool()]
        return _shared[0]


@atexit.register
def _close_shared() -> None:
    for pool in _shared:
        if pool.pid == os.getpid():
            pool.close()


def decode_sources(sources: Iterable[Any], *, pool: DecodePool | None = None, inline_below: int = INLINE_BELOW,
                   alloc: Callable[[int], Any] | None = None, prefetch: int | None = None,
                   ) -> Iterator[tuple[Any, int, int] | ImageError]:
    """``(buffer, height, width)`` RGB bytes (or the ImageError) of every
    source, in order: in-memory PIL images are decoded inline; files
    through ``pool`` (default the shared one) when there are at least
    ``inline_below`` of them, inline otherwise."""
    sources = list(sources)
    paths = [s for s in sources if not _is_pil(s)]
    decoded: Iterator | None = None
    if len(paths) >= inline_below:
        pool = pool or shared_pool()
        if pool.start():
            decoded = pool.imap(paths, prefetch=prefetch, alloc=alloc)
        elif not _warned:
            _warned.append(1)
            log.warning("decoding images in this process: %s", pool.start_error)
    try:
        for source in sources:
            if decoded is not None and not _is_pil(source):
                yield next(decoded)
                continue
            try:
                pixels = decode_rgb(source)
            except ImageError as exc:
                yield exc
                continue
            yield pixels, pixels.shape[0], pixels.shape[1]
    finally:
        if decoded is not None:
            decoded.close()
