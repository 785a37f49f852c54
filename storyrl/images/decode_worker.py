"""Reading an image file as RGB, and the decode pool's worker process.

This module imports PIL and the standard library only: a pool worker
(:mod:`storyrl.images.decoding`) imports it and nothing heavier, so it
starts in a fraction of a second. :func:`open_rgb` is the one decoding of
storyrl (the exact path's ``load_region`` uses it too), so both pipelines
read the same pixels and fail with the same reasons.
"""

from __future__ import annotations

import sys
from typing import Any

from PIL import Image

#: What reading a broken, truncated or unsupported file raises.
READ_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def failure_reason(exc: BaseException) -> str:
    """The reason a read failed, as ``ImageError`` reports it."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot read image: {reason}"


def open_rgb(source: Any) -> Image.Image:
    """``source`` (a path or a PIL image) decoded as an RGB image; a PIL
    source is copied, never changed. Raises one of :data:`READ_ERRORS`."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    with Image.open(source) as im:
        return im.convert("RGB")


def settings() -> tuple:
    """PIL's module settings that change what decoding does, which a worker
    applies with every job (the caller may change them at any time)."""
    from PIL import ImageFile

    return Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES


def serve_fd(fd: int) -> None:
    """:func:`serve` on the socket ``fd`` the pool passed (the worker's ``main``)."""
    from multiprocessing.connection import Connection

    serve(Connection(fd))


def serve(conn) -> None:
    """A worker's loop: receive ``(job, path, settings(), slot)``, answer
    ``(job, (width, height), "slot")`` with the RGB bytes written to the
    shared-memory ``slot`` (``(name, capacity)``), or ``(job, (width,
    height), None)`` followed by the bytes when there is no slot or they do
    not fit, or ``(job, None, reason)``. ``None`` or a closed connection
    ends it; a job whose path is ``"<modules>"`` is answered with the
    top-level modules loaded (for tests: no torch here)."""
    from PIL import ImageFile

    maps: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job, path, (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES), slot = message
        if path == "<modules>":
            conn.send((job, None, sorted({name.split(".")[0] for name in sys.modules})))
            continue
        try:
            image = open_rgb(path)
            data = image.tobytes()
        except READ_ERRORS as exc:
            conn.send((job, None, failure_reason(exc)))
            continue
        if slot is not None and len(data) <= slot[1]:
            target = _mapped(maps, *slot)
            if target is not None:
                target[: len(data)] = data
                conn.send((job, image.size, "slot"))
                continue
        conn.send((job, image.size, None))
        conn.send_bytes(data)


def _mapped(maps: dict, name: str, capacity: int):
    """The pool's shared-memory slot ``name`` mapped here (kept for reuse;
    the few oldest unmapped when the pool has replaced them)."""
    import mmap
    import os

    if name not in maps:
        if len(maps) >= 8:
            maps.pop(next(iter(maps))).close()
        try:
            fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        except OSError:
            return None
        try:
            maps[name] = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
    return maps[name]
