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

import logging
import math
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictStr

import storyrl.integrations as _core
from storyrl.integrations.batching import RequestBatcher
from storyrl.integrations.openrlhf import remote_reward_response, split_queries

__all__ = ["create_app", "run_in_thread"]

log = logging.getLogger(__name__)


class RewardRequest(BaseModel):
    """The body of POST /get_reward. Strict: a number is not a story. Fields
    other than these (e.g. OpenRLHF's ``datasources``) are ignored."""

    model_config = ConfigDict(strict=True)
    query: list[StrictStr]
    prompts: list[StrictStr | None] | None = None
    labels: list[Any] | None = None


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
