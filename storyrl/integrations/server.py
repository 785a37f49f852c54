"""``storyrl serve``: an HTTP reward server speaking OpenRLHF's remote reward
protocol, batching concurrent requests onto one reward model.

Endpoints (FastAPI app from :func:`create_app`):

* ``POST /get_reward``: ``{"query": [...], "prompts": [...], "labels": [...]}``
  -> ``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (see
  :mod:`storyrl.integrations.openrlhf` for how stories and context are taken
  from it). A malformed request gets 422 with ``{"detail": reason}``; a
  reward failure 500 with the reason, for the requests it affects only.
* ``GET /health``: ``{"status": "ok"}`` once the reward is loaded.
* ``GET /info``: the reward's name and options, the batching settings and
  counters (requests, stories, reward calls, their sizes, failures,
  fallbacks).

Batching: requests go to a queue; one worker takes the first waiting request
and adds the ones that arrive within ``max_wait_ms`` (or are already
waiting) while the batch stays within ``max_batch_size`` stories (a larger
request is scored alone, whole), then makes one reward call in a worker
thread -- so a GPU reward model serves many trainer nodes -- and hands each
request its own slice. While a call runs, new requests queue up and form the
next batch. When a batch of several requests fails, each request is retried
alone, so one bad request does not fail the others. (A ``weighted`` reward
normalised per batch or group therefore normalises over the requests batched
together; ``none`` / ``range`` normalisation does not depend on batching.)

FastAPI and uvicorn come with ``pip install 'storyrl[serve]'``; this module
imports FastAPI, so only the ``serve`` command imports it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr

import storyrl.integrations as _core
from storyrl.integrations.openrlhf import remote_reward_response, split_queries

__all__ = ["RequestBatcher", "create_app", "run_in_thread"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    stories: list[str]
    contexts: list[dict[str, Any]]
    prompts: list[str | None]
    future: asyncio.Future


class RewardRequest(BaseModel):
    """The body of POST /get_reward. Strict: a number is not a story. Fields
    other than these (e.g. OpenRLHF's ``datasources``) are ignored."""

    model_config = ConfigDict(strict=True)
    query: list[StrictStr]
    prompts: list[StrictStr | None] | None = None
    labels: list[Any] | None = None


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


def create_app(reward, *, max_batch_size: int = 64, max_wait_ms: float = 10.0, fallback: float | None = None):
    """The FastAPI app serving ``reward`` (a storyrl Reward, set up by the
    caller so that loading errors come before listening)."""
    fallback = _core.resolve_fallback(fallback)

    def score(stories: list[str], contexts: list[dict], prompts: list) -> _core.Scored:
        # No prompt anywhere: None, so that a reward grouping by prompt does
        # not take every story for one group.
        given = prompts if any(p is not None for p in prompts) else None
        return _core.score_stories(reward, stories, _core.context_columns(contexts), given)

    batcher = RequestBatcher(score, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="storyrl reward server", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.reward = reward

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        batcher.stats["bad_requests"] += 1
        reasons = []
        for error in exc.errors():
            loc = error.get("loc", ())[1:]
            if error.get("type") == "json_invalid":
                detail = (error.get("ctx") or {}).get("error", "")
                at = f" at character {loc[0]}" if loc else ""
                reasons.append(f"malformed JSON{at}: {detail}" if detail else f"malformed JSON{at}")
                continue
            where = ".".join(str(p) for p in loc) or "request body"
            reasons.append(f"{where}: {error.get('msg')}")
        return JSONResponse({"detail": "; ".join(reasons) or "invalid request"}, status_code=422)

    @app.post("/get_reward")
    async def get_reward(body: RewardRequest):
        try:
            stories, contexts, prompts = split_queries(body.query, body.prompts, body.labels)
        except (TypeError, ValueError) as exc:
            batcher.stats["bad_requests"] += 1
            return JSONResponse({"detail": str(exc)}, status_code=422)
        if not stories:
            return remote_reward_response(_core.Scored(np.zeros(0)), fallback)
        try:
            scored = await batcher.submit(stories, contexts, prompts)
        except Exception as exc:
            return JSONResponse({"detail": f"reward {reward.name!r} failed: {_one_line(exc)}"}, status_code=500)
        batcher.stats["fallback"] += int(scored.unscorable.sum())
        return remote_reward_response(scored, fallback)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        return {
            "reward": reward.name,
            "config": _jsonable(reward.config()),
            "max_batch_size": batcher.max_batch_size,
            "max_wait_ms": batcher.max_wait_ms,
            "fallback": fallback,
            "stats": dict(batcher.stats),
            "batch_sizes": {str(k): v for k, v in sorted(batcher.batch_sizes.items())},
        }

    return app


@contextmanager
def run_in_thread(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Serve ``app`` with uvicorn in a background thread; yields the base URL
    (``port`` 0 = a free port). For tests, notebooks and benchmarks."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, name="storyrl-serve", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the reward server did not start on {host}:{port}")
            thread.join(0.01)
        bound = server.servers[0].sockets[0].getsockname()
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN / infinity
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
