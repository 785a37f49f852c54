"""``remote``: a reward scored by a ``storyrl serve`` server over HTTP.

One GPU machine runs ``storyrl serve --config REWARD.yaml``; trainers on
other machines use ``reward: remote, url: http://HOST:PORT`` wherever a
reward goes (RL configs' ``rewards``, a ``weighted`` component, ``storyrl
score``). The client speaks the server's protocol (POST ``/get_reward`` with
``{"query", "prompts", "labels"}``, see :mod:`storyrl.integrations.openrlhf`):

* ``query`` is prompt + story when a prompt is given (the server takes the
  text after the prompt), ``prompts`` the prompts (a chat prompt as its JSON)
  and ``labels`` each story's context (:data:`storyrl.integrations.CONTEXT_KEYS`:
  reference, story_id, images / story_images, image_ids, noun_phrases; only
  the keys in ``send_context`` when set). Image paths travel relative to
  ``image_root`` (the server resolves them in its own ``--image-root`` and
  refuses others). The server strips surrounding whitespace and trailing
  end-of-text markers.
* A batch is sent in requests of up to ``chunk_size`` stories, a group's
  stories (same prompt and story_id) in the same request when they fit (a
  reward normalised per group needs whole groups: keep ``chunk_size`` at
  least the group size; one normalised per batch sees each request as its
  batch), at most
  ``max_concurrency`` in flight per reward object (and event loop).
* Stories the server flags ``unscorable`` are NaN (None for TRL), never its
  fallback number; its ``extra_logs`` columns are the reward's ``log_extra``
  columns (with the server's fallback where a component had no value).

Failures. A 5xx or 429 answer, a timeout or a refused connection is retried
``retries`` times, after ``backoff_s`` doubling up to ``max_backoff_s`` (a
429/503 ``Retry-After``, seconds or an HTTP date, replaces that wait but is
capped at ``max_backoff_s`` too: a server asking for hours or for ever must
not stall the run). ``timeout_s`` bounds each attempt in total, from
connecting to the answer's last byte, so a server trickling its answer
cannot hold a call open. Only a 200 answer is a reward answer: another 2xx,
or a redirect (3xx, never followed: a redirected URL is a wrong ``url``), is
a failure named by its status. A request that still fails, or whose answer
is malformed (not JSON, nested too deep to parse, a reward that is not a
finite number -- JSON's NaN and Infinity, an integer too large for a float
-- or of the wrong length: the whole answer is distrusted), is a *transport
failure*: its stories are NaN with the reason in ``stats["reasons"]`` (each
kind logged once), never a reward. When every request of
``max_consecutive_failures`` calls in a row failed, or every call failed for
``down_after_s`` seconds, the call raises :class:`RemoteRewardUnavailable`
(the run stops with its message). Any other 4xx (a rejected token, a
request the server refuses) raises :class:`RemoteRewardError` at once with
the server's detail; a redirect or other non-200 answer is not retried
either (NaN, counted), so a wrong ``url`` fails ``setup()`` or, after
``max_consecutive_failures`` calls, the run.

httpx comes with ``pip install 'storyrl[remote]'`` and is imported on first use.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from storyrl.config import option
from storyrl.rewards.base import (
    CONTEXT_KEYS,
    TRL_KWARGS,
    FatalRewardError,
    Reward,
    RewardConfig,
    RewardError,
    as_list,
    completion_text,
    one_line,
    story_context,
    take_column,
)

__all__ = ["TOKEN_ENV", "RemoteConfig", "RemoteReward", "RemoteRewardError", "RemoteRewardUnavailable"]

log = logging.getLogger(__name__)

#: Environment variable with the server's Bearer token (when ``token`` is not set).
TOKEN_ENV = "STORYRL_SERVE_TOKEN"
_ENDPOINT = "/get_reward"
_clock = time.monotonic  # down_after_s's clock (tests move it; the event loops keep theirs)


class RemoteRewardError(FatalRewardError):
    """The server refused the request (a 4xx other than 429): a wrong token,
    URL or request. Retrying cannot help."""


class RemoteRewardUnavailable(RemoteRewardError):
    """The server stayed unreachable or broken for the configured number of
    calls or seconds."""


@dataclass
class RemoteConfig(RewardConfig):
    url: str = option(help="The reward server: its base URL (http://host:port) or its full /get_reward URL.")
    label: str | None = option(None, "Name the reward is logged under (TRL's column; default: remote); give two "
                               "remote rewards different labels.")
    timeout_s: float = option(60.0, "Seconds one request may take in all, from connecting to the answer's last "
                              "byte (each retry gets its own).", min=1e-3)
    retries: int = option(3, "Retries of a request after a 5xx/429 answer, a timeout or a refused connection.",
                          min=0)
    backoff_s: float = option(0.5, "Wait before the first retry; doubles with each retry.", min=0.0)
    max_backoff_s: float = option(30.0, "Longest wait between retries, a server's Retry-After included.",
                                  min=0.0)
    max_concurrency: int = option(4, "Requests in flight at once, per reward object.", min=1)
    chunk_size: int = option(64, "Stories per request; a larger batch becomes concurrent requests.", min=1)
    max_story_chars: int | None = option(
        20_000, "Longer stories (characters) are unscorable here and not sent: the server refuses a whole request "
        "holding one (its --max-story-chars, 20,000 by default); null: send every story.", min=1)
    token: str | None = option(None, f"Bearer token the server expects (default: ${TOKEN_ENV}, if set).")
    send_context: list[str] | None = option(None, "Context keys sent with each story (default: every one it has); "
                                            "e.g. [reference] for a text-only reward, [] for none.")
    image_root: str | None = option(None, "Local directory of the images: paths under it are sent relative to it "
                                    "(the server finds them under its --image-root).", path="dir")
    max_consecutive_failures: int | None = option(3, "Stop the run when every request of this many calls in a row "
                                                  "failed (null: only down_after_s).", min=1)
    down_after_s: float | None = option(None, "Stop the run when every call failed for this many seconds "
                                        "(null: only max_consecutive_failures).", min=0.0)

    def _problems(self) -> list[str]:
        problems = []
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            problems.append(f"url must be an http(s) URL such as http://host:5000, got {self.url!r}")
        if self.max_consecutive_failures is None and self.down_after_s is None:
            problems.append("set max_consecutive_failures or down_after_s: a server that stays down must stop "
                            "the run")
        keys = ("reference", "story_id", "images", "image_ids", "noun_phrases")
        problems += [f"send_context: unknown key {k!r}; known: {', '.join(keys)}" for k in self.send_context or ()
                     if k not in keys]
        if self.max_backoff_s < self.backoff_s:
            problems.append(f"max_backoff_s ({self.max_backoff_s}) is below backoff_s ({self.backoff_s})")
        return problems


@dataclass
class _Failure:
    """A request that gave no usable answer."""

    reason: str  # the kind, counted: "timeout", "connection error", "HTTP 503", "malformed answer", ...
    detail: str


class RemoteReward(Reward):
    """A storyrl reward served by ``storyrl serve`` (module docs).

    ``await reward(prompts=..., completions=..., **columns)`` is the TRL
    contract (async: TRL runs it concurrently with its other async rewards);
    ``score(stories, **context)`` the synchronous storyrl one (run on a
    private event loop, so it also works in a thread whose loop is running);
    :meth:`score_async` the async one for callers with their own loop.

    Test hooks: ``transport`` (an httpx async transport such as
    ``httpx.MockTransport``) replaces the network and ``sleep`` (a coroutine
    function) the waits between retries; neither is pickled.
    """

    name = "remote"
    config_class = RemoteConfig

    def __init__(self, config: RemoteConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        self.__name__ = self.args.label or self.name
        url = self.args.url.rstrip("/")
        self.endpoint = url if url.endswith(_ENDPOINT) else url + _ENDPOINT
        self.http_stats: Counter = Counter()  # requests, retries, failed (requests that gave no answer)
        self.last_components: dict[str, np.ndarray] = {}
        self._failed_calls = 0
        self._down_since: float | None = None
        self._last_failure: _Failure | None = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.transport = None
        self.sleep = asyncio.sleep
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._per_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> (client, semaphore)

    def __getstate__(self) -> dict[str, Any]:
        skip = {"transport", "sleep", "_lock", "_logged", "_per_loop"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        options = self.config()
        if options.get("token"):
            options["token"] = "***"
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"

    # -- setup ----------------------------------------------------------------
    def _setup(self) -> None:
        """Nothing loads here; :meth:`setup` checks that the server answers."""

    def setup(self) -> RemoteReward:
        """Check that the server answers ``GET /health`` (retried as requests
        are), so that a wrong URL or a stopped server fails before training.
        RewardError when it does not; RemoteRewardError for a rejected token."""
        from storyrl.rewards.concurrent import run_sync

        run_sync(self._check_health())
        return self

    async def _check_health(self) -> None:
        client, _ = self._client()
        url = self.endpoint[: -len(_ENDPOINT)] + "/health"
        outcome = await self._send(client, None, "GET", url, None)
        if isinstance(outcome, _Failure):
            raise RewardError(f"reward {self.__name__!r}: no reward server answers at {url}: {outcome.reason}: "
                              f"{outcome.detail}; start `storyrl serve` there or fix url")

    # -- scoring ---------------------------------------------------------------
    async def score_async(self, stories: Sequence[Any], contexts: Sequence[Mapping[str, Any] | None] | None = None,
                          prompts: Sequence[Any] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Score ``stories`` on the server from the running event loop.

        ``contexts``: one mapping per story (or None) with any of
        :data:`storyrl.integrations.CONTEXT_KEYS`; ``prompts``: one per
        story (a string, a chat prompt, or None), or None. Returns
        ``(scores, components)``: float64 scores, NaN where the story is not
        text, the server flagged it unscorable, or its request failed; and
        the server's per-story component columns (``extra_logs`` but
        ``unscorable``), NaN where a story got no answer. Raises
        RemoteRewardUnavailable when the server stays down (module docs),
        RemoteRewardError when it refuses a request (4xx), TypeError /
        ValueError for arguments of the wrong type or length. Safe to call
        concurrently; at most ``max_concurrency`` requests are in flight."""
        stories = as_list(stories, "stories", self.__name__)
        n = len(stories)
        contexts = [None] * n if contexts is None else as_list(contexts, "contexts", self.__name__)
        prompts = [None] * n if prompts is None else as_list(prompts, "prompts", self.__name__)
        for what, values in (("contexts", contexts), ("prompts", prompts)):
            if len(values) != n:
                raise ValueError(f"{self.__name__}: {len(values)} {what} for {n} stories")
        scores = np.full(n, np.nan)
        components: dict[str, np.ndarray] = {}
        valid = [i for i, s in enumerate(stories) if isinstance(s, str)]
        if len(valid) < n:
            with self._lock:
                self.stats["reasons"]["not text"] += n - len(valid)
        limit = self.args.max_story_chars
        if limit is not None:
            # One runaway story must cost its own reward, not the whole request (the server's 422 is fatal here).
            long = [i for i in valid if len(stories[i]) > limit]
            if long:
                valid = [i for i in valid if len(stories[i]) <= limit]
                self._warn_once("too long", f"{len(long)} stories longer than max_story_chars ({limit}) get None, "
                                "not sent")
                with self._lock:
                    self.stats["reasons"]["longer than max_story_chars"] += len(long)
        chunks = self._chunks(valid, [(_prompt_key(prompts[i]), (contexts[i] or {}).get("story_id")) for i in valid])
        started = _clock()
        if chunks:
            client, semaphore = self._client()
            bodies = [self._body([stories[i] for i in c], [contexts[i] for i in c], [prompts[i] for i in c])
                      for c in chunks]
            outcomes = await asyncio.gather(*(self._send(client, semaphore, "POST", self.endpoint, b) for b in bodies),
                                            return_exceptions=True)
            fatal = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if fatal is not None:
                raise fatal
            failed = []
            for chunk, outcome in zip(chunks, outcomes):
                if not isinstance(outcome, _Failure):
                    outcome = self._parse(outcome, len(chunk))
                failed.append(isinstance(outcome, _Failure))
                if failed[-1]:
                    self._failed(outcome, len(chunk))
                    continue
                values, flagged, columns = outcome
                scores[chunk] = np.where(flagged, np.nan, values)
                if flagged.any():
                    self._failed(_Failure("unscorable on the server", "the server flagged it"), int(flagged.sum()),
                                 transport=False)
                for column, column_values in columns.items():
                    components.setdefault(column, np.full(n, np.nan))[chunk] = column_values
        n_bad = int(np.isnan(scores).sum())
        with self._lock:
            self.stats["scored"] += n - n_bad
            self.stats["unscorable"] += n_bad
        if chunks:
            self._check_down(failed, started)
        return scores, components

    def score(self, stories: Sequence[Any], **context: Any) -> np.ndarray:
        """The storyrl contract (see :meth:`Reward.score`): per-story context
        columns, NaN for stories the server cannot or did not score. Blocks;
        runs on a private event loop. The components are in
        ``last_components``."""
        from storyrl.rewards.concurrent import run_sync

        stories = as_list(stories, "stories", self.__name__)
        prompts = context.pop("prompts", None)
        scores, self.last_components = run_sync(
            self.score_async(stories, _per_story(context, len(stories)), prompts))
        return scores

    async def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        """TRL reward-function contract, async (see :meth:`Reward.__call__`)."""
        if completions is None:
            raise TypeError(f"{self.__name__}: called without completions")
        texts = [completion_text(c) for c in as_list(completions, "completions", self.__name__)]
        context = {k: v for k, v in kwargs.items() if k not in TRL_KWARGS}
        scores, components = await self.score_async(texts, _per_story(context, len(texts)), prompts)
        log_extra, log_metric = kwargs.get("log_extra"), kwargs.get("log_metric")
        if callable(log_extra):
            for column, values in components.items():
                log_extra(column, [None if math.isnan(v) else float(v) for v in values])
        if callable(log_metric) and len(scores):
            log_metric(f"{self.__name__}/unscorable_frac", float(np.isnan(scores).mean()))
        return [None if math.isnan(s) else float(s) for s in scores]

    def _chunks(self, valid: list[int], keys: list[tuple]) -> list[list[int]]:
        """``valid`` in requests of at most ``chunk_size`` stories, the stories
        of one group (prompt and story_id, as ``weighted`` tells groups
        apart) kept together when the group fits in one request."""
        groups: dict[Any, list[int]] = {}
        for k, (i, key) in enumerate(zip(valid, keys)):
            groups.setdefault(key if key != (None, None) else k, []).append(i)
        chunks: list[list[int]] = []
        for group in groups.values():
            if chunks and len(chunks[-1]) + len(group) <= self.chunk_size:
                chunks[-1].extend(group)
            else:
                chunks += [group[k : k + self.chunk_size] for k in range(0, len(group), self.chunk_size)]
        return chunks

    # -- HTTP -------------------------------------------------------------------
    def _client(self) -> tuple[Any, asyncio.Semaphore]:
        """This event loop's client and semaphore (neither can cross loops)."""
        httpx = _httpx()

        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._per_loop.get(loop)
            if state is None:
                limits = httpx.Limits(max_connections=self.max_concurrency)
                client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits,
                                           transport=self.transport)
                state = self._per_loop[loop] = (client, asyncio.Semaphore(self.max_concurrency))
            return state

    def _body(self, stories: list[str], contexts: list, prompts: list) -> dict[str, Any]:
        keys = [_prompt_key(p) for p in prompts]
        return {"query": [s if k is None else k + s for s, k in zip(stories, keys)],
                "prompts": keys if any(k is not None for k in keys) else None,
                "labels": [self._label(c) for c in contexts]}

    def _label(self, context: Mapping[str, Any] | None) -> dict[str, Any] | None:
        if not context:
            return None
        context = story_context(context)
        label = {}
        for key in CONTEXT_KEYS:
            if self.send_context is not None and key not in self.send_context:
                continue
            value = context.get(key)
            if isinstance(value, np.ndarray):
                value = value.tolist()
            if isinstance(value, tuple):
                value = list(value)
            if value is None:
                continue
            if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                label[key] = self._relative(value) if key == "images" else value
            else:
                self._warn_once(f"context {key}", f"context {key!r} holds {type(value).__name__} values, which "
                                "cannot travel to the server; not sent (give file paths or ids)")
        return label or None

    def _relative(self, paths: list[str]) -> list[str]:
        if self.image_root is None:
            return paths
        root = os.path.abspath(self.image_root)
        out = []
        for path in paths:
            full = os.path.abspath(os.path.join(root, path))
            out.append(os.path.relpath(full, root) if os.path.commonpath([full, root]) == root else path)
        return out

    async def _send(self, client, semaphore, method: str, url: str, body: Any) -> Any:
        """The JSON answer, or a _Failure once the retries are spent; raises
        RemoteRewardError for a 4xx other than 429."""
        httpx = _httpx()

        token = self.token or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        failure, delay = None, 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.http_stats["retries"] += 1
                await self.sleep(delay)
            delay = min(self.backoff_s * 2**attempt, self.max_backoff_s)
            try:
                with self._lock:
                    self.http_stats["requests"] += 1
                if semaphore is None:
                    response = await self._request(client, method, url, body, headers)
                else:
                    async with semaphore:  # the deadline starts once the request may go
                        response = await self._request(client, method, url, body, headers)
            except (httpx.TimeoutException, asyncio.TimeoutError):
                failure = _Failure("timeout", f"no complete answer from {url} within {self.timeout_s:g} s")
                continue
            except httpx.TransportError as exc:
                failure = _Failure("connection error", f"{url}: {type(exc).__name__}: {one_line(exc)}")
                continue
            status = response.status_code
            if status == 429 or status >= 500:
                failure = _Failure(f"HTTP {status}", f"{url}: {_detail(response)}")
                wait = _retry_after(response) if status in (429, 503) else None
                if wait is not None:
                    delay = min(wait, self.max_backoff_s)
                continue
            if body is None and status in (404, 405):
                return {}  # a server without /health (not storyrl serve) that answers
            if 300 <= status < 400:
                where = response.headers.get("location")
                return _Failure(f"HTTP {status}", f"{url} redirects{f' to {where[:200]}' if where else ''}; "
                                "redirects are not followed: set url to the reward server itself")
            if status >= 400:
                hint = {401: f"; check token or ${TOKEN_ENV}", 403: f"; check token or ${TOKEN_ENV}",
                        422: "; the remote reward's send_context and image_root options choose what is sent"}
                hint = hint.get(status, "")
                raise RemoteRewardError(f"reward {self.__name__!r}: the server at {url} refused the request "
                                        f"(HTTP {status}): {_detail(response)}{hint}")
            if body is None:  # the health check reads no answer: any 2xx is a server that answers
                return {}
            if status != 200:  # 202 Accepted, 204...: the server did not score the stories
                return _Failure(f"HTTP {status}", f"{url} answered HTTP {status}, not a reward answer (200)")
            answer = _json(response)
            if isinstance(answer, _Failure):
                answer.detail = f"{url}: {answer.detail}"
            return answer
        with self._lock:
            self.http_stats["failed"] += 1
        return failure

    async def _request(self, client, method: str, url: str, body: Any, headers: dict):
        """One attempt, the whole of it within ``timeout_s`` (httpx's own
        timeouts restart with every chunk received)."""
        return await asyncio.wait_for(client.request(method, url, json=body, headers=headers), self.timeout_s)

    def _parse(self, answer: Any, n: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | _Failure:
        """(values, unscorable flags, component columns) of an answer for n stories."""
        if not isinstance(answer, Mapping):
            return _Failure("malformed answer", f"expected a JSON object, got {type(answer).__name__}")
        values = answer.get("rewards", answer.get("scores"))
        if not isinstance(values, list):
            return _Failure("malformed answer", "no 'rewards' list in the answer")
        if len(values) != n:
            return _Failure("wrong length", f"{len(values)} rewards for {n} stories")
        values = _numbers(values)
        if values is None or not np.isfinite(values).all():
            return _Failure("malformed answer", "'rewards' holds values that are not finite numbers")
        extra = answer.get("extra_logs") or {}
        if not isinstance(extra, Mapping):
            return _Failure("malformed answer", "'extra_logs' is not an object")
        flags = extra.get("unscorable")
        flagged = np.zeros(n, dtype=bool)
        if flags is not None:
            flags = _numbers(flags) if isinstance(flags, list) and len(flags) == n else None
            if flags is None:
                return _Failure("malformed answer", "'extra_logs.unscorable' is not one number per story")
            flagged = flags != 0
        columns = {}
        for column, column_values in extra.items():
            if column != "unscorable" and isinstance(column_values, list) and len(column_values) == n:
                numbers = _numbers(column_values)
                if numbers is not None:
                    columns[column] = numbers
        return values, flagged, columns

    # -- bookkeeping --------------------------------------------------------------
    def _failed(self, failure: _Failure, count: int, transport: bool = True) -> None:
        with self._lock:
            self.stats["reasons"][failure.reason] += count
            if transport:
                self._last_failure = failure
        what = "request failed" if transport else "unscorable story"
        self._warn_once(failure.reason, f"{what} ({failure.reason}): {failure.detail}; its stories get None/NaN, "
                        f"not a reward (counted in stats['reasons'])")

    def _check_down(self, failed: list[bool], started: float) -> None:
        with self._lock:
            if not all(failed):
                self._failed_calls, self._down_since = 0, None
                return
            self._failed_calls += 1
            if self._down_since is None:
                self._down_since = started
            calls, seconds = self._failed_calls, _clock() - self._down_since
            last = self._last_failure
        limit, down_after = self.max_consecutive_failures, self.down_after_s
        if (limit is not None and calls >= limit) or (down_after is not None and seconds >= down_after):
            raise RemoteRewardUnavailable(
                f"reward {self.__name__!r}: the reward server at {self.endpoint} failed every request of {calls} "
                f"call(s) in a row for {seconds:.0f} s (last error: {last.reason}: {last.detail}); check that "
                "`storyrl serve` runs and is reachable from here (GET /health), then resume the run "
                "(max_consecutive_failures / down_after_s set how long to wait)")

    def _warn_once(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning("%s: %s", self.__name__, message)


def _httpx():
    try:
        import httpx
    except ImportError:
        raise RewardError("reward 'remote' needs httpx: pip install 'storyrl[remote]'") from None
    return httpx


def _per_story(context: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """Context columns (one entry per story; other values apply to every
    story) -> one mapping per story."""
    columns = {k: take_column(k, v, list(range(n)), n) for k, v in context.items()}
    return [{k: (v[i] if isinstance(v, (list, np.ndarray)) else v) for k, v in columns.items()} for i in range(n)]


def _prompt_key(prompt: Any) -> str | None:
    """The prompt as the server sees it: a string, a chat prompt as JSON."""
    if prompt is None or isinstance(prompt, str):
        return prompt or None
    return json.dumps(prompt, ensure_ascii=False, sort_keys=True, default=str)


def _numbers(values: list) -> np.ndarray | None:
    """The values as floats (None: NaN), or None when one is not a number
    or an integer too large for a float."""
    out = np.empty(len(values))
    for i, v in enumerate(values):
        if v is None:
            out[i] = math.nan
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                out[i] = float(v)
            except OverflowError:
                return None
        else:
            return None
    return out


def _json(response) -> Any:
    """The answer's JSON, or a _Failure: not JSON, or nested too deep for
    the parser (RecursionError), or an integer over Python's digit limit."""
    try:
        return response.json()
    except (ValueError, RecursionError) as exc:
        what = "nested too deep" if isinstance(exc, RecursionError) else f"not JSON ({one_line(exc)[:200]})"
        return _Failure("malformed answer", what)


def _retry_after(response) -> float | None:
    """Seconds from a Retry-After header (seconds or an HTTP date); inf for
    one that asks for ever, None for one that is not a wait. The caller caps
    it."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError, OSError):
            return None
    return None if math.isnan(seconds) else max(0.0, seconds)


def _detail(response) -> str:
    answer = _json(response)
    detail = answer.get("detail") if isinstance(answer, dict) else None
    text = detail if isinstance(detail, str) else (response.text or response.reason_phrase or "")
    return " ".join(str(text).split())[:300] or "no detail"
