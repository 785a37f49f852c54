"""What ``storyrl serve`` refuses, and how: request limits, token
authentication and the image root.

* :class:`Limits`: the body size (413, enforced while the body is read, so
  a false Content-Length or a chunked body is never buffered beyond it),
  stories per request and characters per story (422), pixels per image, and
  the image root. Each refusal names the limit and the ``storyrl serve``
  option that sets it.
* :class:`BodyLimit` and :class:`TokenAuth`: small ASGI middlewares.
* :func:`guarded_protocol`: uvicorn's HTTP/1.1 protocol with the time to
  receive a request (headers and body) bounded and the open connections
  capped; :func:`connection_budget` fits the cap to the process file limit.
  Neither can be an ASGI middleware: the app sees a request only once its
  headers are in, and a socket that never sends them holds a file all the
  same. (uvicorn has neither setting: its keep-alive timer restarts with
  every byte; hypercorn bounds headers but not a trickled body, and caps no
  connections; granian bounds headers and queues connections past its cap
  unaccepted, /health with them.)
* :class:`ImageGuard`: clients name images relative to the server's image
  root; nothing outside it is ever opened (absolute paths, ``..`` and
  symlinks leading out are a 422 naming the label), and an image over the
  pixel limit, read from its header, makes its story unscorable without
  being decoded.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.images.loading import IMAGE_EXTENSIONS

__all__ = ["BodyLimit", "ImageGuard", "Limits", "Refused", "TokenAuth", "connection_budget", "guarded_protocol",
           "is_loopback"]

log = logging.getLogger(__name__)

MIB = 1 << 20
#: Connections at most when max_connections is None (fewer when the file limit is lower).
DEFAULT_MAX_CONNECTIONS = 1000
#: The listen backlog, and so the most connections asyncio accepts at once, before any is
#: counted against max_connections: their files must be free too.
ACCEPT_BACKLOG = 64
#: Files kept free beside the connections and a backlog's burst: the listening socket, logs, the
#: reward's own files.
FD_RESERVE = 64
_SPARE = 4 * ACCEPT_BACKLOG + FD_RESERVE
#: Images one label may name (each is checked on disk); not an option.
MAX_IMAGES_PER_LABEL = 256


class Refused(Exception):
    """A request the server will not score: HTTP ``status`` with ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """The server's limits (defaults = ``storyrl serve``'s). ``image_root``
    None: requests naming images are refused. ``receive_timeout_s``: the
    most seconds a client may take to send a request, headers and body,
    counted from its connection or from the previous answer on it;
    ``max_connections``: connections open at once (None: 1000, or fewer
    when the process file limit is lower; see :func:`connection_budget`)."""

    max_body_bytes: int = 16 * MIB
    max_stories_per_request: int = 1024
    max_story_chars: int = 20_000
    max_image_pixels: int = 40_000_000
    image_root: str | None = None
    receive_timeout_s: float = 30.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_stories_per_request", "max_story_chars", "max_image_pixels",
                     "max_connections"):
            value = getattr(self, name)
            if value is None and name == "max_connections":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        value = self.receive_timeout_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"receive_timeout_s must be a finite number > 0, got {value!r}")
        if self.image_root is not None and not Path(self.image_root).is_dir():
            raise ValueError(f"image_root: no such directory {self.image_root}")

    def check_queries(self, queries: list[str], prompts: list | None) -> None:
        """422 when a request holds too many stories or too long a story. A
        story's length is that of the query after its prompt (the response as
        sent, end markers included), so parsing it stays cheap."""
        if len(queries) > self.max_stories_per_request:
            raise Refused(422, f"query has {len(queries)} stories; the server takes at most "
                               f"{self.max_stories_per_request} per request (--max-stories-per-request)")
        for i, query in enumerate(queries):
            n = len(query)
            if n <= self.max_story_chars:
                continue
            prompt = prompts[i] if prompts is not None and i < len(prompts) else None
            at = query.find(prompt) if isinstance(prompt, str) and prompt else -1
            if at >= 0:
                n -= at + len(prompt)
            if n > self.max_story_chars:
                raise Refused(422, f"query[{i}]: the story has {n} characters; the server takes at most "
                                   f"{self.max_story_chars} (--max-story-chars)")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


async def _send_json(send, status: int, detail: str, headers: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413, decided
    from Content-Length when given and otherwise while reading; at most
    ``max_bytes`` are held. The body read is handed on to the app."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = (f"request body over {self.max_bytes} bytes; the server's limit is {self.max_bytes} bytes "
                   "(--max-body-bytes)")
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_json(send, 413, too_big, [(b"connection", b"close")])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_json(send, 413, too_big, [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()  # then disconnect, for the app's watch

        await self.app(scope, replay, send)


class TokenAuth:
    """ASGI middleware: every path but ``open_paths`` needs ``Authorization:
    Bearer <token>`` (401 otherwise; constant-time comparison)."""

    def __init__(self, app, token: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.token = token.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, credential = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credential.strip(), self.token):
            return await _send_json(send, 401, "missing or wrong token: send 'Authorization: Bearer <token>' "
                                    "(the server's --token / STORYRL_SERVE_TOKEN)", [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


def connection_budget(max_connections: int | None) -> int:
    """The connection cap for ``max_connections`` (None: the default, lowered
    to fit the hard file limit), with the process's soft file limit raised
    to hold it plus a burst of :data:`ACCEPT_BACKLOG` accepted connections
    and :data:`FD_RESERVE` (a server out of files stops accepting, /health
    included). ValueError when the hard limit is too low for an explicit
    cap."""
    try:
        import resource
    except ImportError:  # no POSIX file limits (Windows)
        return max_connections or DEFAULT_MAX_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if max_connections is None:
        n = DEFAULT_MAX_CONNECTIONS if hard == unlimited else min(DEFAULT_MAX_CONNECTIONS, hard - _SPARE)
        if n < 1:
            raise ValueError(f"this process may open only {hard} files (ulimit -Hn); the server needs more than "
                             f"{_SPARE}")
    else:
        n = max_connections
        if hard != unlimited and n + _SPARE > hard:
            raise ValueError(f"max_connections {n} needs {n + _SPARE} open files, but this process may open at "
                             f"most {hard} (ulimit -Hn): set --max-connections {max(hard - _SPARE, 1)} or less, "
                             "or raise the limit")
    if soft != unlimited and soft < n + _SPARE:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + _SPARE, hard))
        log.info("raised the open-file limit from %d to %d for %d connections", soft, n + _SPARE, n)
    return n


def guarded_protocol(receive_timeout_s: float, max_connections: int, stats: Counter | None = None) -> type:
    """uvicorn's h11 protocol class (``uvicorn.Config(http=...)``) for one
    server, adding two bounds:

    * A request (headers and body) must be in within ``receive_timeout_s`` of
      the connection opening, or of the previous answer on a kept-alive
      connection; past it the client gets 408 and the connection closes. A
      fully received request is not timed here (the reward call has its own
      limit).
    * At most ``max_connections`` are open: one more closes the oldest
      connection still sending its request (503), so slow or idle clients
      cannot starve new ones; when every open connection has a request in
      progress, the newcomer gets 503 and is closed.

    ``stats`` counts ``receive_timeouts``, ``evicted_connections`` and
    ``refused_connections``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    stats = Counter() if stats is None else stats
    receiving: OrderedDict = OrderedDict()  # connections still sending a request, oldest first
    warned: set[str] = set()

    def count(kind: str, message: str) -> None:
        stats[kind] += 1
        if kind not in warned:  # once per kind: a flood must not flood the log too; /info counts
            warned.add(kind)
            log.warning("%s (counted as %s in /info)", message, kind)

    class GuardedH11Protocol(H11Protocol):
        _deadline = None
        _partial = False  # bytes of a request came in this window (else the connection is idle)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next(iter(receiving), None)
                if oldest is None:
                    count("refused_connections", f"{max_connections} connections open, each with a request in "
                          "progress: refusing new ones (--max-connections)")
                    self._close(503, f"the server has {max_connections} connections open (--max-connections); "
                                     "retry later", idle_too=True)
                    return
                count("evicted_connections", f"{max_connections} connections open: closing the oldest one still "
                      "sending its request for each new one (--max-connections)")
                oldest._close(503, f"closed to make room: the server has {max_connections} connections open "
                                   "(--max-connections) and this one had not sent its request")
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._partial = True
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._deadline is not None and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the request is in (or the connection is done)

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm()  # the next request's time starts with this answer
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(receive_timeout_s, self._expired)
            self._partial = False
            receiving[self] = None

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            receiving.pop(self, None)

        def _expired(self) -> None:
            self._deadline = None
            count("receive_timeouts", f"a client did not send its request within {receive_timeout_s:g} s: "
                  "closed (--receive-timeout-s)")
            self._close(408, f"the request was not received within {receive_timeout_s:g} s (--receive-timeout-s)")

        def _close(self, status: int, detail: str, idle_too: bool = False) -> None:
            """Answer ``status`` to a half-sent request (unless the app has
            begun an answer), then close. An idle connection closes without
            one unless ``idle_too``: a client sending its next request just
            then would read the answer as that request's."""
            self._disarm()
            if self.transport.is_closing():
                return
            idle = not idle_too and not self._partial and (self.cycle is None or self.cycle.response_complete)
            if not idle and (self.cycle is None or self.cycle.response_complete or not self.cycle.response_started):
                body = json.dumps({"detail": detail}).encode()
                reason = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
                self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                     b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
            self.transport.close()  # the app, if it waits for the body, sees a disconnect

    return GuardedH11Protocol


class ImageGuard:
    """Resolves the images a request's labels name inside the image root and
    checks their size from the file header (cached by path, size and mtime)."""

    def __init__(self, limits: Limits, cache_size: int = 4096) -> None:
        self.root = os.path.realpath(limits.image_root) if limits.image_root is not None else None
        self.max_pixels = limits.max_image_pixels
        self._pixels: OrderedDict[tuple, int | None] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def apply(self, contexts: list[dict[str, Any]]) -> dict[int, str]:
        """Rewrites each context's ``images`` as absolute paths inside the
        root (in place; ``image_ids`` are checked and kept); returns the
        stories to leave unscored (index -> reason: an image over the pixel
        limit). Raises :class:`Refused` (422) for a path outside the root, or
        any image when the server has no image root."""
        blocked: dict[int, str] = {}
        for i, context in enumerate(contexts):
            names = [*context.get("images", ()), *context.get("image_ids", ())]
            if not names:
                continue
            where = f"labels[{i}]"
            if self.root is None:
                raise Refused(422, f"{where}: names images, but the server has no image root; start it with "
                                   "--image-root DIR to serve images from DIR")
            if len(names) > MAX_IMAGES_PER_LABEL:
                raise Refused(422, f"{where}: names {len(names)} images; at most {MAX_IMAGES_PER_LABEL}")
            ids = [self._id_file(x, where) for x in context.get("image_ids", ())]  # each checked
            if "images" in context:
                context["images"] = [self._inside(p, where) for p in context["images"]]
            files = context.get("images") or [f for f in ids if f]
            for path in files:
                pixels = self._pixel_count(path)
                if pixels is not None and pixels > self.max_pixels:
                    blocked[i] = (f"image {os.path.relpath(path, self.root)!r} has {pixels:,} pixels, over the "
                                  f"server's limit of {self.max_pixels:,} (--max-image-pixels)")
                    break
        return blocked

    def _inside(self, name: str, where: str) -> str:
        """The real path of ``name`` under the root (422 when outside)."""
        if not name or os.path.isabs(name) or "\x00" in name:
            raise Refused(422, f"{where}: image {name!r} must be a path relative to the server's image root")
        path = os.path.realpath(os.path.join(self.root, name))
        if os.path.commonpath([path, self.root]) != self.root:
            raise Refused(422, f"{where}: image {name!r} is outside the server's image root (--image-root)")
        return path

    def _id_file(self, image_id: str, where: str) -> str | None:
        """The file an image id resolves to, as the rewards resolve ids (the
        id as is when it has an image extension, then id + extension), or
        None when there is none (the reward then finds the story
        unscorable). Every candidate must stay inside the root."""
        candidates = [image_id] if Path(image_id).suffix.lower() in IMAGE_EXTENSIONS else []
        candidates += [image_id + ext for ext in IMAGE_EXTENSIONS]
        for name in candidates:
            path = self._inside(name, where)
            if os.path.isfile(path):
                return path
        return None

    def _pixel_count(self, path: str) -> int | None:
        """Width x height from the header (PIL opens lazily: no decoding);
        None when the file is missing or unreadable (the reward reports it)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._pixels:
                self._pixels.move_to_end(key)
                return self._pixels[key]
        from PIL import Image

        try:
            with Image.open(path) as image:
                pixels = image.size[0] * image.size[1]
        except Image.DecompressionBombError:
            pixels = math.inf  # over PIL's own bound
        except (OSError, ValueError, SyntaxError):
            pixels = None
        with self._lock:
            self._pixels[key] = pixels
            if len(self._pixels) > self._cache_size:
                self._pixels.popitem(last=False)
        return pixels
