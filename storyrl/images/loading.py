"""What a :class:`Region` is, a story's image sequence, and decoding/cropping.

A story comes with an image sequence: file paths, ids resolved against an image
root, or in-memory PIL images (TRL datasets); :func:`resolve_images` turns any
of these into one path or PIL image per position. A :class:`Region` is a box of
one of those images (or the whole image); :func:`load_region` and
:func:`load_regions` decode and crop it. Everything else in
:mod:`storyrl.images` builds on these names.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from storyrl.images.decode_worker import READ_ERRORS, failure_reason, open_rgb

Box = tuple[float, float, float, float]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")


class ImageError(ValueError):
    """An image (or region table) that cannot be used; ``path`` names the file."""

    def __init__(self, path: Any, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):
        # Default exception pickling would call __init__ with the message only.
        return (type(self), (self.path, self.problem))


# -- regions -------------------------------------------------------------------

_pil_digests: dict[int, str] = {}
_pil_lock = threading.Lock()


def _is_pil(obj: Any) -> bool:
    return isinstance(obj, Image.Image)


def pil_digest(image: Image.Image) -> str:
    """md5 of an in-memory image's mode, size and pixels, computed once per object.

    Cached by ``id`` and dropped by a weakref finalizer when the image is freed,
    so ids are never reused for a stale entry and images are not kept alive.
    The image must not be modified in place after its first use as a region.
    """
    key = id(image)
    digest = _pil_digests.get(key)
    if digest is not None:
        return digest
    h = hashlib.md5()
    h.update(image.mode.encode())
    h.update(repr(image.size).encode())
    h.update(image.tobytes())
    digest = h.hexdigest()
    with _pil_lock:
        if key not in _pil_digests:
            try:
                weakref.finalize(image, _pil_digests.pop, key, None)
            except TypeError:  # not weak-referenceable: do not cache
                return digest
            _pil_digests[key] = digest
    return digest


def _as_box(box: Any) -> Box | None:
    if box is None:
        return None
    values = tuple(float(v) for v in box)
    if len(values) != 4:
        raise ValueError(f"a box needs 4 numbers (x1, y1, x2, y2), got {box!r}")
    return values  # type: ignore[return-value]


def _fmt_box(box: Box) -> str:
    return "[" + ",".join(f"{v:g}" for v in box) + "]"


@dataclass(frozen=True, eq=False)
class Region:
    """A part of an image to embed: ``box`` (x1, y1, x2, y2 pixels) of ``source``
    (a file path or a PIL image), or the whole source when ``box`` is None.

    Equality and hashing use :attr:`key` only; ``image_index`` (position in the
    story's sequence) and ``label`` (for explanations) are informational.
    """

    source: str | Any
    box: Box | None = None
    image_index: int = field(default=0, compare=False)
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Normalise so that Path("a.jpg") and "a.jpg", [1, 2, 3, 4] and (1., 2., 3., 4.) share a key.
        if isinstance(self.source, os.PathLike):
            object.__setattr__(self, "source", os.fspath(self.source))
        elif not isinstance(self.source, str) and not _is_pil(self.source):
            raise TypeError(f"Region source must be a path or a PIL image, got {type(self.source).__name__}")
        object.__setattr__(self, "box", _as_box(self.box))

    @property
    def key(self) -> tuple[str, Box | None]:
        """Hashable cache key: ``(path, box)``, or ``("pil:<md5>", box)`` for PIL images."""
        if _is_pil(self.source):
            return ("pil:" + pil_digest(self.source), self.box)
        return (self.source, self.box)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Region):
            return NotImplemented
        return self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _source_name(source: Any) -> str:
    return source if isinstance(source, str) else f"<PIL image {source.mode} {source.size[0]}x{source.size[1]}>"


def _open_rgb(source: Any) -> Image.Image:
    """The source decoded as RGB (ImageError if it cannot be read); a PIL
    source is always copied, never touched."""
    try:
        return open_rgb(source)
    except READ_ERRORS as exc:
        raise ImageError(_source_name(source), failure_reason(exc)) from exc


def crop_bounds(region: Region, width: int, height: int) -> tuple[int, int, int, int]:
    """The integer box (x1, y1, x2, y2) that cropping ``region`` out of a
    ``width`` x ``height`` image takes: the box clamped to the image and
    rounded as PIL's ``crop`` rounds it, at least 1 pixel each way
    (ImageError if it has zero area inside the image). The whole image for
    ``box=None``."""
    if region.box is None:
        return 0, 0, width, height
    w, h = width, height
    x1, y1, x2, y2 = region.box
    # Detector boxes may poke out of the image by a fraction of a pixel: clamp.
    cx1, cx2 = min(max(x1, 0.0), w), min(max(x2, 0.0), w)
    cy1, cy2 = min(max(y1, 0.0), h), min(max(y2, 0.0), h)
    if not (cx2 > cx1 and cy2 > cy1):
        raise ImageError(
            _source_name(region.source),
            f"box {_fmt_box(region.box)} has zero area inside the {w}x{h} image",
        )
    # PIL rounds float boxes (as the authors' img.crop(bbox) did); keep at least 1 pixel.
    ix1, iy1, ix2, iy2 = round(cx1), round(cy1), round(cx2), round(cy2)
    if ix2 <= ix1:
        ix1 = min(ix1, w - 1)
        ix2 = ix1 + 1
    if iy2 <= iy1:
        iy1 = min(iy1, h - 1)
        iy2 = iy1 + 1
    return ix1, iy1, ix2, iy2


def _crop(image: Image.Image, region: Region) -> Image.Image:
    if region.box is None:
        return image
    return image.crop(crop_bounds(region, *image.size))


def load_region(region: Region) -> Image.Image:
    """The region as an RGB PIL image (ImageError if unreadable or empty)."""
    return _crop(_open_rgb(region.source), region)


def load_regions(regions: Sequence[Region]) -> list[Image.Image]:
    """RGB images of ``regions`` in order; each source is decoded only once."""
    out: list[Image.Image | None] = [None] * len(regions)
    groups: dict[Any, list[int]] = {}
    for i, region in enumerate(regions):
        # PIL sources are grouped by identity: hashing pixels just to group is wasteful.
        gkey = ("pil", id(region.source)) if _is_pil(region.source) else ("file", region.source)
        groups.setdefault(gkey, []).append(i)
    for indices in groups.values():
        image = _open_rgb(regions[indices[0]].source)
        for i in indices:
            out[i] = _crop(image, regions[i])
        del image  # only one full decoded image alive at a time
    return out  # type: ignore[return-value]


# -- image sequences -------------------------------------------------------------


def resolve_images(
    images: Sequence[Any] | None = None,
    image_ids: Sequence[Any] | None = None,
    image_root: str | os.PathLike | None = None,
    extensions: Sequence[str] = IMAGE_EXTENSIONS,
) -> list[Any]:
    """A story's image sequence: one file path (str) or PIL image per position.

    ``images`` entries are paths (relative ones resolved against ``image_root``)
    or PIL images (returned as is). Otherwise each of ``image_ids`` is looked up
    as ``image_root/<id>`` plus the first extension that exists (an id that
    already ends in one of ``extensions`` is tried as is first).
    """
    root = Path(image_root) if image_root is not None else None
    if isinstance(images, (str, os.PathLike)) or _is_pil(images):
        images = [images]  # a bare string would otherwise be iterated character by character
    if images is not None and len(images) > 0:
        out = []
        for item in images:
            if _is_pil(item):
                out.append(item)
                continue
            if not isinstance(item, (str, os.PathLike)):
                raise ImageError(repr(item)[:80], f"an image must be a path or a PIL image, not {type(item).__name__}")
            path = Path(item)
            if root is not None and not path.is_absolute():
                path = root / path
            if not path.is_file():
                raise ImageError(path, "image file not found")
            out.append(str(path))
        return out
    if isinstance(image_ids, (str, int)):
        image_ids = [image_ids]
    if image_ids is None or len(image_ids) == 0:
        raise ImageError("<no images>", "story has no images or image_ids")
    if root is None:
        raise ImageError("<no image_root>", f"image ids such as {str(image_ids[0])!r} need an image_root to resolve")
    out = []
    lowered = tuple(e.lower() for e in extensions)
    for image_id in image_ids:
        name = str(image_id)
        tried = []
        if Path(name).suffix.lower() in lowered:
            tried.append(root / name)
        tried.extend(root / (name + ext) for ext in extensions)
        found = next((p for p in tried if p.is_file()), None)
        if found is None:
            raise ImageError(tried[0], f"no image file for id {name!r}; tried: {', '.join(map(str, tried))}")
        out.append(str(found))
    return out
