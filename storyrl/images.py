"""Image sequences and the regions (crops) of each image that CLIP rewards embed.

A story comes with an image sequence: file paths, ids resolved against an image
root, or in-memory PIL images (TRL datasets). A *region source* turns each image
into a list of :class:`Region` objects: the whole image, a fixed grid of crops,
or the authors' detected boxes (a CSV of ``image_name,image_id,bbox,object,score``
rows, optionally with pre-cut crop files named ``f"{image_id}_{bbox}.jpg"``).
:func:`detect_regions` writes such a CSV with torchvision's Faster R-CNN.

torch/torchvision are imported only inside the functions that need them, so this
module stays cheap to import.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from PIL import Image

__all__ = [
    "Box",
    "GridRegions",
    "ImageError",
    "Region",
    "RegionTable",
    "WholeImage",
    "REGION_KINDS",
    "create_region_source",
    "region_source_from_options",
    "detect_regions",
    "load_region",
    "load_regions",
    "resolve_images",
    "sequence_regions",
]

Box = tuple[float, float, float, float]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")
REGION_KINDS = ("whole", "grid", "table", "crops")
DETECTION_CSV_COLUMNS = ("image_name", "image_id", "bbox", "object", "score")
COCO_CHECKPOINT = "fasterrcnn_resnet50_fpn_coco-258fb6c6.pth"
COCO_CHECKPOINT_URL = "https://download.pytorch.org/models/" + COCO_CHECKPOINT


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
    """The source decoded as RGB (ImageError if it cannot be read)."""
    try:
        if _is_pil(source):
            return source.convert("RGB")  # always a copy: the caller's image is never touched
        with Image.open(source) as im:
            return im.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ImageError(_source_name(source), f"cannot read image: {reason}") from exc


def _crop(image: Image.Image, region: Region) -> Image.Image:
    if region.box is None:
        return image
    w, h = image.size
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
    return image.crop((ix1, iy1, ix2, iy2))


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


# -- region sources ------------------------------------------------------------


def _image_size(image: Any) -> tuple[int, int]:
    if _is_pil(image):
        return image.size
    try:
        with Image.open(image) as im:  # reads the header only, no pixel decoding
            return im.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ImageError(_source_name(image), f"cannot read image: {reason}") from exc


class WholeImage:
    """One region per image: the whole image."""

    def regions(self, images: Sequence[Any], image_ids: Sequence[Any] | None = None) -> list[list[Region]]:
        return [[Region(image, None, i, f"img{i}")] for i, image in enumerate(images)]

    def describe(self) -> str:
        return "whole images"

    def __repr__(self) -> str:
        return "WholeImage()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WholeImage)

    def __hash__(self) -> int:
        return hash(WholeImage)


class GridRegions:
    """``grid`` x ``grid`` equal crops per image (row by row), preceded by the
    whole image when ``include_whole`` (3x3 + 1 = 10 regions, the authors' B)."""

    def __init__(self, grid: int = 3, include_whole: bool = True) -> None:
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
            raise ValueError(f"grid must be a positive integer, got {grid!r}")
        self.grid = grid
        self.include_whole = bool(include_whole)

    def boxes(self, width: int, height: int) -> list[Box]:
        n = self.grid
        xs = [width * k / n for k in range(n + 1)]
        ys = [height * k / n for k in range(n + 1)]
        return [(xs[c], ys[r], xs[c + 1], ys[r + 1]) for r in range(n) for c in range(n)]

    def regions(self, images: Sequence[Any], image_ids: Sequence[Any] | None = None) -> list[list[Region]]:
        out = []
        for i, image in enumerate(images):
            regs = [Region(image, None, i, f"img{i}")] if self.include_whole else []
            regs.extend(Region(image, box, i, f"img{i} {_fmt_box(box)}") for box in self.boxes(*_image_size(image)))
            out.append(regs)
        return out

    def describe(self) -> str:
        return f"{self.grid}x{self.grid} grid crops" + (" + whole image" if self.include_whole else "")

    def __repr__(self) -> str:
        return f"GridRegions(grid={self.grid}, include_whole={self.include_whole})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GridRegions) and (self.grid, self.include_whole) == (other.grid, other.include_whole)

    def __hash__(self) -> int:
        return hash((GridRegions, self.grid, self.include_whole))


def _parse_bbox(text: str) -> Box | None:
    """``"[x1, y1, x2, y2]"`` -> 4 finite floats, or None when malformed."""
    body = text.strip()
    if body[:1] in "[(" and body[-1:] in "])":
        body = body[1:-1]
    parts = body.replace(",", " ").split()
    if len(parts) != 4:
        return None
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        return None
    if not all(math.isfinite(v) for v in values):
        return None
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class _TableRow:
    bbox_text: str  # exactly as in the CSV: it names the crop file
    box: Box
    object: str
    line: int


class RegionTable:
    """Detected regions from a CSV (``image_id,bbox`` required; ``image_name,
    object,score`` optional): the first ``top_b`` rows per image id, in file order.

    With ``crops_dir`` the regions are the pre-cut crop files
    ``crops_dir/f"{image_id}_{bbox}.jpg"``; otherwise they are cut from the image.
    An image's id is ``image_ids[i]`` when given, else its file stem.
    The table is parsed once, here; malformed rows raise :class:`ImageError`.
    """

    def __init__(self, path: str | os.PathLike, top_b: int = 10, crops_dir: str | os.PathLike | None = None) -> None:
        if isinstance(top_b, bool) or not isinstance(top_b, int) or top_b < 1:
            raise ValueError(f"top_b must be a positive integer, got {top_b!r}")
        self.path = str(path)
        self.top_b = top_b
        self.crops_dir = None if crops_dir is None else str(crops_dir)
        if self.crops_dir is not None and not os.path.isdir(self.crops_dir):
            raise ImageError(self.crops_dir, "crops directory not found")
        self.table = self._parse()

    def _parse(self) -> dict[str, list[_TableRow]]:
        table: dict[str, list[_TableRow]] = {}
        try:
            # utf-8-sig: tolerate a BOM before the header (spreadsheet exports).
            with open(self.path, newline="", encoding="utf-8-sig") as f:
                reader = csv.DictReader(f)
                columns = [c.strip() for c in reader.fieldnames or []]
                missing = [c for c in ("image_id", "bbox") if c not in columns]
                if missing:
                    raise ImageError(
                        self.path, f"region table lacks column(s) {', '.join(missing)}; header: {', '.join(columns)}"
                    )
                reader.fieldnames = columns
                for row in reader:
                    image_id = (row.get("image_id") or "").strip()
                    rows = table.setdefault(image_id, [])
                    if len(rows) >= self.top_b:
                        continue  # only the first top_b rows per image are used
                    bbox_text = row.get("bbox") or ""
                    box = _parse_bbox(bbox_text)
                    if box is None:
                        raise ImageError(
                            self.path,
                            f"line {reader.line_num}: malformed bbox {bbox_text!r} (expected '[x1, y1, x2, y2]')",
                        )
                    if not image_id:
                        raise ImageError(self.path, f"line {reader.line_num}: empty image_id")
                    rows.append(_TableRow(bbox_text, box, (row.get("object") or "").strip(), reader.line_num))
        except OSError as exc:
            raise ImageError(self.path, f"cannot read region table: {exc.strerror or exc}") from exc
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ImageError(self.path, f"malformed region table: {exc}") from exc
        return table

    def image_id(self, image: Any, image_ids: Sequence[Any] | None, i: int) -> str:
        if image_ids is not None:
            return str(image_ids[i]).strip()
        name = image if isinstance(image, str) else getattr(image, "filename", "") or ""
        if not name:
            raise ImageError(_source_name(image), "in-memory images need image_ids to look up their regions")
        return Path(name).stem

    def regions(self, images: Sequence[Any], image_ids: Sequence[Any] | None = None) -> list[list[Region]]:
        if image_ids is not None and len(image_ids) != len(images):
            raise ValueError(f"{len(images)} images but {len(image_ids)} image_ids")
        out = []
        for i, image in enumerate(images):
            image_id = self.image_id(image, image_ids, i)
            rows = self.table.get(image_id)
            if not rows:
                raise ImageError(self.path, f"no regions for image id {image_id!r}")
            if self.crops_dir is not None:
                regs = []
                for row in rows:
                    name = f"{image_id}_{row.bbox_text}.jpg"
                    regs.append(Region(os.path.join(self.crops_dir, name), None, i, f"img{i} {name}"))
            else:
                regs = [
                    Region(image, row.box, i, f"img{i} {row.object + ' ' if row.object else ''}{_fmt_box(row.box)}")
                    for row in rows
                ]
            out.append(regs)
        return out

    def describe(self) -> str:
        where = f"crop files in {self.crops_dir}" if self.crops_dir else "boxes cut from the images"
        return f"top {self.top_b} regions per image from {self.path} ({len(self.table)} images; {where})"

    def __repr__(self) -> str:
        return f"RegionTable({self.path!r}, top_b={self.top_b}, crops_dir={self.crops_dir!r})"


_KIND_OPTIONS = {
    "whole": set(),
    "grid": {"grid", "include_whole"},
    "table": {"region_table", "top_b", "crops_dir"},
    "crops": {"region_table", "top_b", "crops_dir"},
}


def create_region_source(kind: str, **options: Any):
    """A region source by name: ``whole``, ``grid`` (options ``grid``,
    ``include_whole``), ``table`` (``region_table`` (alias ``path``), ``top_b``,
    optional ``crops_dir``) or ``crops`` (a table with ``crops_dir`` required).
    Options set to None count as not given."""
    name = str(kind).strip().lower()
    if name not in _KIND_OPTIONS:
        raise ValueError(f"unknown region source {kind!r}; valid kinds: {', '.join(REGION_KINDS)}")
    given = {k: v for k, v in options.items() if v is not None}
    if "path" in given:
        if "region_table" in given:
            raise ValueError("give the region table as region_table or path, not both")
        given["region_table"] = given.pop("path")
    known = set().union(*_KIND_OPTIONS.values())
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown region source option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    extra = sorted(set(given) - _KIND_OPTIONS[name])
    if extra:
        allowed = ", ".join(sorted(_KIND_OPTIONS[name])) or "none"
        raise ValueError(f"option(s) {', '.join(extra)} do not apply to region source {name!r} (accepted: {allowed})")
    if name == "whole":
        return WholeImage()
    if name == "grid":
        return GridRegions(grid=given.get("grid", 3), include_whole=given.get("include_whole", True))
    if "region_table" not in given:
        raise ValueError(f"region source {name!r} needs region_table (the regions CSV)")
    if name == "crops" and "crops_dir" not in given:
        raise ValueError("region source 'crops' needs crops_dir (the directory of crop files)")
    return RegionTable(given["region_table"], top_b=given.get("top_b", 10), crops_dir=given.get("crops_dir"))


def region_source_from_options(
    regions: str | None = None,
    region_table: str | None = None,
    crops_dir: str | None = None,
    top_b: int = 10,
    grid: int = 3,
) -> tuple[str, Any]:
    """(kind, source) from a region-based reward's options. Unset ``regions``
    means table/crops when given, else grid (no detector needed)."""
    if regions is None:
        regions = "table" if region_table else "crops" if crops_dir else "grid"
    if regions not in REGION_KINDS:
        raise ValueError(f"regions must be one of {REGION_KINDS}, got {regions!r}")
    if regions in ("grid", "whole") and (region_table or crops_dir):
        raise ValueError(f"regions={regions!r} does not use region_table/crops_dir; choose regions='table' or 'crops'")
    given = {"region_table": region_table, "crops_dir": crops_dir, "top_b": top_b, "grid": grid}
    used = {"table": ("region_table", "top_b"), "crops": ("region_table", "crops_dir", "top_b"), "grid": ("grid",), "whole": ()}
    return regions, create_region_source(regions, **{k: given[k] for k in used[regions]})


def sequence_regions(source: Any, images: Sequence[Any], image_ids: Sequence[Any] | None = None) -> list[Region]:
    """All regions of a story's images, flattened, each with its ``image_index``."""
    per_image = source.regions(images, image_ids)
    if len(per_image) != len(images):
        raise ValueError(f"{source.describe()}: {len(per_image)} region lists for {len(images)} images")
    out = []
    for i, regs in enumerate(per_image):
        out.extend(r if r.image_index == i else replace(r, image_index=i) for r in regs)
    return out


# -- detection ------------------------------------------------------------------


def _default_weights() -> Path:
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / COCO_CHECKPOINT


def _format_bbox(box: Iterable[float]) -> str:
    # Same text as str() of a list of 2-decimal floats: "[518.02, 30.21, 655.02, 189.49]".
    return str([round(float(v), 2) for v in box])


def _row_image_id(line: str) -> str | None:
    fields = next(csv.reader([line]), [])
    return fields[1] if len(fields) >= 2 else None


def _done_images(out) -> set[str]:
    """Image ids already in a region table (a :class:`LockedOutput`). The
    whole file is validated first (header, cell counts; errors name the
    line); a file cut mid-row by a kill is then repaired atomically, dropping
    the last image's rows, which may be incomplete, so it is detected again."""
    from storyrl.data import StoryDataError

    complete, partial = out.read()
    lines = complete.splitlines(keepends=True)
    if not lines:
        return set()
    header = next(csv.reader([lines[0]]), [])
    if [c.strip() for c in header] != list(DETECTION_CSV_COLUMNS):
        raise StoryDataError(
            out.path, f"header {header!r} is not {list(DETECTION_CSV_COLUMNS)!r}; refusing to append", "at line 1"
        )
    ids = []
    for lineno, line in enumerate(lines[1:], 2):
        fields = next(csv.reader([line]), [])
        if len(fields) != len(DETECTION_CSV_COLUMNS):
            raise StoryDataError(
                out.path, f"expected {len(DETECTION_CSV_COLUMNS)} cells, got {len(fields)}", f"at line {lineno}"
            )
        ids.append(fields[1])
    if partial:
        drop = set(ids[-1:]) | {_row_image_id(partial)} - {None}
        kept = [line for line, image_id in zip(lines[1:], ids) if image_id not in drop]
        out.replace(lines[0] + "".join(kept))
        ids = [i for i in ids if i not in drop]
    return set(ids)


def _read_tensor(path: str):
    import numpy as np
    import torch

    image = _open_rgb(path)
    array = np.asarray(image, dtype=np.uint8).copy()
    return torch.from_numpy(array).permute(2, 0, 1).float().div_(255.0)


def detect_regions(
    image_paths: Iterable[str | os.PathLike],
    out_csv: str | os.PathLike,
    weights: str | os.PathLike | None = None,
    top_b: int = 10,
    score_threshold: float = 0.0,
    device: str | None = None,
    batch_size: int = 4,
    progress: bool = True,
    **model_kwargs: Any,
) -> Path:
    """Detect regions with torchvision's Faster R-CNN (ResNet-50 FPN) and write
    the authors' CSV (``image_name,image_id,bbox,object,score``), ``top_b`` boxes
    per image by score.

    ``weights`` is a local state-dict file; by default torchvision's cached COCO
    checkpoint. ``object`` is the COCO category name for 91-class (COCO) models,
    else the label index. Rows are appended batch by batch; images whose id
    (file stem) is already in ``out_csv`` are skipped, so an interrupted run
    resumes (an image with no detections is redone). ``model_kwargs`` go to
    ``fasterrcnn_resnet50_fpn`` (e.g. ``min_size``/``max_size`` for speed).

    Note the authors used a Visual Genome ResNet-101 detector; these are COCO
    boxes, so scores will differ from theirs.
    """
    if isinstance(top_b, bool) or not isinstance(top_b, int) or top_b < 1:
        raise ValueError(f"top_b must be a positive integer, got {top_b!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    paths = [str(p) for p in image_paths]
    ids: dict[str, str] = {}
    for p in paths:
        stem = Path(p).stem
        if stem in ids and ids[stem] != p:
            raise ValueError(f"images {ids[stem]} and {p} share the image id {stem!r} (file stem)")
        ids[stem] = p
    paths = list(ids.values())  # duplicates of the same path are detected once

    weights_path = Path(weights) if weights is not None else _default_weights()
    if not weights_path.is_file():
        how = (
            f"download {COCO_CHECKPOINT_URL} on a machine with internet access and copy it to "
            f"{_default_weights()}, or pass its path as weights (--weights)"
        )
        looked = "the weights file" if weights is not None else "torchvision's cached COCO checkpoint"
        raise FileNotFoundError(f"Faster R-CNN weights not found: looked for {looked} {weights_path}; {how}")

    from storyrl.output_files import LockedOutput

    out_path = Path(out_csv)
    with LockedOutput(out_path, "keep") as out:  # locked until the table is written
        if not out.read()[0]:
            out.replace(",".join(DETECTION_CSV_COLUMNS) + "\n")
        done = _done_images(out)
        todo = [p for p in paths if Path(p).stem not in done]
        if todo:  # all done: do not pay for loading the model
            _detect_into(out, todo, weights_path, top_b, score_threshold, device, batch_size, progress, model_kwargs)
    return out_path


def _detect_into(out, todo, weights_path, top_b, score_threshold, device, batch_size, progress, model_kwargs) -> None:
    """Run the detector over ``todo`` and append its rows to ``out``."""
    import torch
    import torchvision  # noqa: F401  (storyrl's import hook makes this work without compiled ops)
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, fasterrcnn_resnet50_fpn
    from tqdm.auto import tqdm

    state = torch.load(weights_path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        for wrapper in ("model", "state_dict"):
            if isinstance(state.get(wrapper), dict):
                state = state[wrapper]
                break
    try:
        num_classes = int(state["roi_heads.box_predictor.cls_score.weight"].shape[0])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{weights_path}: not a fasterrcnn_resnet50_fpn state dict") from exc
    kwargs = {"num_classes": num_classes, "box_score_thresh": score_threshold, **model_kwargs}
    kwargs.setdefault("box_detections_per_img", max(100, top_b))
    model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, **kwargs)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"{weights_path}: does not fit fasterrcnn_resnet50_fpn: {exc}") from exc
    categories = FasterRCNN_ResNet50_FPN_Weights.COCO_V1.meta["categories"]
    names = categories if num_classes == len(categories) else None
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model.eval().to(device)

    with tqdm(total=len(todo), file=sys.stderr, disable=not progress, unit="img", desc="detecting regions") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            tensors = [_read_tensor(p).to(device) for p in batch]
            with torch.inference_mode():
                outputs = model(tensors)
            rows = []
            for path, detection in zip(batch, outputs):
                scores = detection["scores"].float().cpu()
                order = torch.argsort(scores, descending=True, stable=True)[:top_b]
                boxes, labels = detection["boxes"].float().cpu()[order], detection["labels"].cpu()[order]
                for box, label, score in zip(boxes.tolist(), labels.tolist(), scores[order].tolist()):
                    obj = names[label] if names is not None and 0 <= label < len(names) else str(label)
                    rows.append((Path(path).name, Path(path).stem, _format_bbox(box), obj, round(score, 6)))
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n").writerows(rows)
            out.write(buffer.getvalue())  # flushed: a kill loses at most the current batch
            bar.update(len(batch))
