"""Region sources: how each image of a story becomes a list of :class:`Region`.

The whole image (:class:`WholeImage`), a fixed grid of crops
(:class:`GridRegions`), or the authors' detected boxes (:class:`RegionTable`:
a CSV of ``image_name,image_id,bbox,object,score`` rows, optionally with
pre-cut crop files named ``f"{image_id}_{bbox}.jpg"``). Rewards pick one by
name (:func:`create_region_source`, :func:`region_source_from_options`) and
flatten a story's regions with :func:`sequence_regions`.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image

from storyrl.images.decode_worker import READ_ERRORS, failure_reason
from storyrl.images.loading import Box, ImageError, Region, _fmt_box, _is_pil, _source_name

REGION_KINDS = ("whole", "grid", "table", "crops")


def _image_size(image: Any) -> tuple[int, int]:
    if _is_pil(image):
        return image.size
    try:
        with Image.open(image) as im:  # reads the header only, no pixel decoding
            return im.size
    except READ_ERRORS as exc:
        raise ImageError(_source_name(image), failure_reason(exc)) from exc


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
