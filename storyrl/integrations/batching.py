"""Batching concurrent reward requests onto one reward call.

Used by ``storyrl serve`` (requests from many trainer nodes) and by verl's
asynchronous reward loop (one ``compute_score`` call per sample, many at a
time): a model reward then makes one forward per batch, not per story.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import storyrl.integrations as _core

__all__ = ["RequestBatcher"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    stories: list[str]
    contexts: list[dict[str, Any]]
    prompts: list[str | None]
    future: asyncio.Future



class RequestBatcher:
    """Collects requests into batches and scores each batch with one call of
    ``score(stories, contexts, prompts) -> Scored`` in a single worker
    thread."""

    def __init__(self, score: Callable[[list[str], list[dict], list], _core.Scored], *, max_batch_size: int = 64,
                 max_wait_ms: float = 10.0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._score = score
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.stats: Counter = Counter()
        self.batch_sizes: Counter = Counter()  # stories per reward call -> number of calls
        self._jobs: deque[_Job] = deque()
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._arrived = asyncio.Event()
        # One thread: the reward's models are used from one thread, one batch at a time.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="storyrl-reward")
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        while self._jobs:
            job = self._jobs.popleft()
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def submit(self, stories: list[str], contexts: list[dict[str, Any]],
                     prompts: list[str | None] | None = None) -> _core.Scored:
        """Queue one request's stories (with their contexts and prompts);
        returns their scores (or raises the reward's error)."""
        if self._worker is None or self._worker.done():
            raise RuntimeError("the reward worker is not running")
        prompts = list(prompts) if prompts is not None else [None] * len(stories)
        job = _Job(stories, contexts, prompts, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._arrived.set()
        self.stats["requests"] += 1
        return await job.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._jobs:
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._jobs.popleft()]
            size = len(batch[0].stories)
            deadline = loop.time() + self.max_wait_ms / 1000
            while size < self.max_batch_size:
                if self._jobs:
                    if size + len(self._jobs[0].stories) > self.max_batch_size:
                        break  # it starts the next batch
                    job = self._jobs.popleft()
                    batch.append(job)
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
            batch = [job for job in batch if not job.future.done()]  # clients that went away
            if not batch:
                continue
            results = await loop.run_in_executor(self._executor, self._score_jobs, batch)
            for job, result in zip(batch, results):
                if job.future.done():
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _score_jobs(self, batch: list[_Job]) -> list[_core.Scored | BaseException]:
        """One reward call for the batch; when it fails and holds several
        requests, one call per request (worker thread)."""
        try:
            scored = self._call([s for job in batch for s in job.stories], [c for job in batch for c in job.contexts],
                                [p for job in batch for p in job.prompts])
        except Exception as exc:
            if len(batch) == 1:
                self.stats["failed_requests"] += 1
                return [exc]
            log.warning("reward failed for a batch of %d requests; retrying them one by one: %s", len(batch), exc)
            results = []
            for job in batch:
                try:
                    results.append(self._call(job.stories, job.contexts, job.prompts))
                except Exception as one:
                    self.stats["failed_requests"] += 1
                    results.append(one)
            return results
        out, start = [], 0
        for job in batch:
            out.append(scored.part(start, start + len(job.stories)))
            start += len(job.stories)
        return out

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
