"""Image sequences and the regions (crops) of each image that CLIP rewards embed.

A story comes with an image sequence: file paths, ids resolved against an image
root, or in-memory PIL images (TRL datasets). A *region source* turns each image
into a list of :class:`Region` objects: the whole image, a fixed grid of crops,
or the authors' detected boxes (a CSV of ``image_name,image_id,bbox,object,score``
rows, optionally with pre-cut crop files named ``f"{image_id}_{bbox}.jpg"``).
:func:`detect_regions` writes such a CSV with torchvision's Faster R-CNN.

torch/torchvision are imported only inside the functions that need them, so this
package stays cheap to import.

The code is split by responsibility: :mod:`~storyrl.images.loading` (Region,
ImageError, resolving and decoding image sequences), :mod:`~storyrl.images.regions`
(region sources) and :mod:`~storyrl.images.detection` (writing region tables).
The fast image pipeline (issue 32): :mod:`~storyrl.images.tensor_preprocess`
(regions + a torchvision transform -> the model's pixel batch, on its device),
:mod:`~storyrl.images.decoding` (the decode pool of worker processes,
:mod:`~storyrl.images.decode_worker` its worker) and
:mod:`~storyrl.images.resample` (Pillow's resampling as tensors).
Every name is re-exported here, so importers use ``storyrl.images`` only; the
fast pipeline's names load their modules on first use (numpy, subprocesses).
"""

from __future__ import annotations

from storyrl.images.detection import (
    COCO_CHECKPOINT,
    COCO_CHECKPOINT_URL,
    DETECTION_CSV_COLUMNS,
    detect_regions,
)
from storyrl.images.loading import (
    IMAGE_EXTENSIONS,
    Box,
    ImageError,
    Region,
    crop_bounds,
    load_region,
    load_regions,
    pil_digest,
    resolve_images,
)
from storyrl.images.regions import (
    REGION_KINDS,
    GridRegions,
    RegionTable,
    WholeImage,
    create_region_source,
    region_source_from_options,
    sequence_regions,
)

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
    # Also imported from storyrl.images by other modules, the CLI and tests:
    "COCO_CHECKPOINT",
    "COCO_CHECKPOINT_URL",
    "DETECTION_CSV_COLUMNS",
    "IMAGE_EXTENSIONS",
    "pil_digest",
    "crop_bounds",
    # The fast image pipeline, imported on first use (_LAZY):
    "PixelSpec",
    "pixel_spec",
    "region_batches",
    "region_pixels",
    "DecodePool",
    "decode_rgb",
    "decode_sources",
    "shared_pool",
]
_LAZY = {name: "tensor_preprocess" for name in ("PixelSpec", "pixel_spec", "region_batches", "region_pixels")}
_LAZY |= {name: "decoding" for name in ("DecodePool", "decode_rgb", "decode_sources", "shared_pool")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"storyrl.images.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
