"""``storyrl serve``: an HTTP reward server speaking OpenRLHF's remote reward
protocol, batching concurrent requests onto one reward model.

Endpoints (FastAPI app from :func:`create_app`):

* ``POST /get_reward``: ``{"query": [...], "prompts": [...], "labels": [...]}``
  -> ``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (see
  :mod:`storyrl.integrations.openrlhf` for how stories and context are taken
  from it). Answers: 200; 401 without the token (when one is set); 413 for
  a body over the limit; 422 for a malformed request or one over a limit
  (the reason names the limit and its option); 500 when the reward fails for
  this request; 503 while the server shuts down or the reward worker is
  stuck; 504 when the reward call ran past the time limit.
* ``GET /health``: ``{"status": "ok"}`` (503 while shutting down or stuck);
  never needs the token.
* ``GET /info``: the reward's name, the batching settings, the limits and
  counters; the reward's options only when the server has a token (they may
  name files), so only to clients that hold it.
* ``/docs``, ``/redoc``, ``/openapi.json`` only with ``docs=True``.

Batching (:class:`~storyrl.integrations.batching.RequestBatcher`): the first
waiting request waits ``max_wait_ms`` for others while the batch stays within
``max_batch_size`` stories, then one reward call in the worker thread scores
them all, so one GPU reward model serves many trainer nodes. A request's
answer depends on that request only: a failing batch is retried request by
request; a request whose stories all came back unscorable from a shared call
is scored alone; and the reward's "stories failing in a row" guard starts
afresh with every call, so one client's failing stories never turn another
client's request into a 500. A request that fails alone gets 500 batched or
not; unscorable stories get the fallback with ``unscorable`` = 1.0. A
``weighted`` reward normalised per batch or group is scored one request at a
time (a request is its batch), and a request with a group of one story
(grouped by prompt and ``story_id``), or one story in all, is a 422: its
z-score would be 0. Requests lacking the human story for a reward that needs
it are a 422 naming OpenRLHF's label flag.

Slow clients: a request (headers and body) must arrive within
``Limits.receive_timeout_s`` (408 and closed otherwise), and at most
``Limits.max_connections`` are open: a new one closes the oldest connection
still sending its request (see
:func:`~storyrl.integrations.serve_guards.guarded_protocol`), so idle or
trickling sockets cannot keep ``/health`` and real clients out.

Heavy work never runs on the event loop: the body is parsed and checked in a
thread, scoring in the reward thread. A client that disconnects before its
batch starts is dropped unscored. On shutdown (SIGTERM / SIGINT) the server
stops accepting, lets queued and running requests finish for up to
``shutdown_timeout_s``, answers the rest with 503 and exits; a reward call
that never returns does not keep the process alive (daemon thread).

FastAPI and uvicorn come with ``pip install 'storyrl[serve]'``; this module
imports FastAPI and uvicorn, so only the ``serve`` command imports it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

import storyrl.integrations.scoring as _core
from storyrl.integrations.batching import Busy, CallTimeout, Closing, RequestBatcher, _positive_finite
from storyrl.integrations.openrlhf import check_company, check_labels, remote_reward_response, split_queries
from storyrl.integrations.serve_guards import (
    ACCEPT_BACKLOG,
    BodyLimit,
    ImageGuard,
    Limits,
    Refused,
    TokenAuth,
    connection_budget,
    guarded_protocol,
)
from storyrl.rewards.base import one_line

__all__ = ["Limits", "create_app", "run_in_thread", "serve"]

log = logging.getLogger(__name__)


class RewardRequest(BaseModel):
    """The body of POST /get_reward. Strict: a number is not a story. Fields
    other than these (e.g. OpenRLHF's ``datasources``) are ignored."""

    model_config = ConfigDict(strict=True)
    query: list[StrictStr]
    prompts: list[StrictStr | None] | None = None
    labels: list[Any] | None = None


_BODY_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": RewardRequest.model_json_schema()}}}}


def prepare_for_data(reward, data: str, image_root: str | None = None, progress: bool = True) -> dict:
    """Before the server listens: the reward's image side embedded for every
    record of ``data`` (storyrl JSONL, VIST SIS or VWP; images and image ids
    resolved in ``image_root`` as requests' labels are), into the caches the
    server's scoring reads (in memory, and the reward's ``cache_dir`` when it
    has one), with d_HM's human stories scored. The server cannot know its
    clients' images in advance, hence this explicit data file
    (``storyrl serve --prepare-data``). Raises ValueError for a bad file."""
    import os

    from storyrl.datasets import load_records
    from storyrl.rewards.base import prepare_rewards

    records = load_records(data)
    root = os.path.realpath(image_root) if image_root is not None else None

    def where(path: Any) -> Any:  # the real path, as ImageGuard gives the reward
        if not isinstance(path, str) or root is None:
            return path
        return os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))

    images = [[where(p) for p in r.images] if r.images else None for r in records]
    ids = [list(r.image_ids) if r.image_ids else None for r in records]
    context = {"images": images if any(images) else None, "image_ids": ids if any(ids) else None,
               "story_id": [r.story_id for r in records],
               "reference": [r.reference if r.reference is not None else (r.story or None) for r in records]}
    return prepare_rewards([reward], context, progress=progress)


def create_app(reward, *, max_batch_size: int = 64, max_wait_ms: float = 10.0, fallback: float | None = None,
               limits: Limits | None = None, timeout_s: float | None = 60.0, token: str | None = None,
               docs: bool = False) -> FastAPI:
    """The FastAPI app serving ``reward`` (a storyrl Reward, set up by the
    caller so that loading errors come before listening). ``limits``:
    :class:`Limits` (default: ``storyrl serve``'s defaults, no image root);
    ``timeout_s``: the most one reward call may take (None: no limit);
    ``token``: required as ``Authorization: Bearer`` everywhere but
    ``/health``; ``docs``: serve ``/docs`` and ``/openapi.json``."""
    fallback = _core.resolve_fallback(fallback)
    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be a Limits, got {type(limits).__name__}")
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ValueError("token must be a non-empty string (or None for no authentication)")
    images = ImageGuard(limits)

    def score(stories: list[str], contexts: list[dict], prompts: list) -> _core.Scored:
        # The server's calls mix clients: another client's failing stories never decide this request's answer.
        reset = getattr(reward, "reset_failure_streak", None)
        if reset is not None:
            reset()
        # No prompt anywhere: None, so that a reward grouping by prompt does
        # not take every story for one group.
        given = prompts if any(p is not None for p in prompts) else None
        return _core.score_stories(reward, stories, _core.context_columns(contexts), given)

    if _core.batch_normalized(reward):
        # Normalised over what one call sees: each request is its own batch, never mixed with others'.
        log.warning("reward %r normalises over the batch or prompt groups: each request is scored alone and must "
                    "hold whole groups", reward.name)
        max_batch_size = 1
    batcher = RequestBatcher(score, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, timeout_s=timeout_s)

    def parse(body: bytes):
        """Stories, contexts, prompts and the stories left unscored (a
        thread: JSON, marker stripping and image headers cost time)."""
        try:
            request = RewardRequest.model_validate_json(body)
        except ValidationError as exc:
            raise Refused(422, _reasons(exc)) from None
        limits.check_queries(request.query, request.prompts)
        try:
            stories, contexts, prompts = split_queries(request.query, request.prompts, request.labels)
            check_labels(reward, contexts)
            check_company(reward, contexts, prompts)
        except (TypeError, ValueError) as exc:
            raise Refused(422, str(exc)) from None
        return stories, contexts, prompts, images.apply(contexts)

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="storyrl reward server", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.batcher = batcher
    app.state.reward = reward
    app.state.limits = limits  # serve() / run_in_thread() take the connection limits from here
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if token is not None:
        app.add_middleware(TokenAuth, token=token)  # outermost: no body is read without the token

    @app.post("/get_reward", openapi_extra=_BODY_SCHEMA)
    async def get_reward(request: Request):
        body = await request.body()
        try:
            stories, contexts, prompts, blocked = await asyncio.to_thread(parse, body)
        except Refused as exc:
            batcher.stats["bad_requests"] += 1
            return JSONResponse({"detail": exc.detail}, status_code=exc.status)
        for reason in blocked.values():
            batcher.stats["unscorable_images"] += 1
            log.warning("story left unscored: %s", reason)
        keep = [i for i in range(len(stories)) if i not in blocked]
        if not keep:
            return remote_reward_response(_core.Scored(np.full(len(stories), math.nan)), fallback)
        job = asyncio.ensure_future(batcher.submit([stories[i] for i in keep], [contexts[i] for i in keep],
                                                   [prompts[i] for i in keep]))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            unanswered = not job.done()
            if unanswered:  # the client went away (or this handler is cancelled): drop the request
                job.cancel()
        if unanswered:
            batcher.stats["disconnected"] += 1
            return Response(status_code=499)  # nobody reads it
        try:
            part = job.result()
        except (Busy, Closing) as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503)
        except CallTimeout as exc:
            return JSONResponse({"detail": f"reward {reward.name!r}: {exc} (--timeout-s)"}, status_code=504)
        except Exception as exc:
            return JSONResponse({"detail": f"reward {reward.name!r} failed: {one_line(exc)}"}, status_code=500)
        scored = _spread(part, keep, len(stories))
        batcher.stats["fallback"] += int(scored.unscorable.sum())
        return remote_reward_response(scored, fallback)

    @app.get("/health")
    async def health():
        if batcher.stuck_since is not None:
            return JSONResponse({"status": "stuck", "detail": "a reward call ran past --timeout-s"}, status_code=503)
        if batcher._closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        answer = {
            "reward": reward.name,
            "max_batch_size": batcher.max_batch_size,
            "max_wait_ms": batcher.max_wait_ms,
            "timeout_s": batcher.timeout_s,
            "fallback": fallback,
            "limits": {k: v for k, v in vars(limits).items() if k != "image_root"},
            "stats": dict(batcher.stats),
            "batch_sizes": {str(k): v for k, v in sorted(batcher.batch_sizes.items())},
        }
        if token is not None:  # this client holds the token (TokenAuth)
            answer["config"] = _jsonable(reward.config())
        return answer

    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the
    next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _spread(part: _core.Scored, keep: list[int], n: int) -> _core.Scored:
    """Scores of ``keep`` placed among ``n`` stories, NaN elsewhere."""
    if len(keep) == n:
        return part

    def full(values: np.ndarray) -> np.ndarray:
        out = np.full(n, math.nan)
        out[keep] = values
        return out

    return _core.Scored(full(part.scores), {k: full(v) for k, v in part.components.items()})


class _Server(uvicorn.Server):
    """uvicorn's Server, draining the batcher first on shutdown: stop
    listening, give queued and running requests ``shutdown_timeout_s``,
    answer the rest with 503. (uvicorn alone waits for every open request
    without a bound.)"""

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float) -> None:
        _positive_finite("shutdown_timeout_s", shutdown_timeout_s, allow_zero=True)
        config.timeout_graceful_shutdown = 2  # backstop once the batcher has answered everything
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting first
        batcher = getattr(getattr(self.config.app, "state", None), "batcher", None)
        if batcher is not None:
            await batcher.close(self.shutdown_timeout_s)
        await super().shutdown(sockets)


def _config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    """uvicorn's settings for ``app``: the h11 protocol guarded by the app's
    receive_timeout_s and max_connections (:class:`Limits`, default ones
    for an app not made by create_app); ValueError when the file limit
    cannot hold max_connections."""
    state = getattr(app, "state", None)
    limits = getattr(state, "limits", None) or Limits()
    batcher = getattr(state, "batcher", None)
    protocol = guarded_protocol(limits.receive_timeout_s, connection_budget(limits.max_connections),
                                batcher.stats if batcher is not None else None)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol,
                          backlog=ACCEPT_BACKLOG)


def serve(app, host: str = "127.0.0.1", port: int = 5000, log_level: str = "info",
          shutdown_timeout_s: float = 10.0) -> None:
    """Serve ``app`` until SIGTERM / SIGINT, then shut down within about
    ``shutdown_timeout_s`` + 2 seconds."""
    _Server(_config(app, host, port, log_level), shutdown_timeout_s).run()


@contextmanager
def run_in_thread(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                  shutdown_timeout_s: float = 10.0):
    """Serve ``app`` with uvicorn in a background thread; yields the base URL
    (``port`` 0 = a free port). For tests, notebooks and benchmarks."""
    server = _Server(_config(app, host, port, log_level), shutdown_timeout_s)
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
        thread.join(shutdown_timeout_s + 10)


def _reasons(exc: ValidationError) -> str:
    """A validation error as one line naming each bad field."""
    reasons = []
    for error in exc.errors():
        loc = error.get("loc", ())
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            reasons.append(f"malformed JSON: {detail}" if detail else "malformed JSON")
            continue
        where = ".".join(str(p) for p in loc) or "request body"
        reasons.append(f"{where}: {error.get('msg')}")
    return "; ".join(reasons) or "invalid request"


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
