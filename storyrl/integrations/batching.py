"""Batching concurrent reward requests onto one reward call.

Used by ``storyrl serve`` (requests from many trainer nodes) and by verl's
asynchronous reward loop (one ``compute_score`` call per sample, many at a
time): a model reward then makes one forward per batch, not per story.

What a request gets does not depend on the requests batched with it: a
failing batch is retried request by request, and a request of several
stories that all came back unscorable from a shared call is scored again
alone (a reward raising for every story of a call is a reward failure, so
alone it may be an error rather than fallbacks). Only a reward normalised
per batch or group sees its batch company, by definition.

The reward runs in one daemon thread: a call cannot be interrupted, but a
stuck call can neither keep the process from exiting nor go unanswered --
past ``timeout_s`` its requests get :class:`CallTimeout`, and until it
returns new requests get :class:`Busy` at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import storyrl.integrations.scoring as _core

__all__ = ["Busy", "CallTimeout", "Closing", "RequestBatcher"]

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The reward worker is stuck in a call that ran past the time limit."""


class CallTimeout(TimeoutError):
    """The reward call holding a request ran past the time limit."""


class Closing(RuntimeError):
    """The batcher is shutting down (or not started)."""


@dataclass
class _Job:
    stories: list[str]
    contexts: list[dict[str, Any]]
    prompts: list[str | None]
    future: asyncio.Future


class _DaemonWorker:
    """One daemon thread running submitted calls in order. Unlike a
    ThreadPoolExecutor's thread (joined at interpreter exit), a reward call
    that never returns cannot keep the process alive."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        self._calls.put(None)  # the thread ends after the call it runs, if any

    def _loop(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting request
                future.set_exception(exc)


def _positive_finite(name: str, value: float | None, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


class RequestBatcher:
    """Collects requests into batches and scores each batch with one call of
    ``score(stories, contexts, prompts) -> Scored`` in a single worker
    thread. ``timeout_s`` (None: no limit) bounds each batch's scoring,
    retries included."""

    def __init__(self, score: Callable[[list[str], list[dict], list], _core.Scored], *, max_batch_size: int = 64,
                 max_wait_ms: float = 10.0, timeout_s: float | None = None) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        # inf would make the first request wait for ever; nan compares false with everything
        _positive_finite("max_wait_ms", max_wait_ms, allow_zero=True)
        _positive_finite("timeout_s", timeout_s, allow_none=True)
        self._score = score
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.timeout_s = timeout_s
        self.stats: Counter = Counter()
        self.batch_sizes: Counter = Counter()  # stories per reward call -> number of calls
        self._jobs: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._arrived: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._thread: _DaemonWorker | None = None
        self._closing = False
        self.stuck_since: float | None = None  # loop.time() when a call ran past timeout_s

    async def start(self) -> None:
        self._arrived, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        # One thread: the reward's models are used from one thread, one batch at a time.
        self._thread = _DaemonWorker("storyrl-reward")
        self._worker = asyncio.create_task(self._run())

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop taking requests (new ones get :class:`Closing`), let the
        queued and running ones finish for up to ``grace_s`` seconds, then
        answer the rest with :class:`Closing` and stop the worker."""
        self._closing = True
        if self._idle is not None and grace_s > 0 and self.stuck_since is None:
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except asyncio.TimeoutError:
                log.warning("reward server shutting down: answering %d unfinished request(s) with 503",
                            len(self._jobs) + len(self._running))
        await self.stop()

    async def stop(self) -> None:
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        for job in [*self._running, *self._jobs]:
            if not job.future.done():
                job.future.set_exception(Closing("the server is shutting down"))
        self._jobs.clear()
        self._running = []
        if self._thread is not None:
            self._thread.shutdown()

    async def submit(self, stories: list[str], contexts: list[dict[str, Any]],
                     prompts: list[str | None] | None = None) -> _core.Scored:
        """Queue one request's stories (with their contexts and prompts);
        returns their scores, or raises the reward's error,
        :class:`CallTimeout`, :class:`Busy` or :class:`Closing`. Cancelling
        the caller drops the request if its batch has not started."""
        if self._closing or self._worker is None or self._worker.done():
            raise Closing("the reward worker is not running")
        if self.stuck_since is not None:
            raise Busy(self._stuck_message())
        prompts = list(prompts) if prompts is not None else [None] * len(stories)
        job = _Job(stories, contexts, prompts, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._idle.clear()
        self._arrived.set()
        self.stats["requests"] += 1
        return await job.future  # a cancelled caller cancels the future: the worker skips the job

    def _stuck_message(self) -> str:
        seconds = asyncio.get_running_loop().time() - self.stuck_since + (self.timeout_s or 0)
        return (f"the reward worker is busy with a call that has run {seconds:.0f} s, past the {self.timeout_s:g} s "
                "limit; retry later")

    def _next_job(self) -> _Job | None:
        while self._jobs:
            job = self._jobs[0]
            if not job.future.done():
                return job
            self._jobs.popleft()  # its client went away before its batch started
            self.stats["dropped_requests"] += 1
        return None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._next_job() is None:
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._jobs.popleft()]
            self._running = batch  # while gathered too: stop() answers it
            size = len(batch[0].stories)
            deadline = loop.time() + self.max_wait_ms / 1000
            while size < self.max_batch_size:
                job = self._next_job()
                if job is not None:
                    if size + len(job.stories) > self.max_batch_size:
                        break  # it starts the next batch
                    batch.append(self._jobs.popleft())
                    size += len(job.stories)
                    continue
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except asyncio.TimeoutError:
                    break
            batch = [job for job in batch if not job.future.done()]  # clients gone while it waited
            self._running = batch
            if not batch:
                continue
            call = asyncio.wrap_future(self._thread.submit(self._score_jobs, batch))
            done, _ = await asyncio.wait({call}, timeout=self.timeout_s)
            if not done:
                await self._timed_out(call, batch)
                continue
            self._running = []
            for job, result in zip(batch, call.result()):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    async def _timed_out(self, call: asyncio.Future, batch: list[_Job]) -> None:
        """The call ran past ``timeout_s``: its requests and the queued ones
        are answered now; new ones are refused until the call returns (the
        thread cannot be stopped; its result is dropped)."""
        self.stats["timed_out_calls"] += 1
        self.stuck_since = asyncio.get_running_loop().time()
        log.error("reward call on %d stories ran past %g s; refusing requests until it returns",
                  sum(len(j.stories) for j in batch), self.timeout_s)
        error = CallTimeout(f"the reward call ran past the {self.timeout_s:g} s limit")
        for job in batch:
            if not job.future.done():
                job.future.set_exception(error)
        while self._jobs:
            job = self._jobs.popleft()
            if not job.future.done():
                job.future.set_exception(Busy(self._stuck_message()))
        self._running = []
        try:
            await asyncio.wait({call})
        finally:
            self.stuck_since = None
            if call.done() and not call.cancelled():
                call.exception()  # retrieved: no "never retrieved" warning
        log.warning("the reward call that ran past the time limit has returned; serving again")

    def _score_jobs(self, batch: list[_Job]) -> list[_core.Scored | BaseException]:
        """One reward call for the batch; when it fails and holds several
        requests, one call per request; a request of several stories all
        unscorable in a shared call is scored alone (worker thread)."""
        try:
            scored = self._call([s for job in batch for s in job.stories], [c for job in batch for c in job.contexts],
                                [p for job in batch for p in job.prompts])
        except Exception as exc:
            if len(batch) == 1:
                self.stats["failed_requests"] += 1
                return [exc]
            log.warning("reward failed for a batch of %d requests; retrying them one by one: %s", len(batch), exc)
            return [self._alone(job) for job in batch]
        out, start = [], 0
        for job in batch:
            part = scored.part(start, start + len(job.stories))
            start += len(job.stories)
            if len(batch) > 1 and len(part) > 1 and not np.isfinite(part.scores).any():
                part = self._alone(job)  # what it gets alone: maybe the reward's error
            out.append(part)
        return out

    def _alone(self, job: _Job) -> _core.Scored | BaseException:
        if job.future.done():  # gone: not worth a call
            return Closing("the request was dropped")
        try:
            return self._call(job.stories, job.contexts, job.prompts)
        except Exception as exc:
            self.stats["failed_requests"] += 1
            return exc

    def _call(self, stories: list[str], contexts: list[dict], prompts: list) -> _core.Scored:
        self.stats["reward_calls"] += 1
        self.batch_sizes[len(stories)] += 1
        try:
            scored = self._score(stories, contexts, prompts)
        except Exception:
            self.stats["failed_calls"] += 1
            raise
        self.stats["stories"] += len(stories)
        return scored
