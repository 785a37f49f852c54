"""The fast image pipeline: regions to a model's pixel batch with tensors.

The exact pipeline decodes, crops, resizes and normalises every region in
PIL (``load_regions`` + the model's torchvision transform, per image). This
one reads the transform once (:func:`pixel_spec`: Resize with the shortest
side or a fixed size, CenterCrop, ToTensor, Normalize, bicubic or bilinear,
as open_clip's and timm's eval transforms are), decodes each source once in
worker processes (:mod:`storyrl.images.decoding`), takes the regions as
slices of the decoded image (the crop box rounded and clamped as
``load_region`` does, the same ImageError for a zero-area box), and resizes,
centre-crops and normalises them on the model's device in batches
(:mod:`storyrl.images.resample`: Pillow's weights; ``matrix`` on CUDA,
``interpolate`` on the CPU).

The pixels equal the exact pipeline's but for resampling round-off: a uint8
level in under 1% of the values. Anything in the transform this module does
not understand makes :func:`pixel_spec` return None with the reason; callers
then use the exact pipeline.

Entry points: :func:`region_batches` (batches as decoding proceeds, for a
model's forward passes) and :func:`region_pixels` (one tensor, the regions'
order), both taking the regions, the torchvision transform, the device and
the model's input dtype.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from storyrl.images.decoding import INLINE_BELOW, DecodePool, decode_sources
from storyrl.images.loading import ImageError, Region, _is_pil, crop_bounds
from storyrl.images.resample import (
    BACKENDS,
    axis_weights,
    resample_interpolate,
    resample_matrix,
    scatter_weights,
    vertical_first,
)


@dataclass(frozen=True)
class PixelSpec:
    """What a torchvision eval transform does, as numbers: ``size`` the
    Resize (shortest side, or (h, w); None: none), ``max_size`` its cap on
    the longer side, ``filter`` bicubic or bilinear, ``crop`` the
    CenterCrop (h, w) or None, ``mean``/``std`` the Normalize or None."""

    size: int | tuple[int, int] | None
    max_size: int | None = None
    filter: str = "bicubic"
    crop: tuple[int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def resized(self, h: int, w: int) -> tuple[int, int]:
        """The size (h, w) Resize gives an ``h`` x ``w`` image (torchvision's rule)."""
        if self.size is None:
            return h, w
        if not isinstance(self.size, int):
            return self.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.size, int(self.size * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        return (new_long, new_short) if w <= h else (new_short, new_long)

    @property
    def out_size(self) -> tuple[int, int]:
        """(h, w) of every output (pixel_spec refuses a transform without a fixed one)."""
        return self.crop if self.crop is not None else self.size  # type: ignore[return-value]

    def window(self, h: int, w: int) -> tuple[int, int, int, int]:
        """``(top, left, out_h, out_w)`` of the centre crop of an ``h`` x ``w``
        resized image (negative offsets: zero padding, as torchvision pads)."""
        if self.crop is None:
            return 0, 0, h, w
        ch, cw = self.crop
        top = -((ch - h) // 2) if ch > h else int(round((h - ch) / 2.0))
        left = -((cw - w) // 2) if cw > w else int(round((w - cw) / 2.0))
        return top, left, ch, cw


def _name(t: Any) -> str:
    return getattr(t, "__name__", None) or type(t).__name__


def pixel_spec(transform: Any) -> tuple[PixelSpec | None, str | None]:
    """``(spec, None)`` for a transform the fast pipeline reproduces, else
    ``(None, why)``."""
    from torchvision import transforms as T

    steps = getattr(transform, "transforms", None)
    if not isinstance(transform, T.Compose) or steps is None:
        return None, f"the image transform is a {_name(transform)}, not a torchvision Compose"
    found: dict[str, Any] = {}
    order = ("Resize", "CenterCrop", "ToTensor", "Normalize")
    for step in steps:
        if isinstance(step, T.Resize):
            kind = "Resize"
            size = step.size
            if isinstance(size, (list, tuple)):
                size = size[0] if len(size) == 1 else (int(size[0]), int(size[1]))
            mode = getattr(step.interpolation, "value", step.interpolation)
            if mode not in ("bicubic", "bilinear"):
                return None, f"Resize with {mode} interpolation is not reproduced (bicubic and bilinear are)"
            found["size"], found["max_size"], found["filter"] = size, step.max_size, mode
        elif isinstance(step, T.CenterCrop):
            kind = "CenterCrop"
            found["crop"] = (int(step.size[0]), int(step.size[1]))
        elif isinstance(step, T.ToTensor):  # open_clip's and timm's MaybeToTensor too
            kind = "ToTensor"
        elif isinstance(step, T.Normalize):
            kind = "Normalize"
            found["mean"] = tuple(float(v) for v in np.asarray(step.mean, dtype=np.float64).reshape(-1))
            found["std"] = tuple(float(v) for v in np.asarray(step.std, dtype=np.float64).reshape(-1))
        elif _name(step) in ("MaybeConvertMode", "_convert_to_rgb") and getattr(step, "mode", "RGB") == "RGB":
            continue  # images are decoded as RGB already
        else:
            return None, f"the image transform's {_name(step)} step is not reproduced"
        if kind in found.get("seen", ()) or any(order.index(k) > order.index(kind) for k in found.get("seen", ())):
            return None, "the image transform's steps are not Resize, CenterCrop, ToTensor, Normalize in order"
        found["seen"] = (*found.get("seen", ()), kind)
    if "ToTensor" not in found.get("seen", ()):
        return None, "the image transform has no ToTensor"
    if "crop" not in found and not isinstance(found.get("size"), tuple):
        return None, "the image transform's output size depends on the image (no CenterCrop or fixed Resize)"
    for key in ("mean", "std"):
        if key in found and len(found[key]) not in (1, 3):
            return None, f"Normalize's {key} has {len(found[key])} values for RGB images"
    found.pop("seen")
    return PixelSpec(**{"size": None, **found}), None


# -- resampling ---------------------------------------------------------------------


def _interpolate(image, bounds, spec: PixelSpec):
    """``[R, 3, out_h, out_w]`` uint8 from an ``[H, W, 3]`` uint8 CPU tensor."""
    import torch

    out = torch.empty(len(bounds), 3, *spec.out_size, dtype=torch.uint8)
    for k, (x1, y1, x2, y2) in enumerate(bounds):
        # A compact channels-last copy: torch's uint8 kernel runs ~2x faster on it than on the view.
        crop = image[y1:y2, x1:x2].permute(2, 0, 1)[None].contiguous(memory_format=torch.channels_last)
        h, w = y2 - y1, x2 - x1
        rh, rw = spec.resized(h, w)
        resized = resample_interpolate(crop, (rh, rw), spec.filter, vertical_first(h, w, rh, rw))[0]
        top, left, oh, ow = spec.window(rh, rw)
        if top < 0 or left < 0 or top + oh > rh or left + ow > rw:  # CenterCrop larger than the image: zeros
            out[k].zero_()
            ys, xs = slice(max(top, 0), min(top + oh, rh)), slice(max(left, 0), min(left + ow, rw))
            out[k, :, ys.start - top:ys.stop - top, xs.start - left:xs.stop - left] = resized[:, ys, xs]
        else:
            out[k] = resized[:, top:top + oh, left:left + ow]
    return out


def _matrix(image, bounds, spec: PixelSpec, device, compute_dtype):
    """``[R, 3, out_h, out_w]`` float (uint8 values) on ``device``."""
    import torch

    height, width = image.shape[:2]
    pixels = image.to(device, non_blocking=True).permute(2, 0, 1).to(compute_dtype)
    geometry = []
    for x1, y1, x2, y2 in bounds:
        h, w = y2 - y1, x2 - x1
        rh, rw = spec.resized(h, w)
        geometry.append((x1, y1, h, w, rh, rw, *spec.window(rh, rw), vertical_first(h, w, rh, rw)))
    out = [None] * len(bounds)
    for vertical in (False, True):
        rows = [k for k, g in enumerate(geometry) if g[-1] == vertical]
        if not rows:
            continue
        x1, y1, h, w, rh, rw, top, left, oh, ow, _ = (np.asarray(v) for v in zip(*(geometry[k] for k in rows)))
        wy = scatter_weights(*axis_weights(h, rh, top, int(oh[0]), spec.filter), y1, height, device)
        wx = scatter_weights(*axis_weights(w, rw, left, int(ow[0]), spec.filter), x1, width, device)
        result = resample_matrix(pixels, wy.to(compute_dtype), wx.to(compute_dtype), vertical)
        for k, row in zip(rows, result):
            out[k] = row
    return torch.stack(out)


def _normalise(batch, spec: PixelSpec, dtype):
    """ToTensor's scaling and Normalize, as torchvision computes them (fp32), then ``dtype``."""
    import torch

    x = batch.to(torch.float32, memory_format=torch.contiguous_format)
    x = x.div_(255) if x.data_ptr() != batch.data_ptr() else x.div(255)  # in place on a fresh copy only
    if spec.mean is not None:
        mean = torch.as_tensor(spec.mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        std = torch.as_tensor(spec.std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
        x = x.sub_(mean).div_(std)
    return x.to(dtype)


# -- entry points ----------------------------------------------------------------------


def _spec(transform: Any) -> PixelSpec:
    if isinstance(transform, PixelSpec):
        return transform
    spec, why = pixel_spec(transform)
    if spec is None:
        raise ValueError(f"the fast image pipeline cannot reproduce this transform: {why}")
    return spec


def _as_tensor(decoded, pin: bool):
    import torch

    buffer, h, w = decoded
    if isinstance(buffer, torch.Tensor):
        return buffer[: h * w * 3].view(h, w, 3)
    image = torch.from_numpy(np.asarray(buffer)[: h * w * 3].reshape(h, w, 3))
    return image.pin_memory() if pin else image


def _indexed_batches(regions: Sequence[Region], transform: Any, device: Any, dtype: Any, batch_size: int,
                     backend: str | None, pool: DecodePool | None, compute_dtype: Any, inline_below: int,
                     ) -> Iterator[tuple[list[int], Any]]:
    import torch

    spec = _spec(transform)
    device = torch.device(device)
    backend = backend or ("interpolate" if device.type == "cpu" else "matrix")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "interpolate" and device.type != "cpu":
        raise ValueError("backend 'interpolate' runs on the CPU only (CUDA has no uint8 bicubic)")
    compute_dtype = compute_dtype or torch.float32
    dtype = dtype or torch.float32
    pin = device.type == "cuda"
    groups: dict[Any, list[int]] = {}
    for i, region in enumerate(regions):
        key = ("pil", id(region.source)) if _is_pil(region.source) else ("file", region.source)
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    alloc = (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)) if pin else None
    decoded = decode_sources([regions[m[0]].source for m in members], pool=pool, alloc=alloc,
                             inline_below=inline_below)
    done_ids: list[int] = []
    done: list[Any] = []
    with contextlib.closing(decoded):
        for indices, result in zip(members, decoded):
            if isinstance(result, ImageError):
                raise result
            image = _as_tensor(result, pin)
            bounds = [crop_bounds(regions[i], image.shape[1], image.shape[0]) for i in indices]
            if backend == "interpolate":
                pixels = _interpolate(image, bounds, spec).to(device)
            else:
                pixels = _matrix(image, bounds, spec, device, compute_dtype)
            done_ids.extend(indices)
            done.append(pixels)
            while len(done_ids) >= batch_size:
                stacked = torch.cat(done)
                yield done_ids[:batch_size], _normalise(stacked[:batch_size], spec, dtype)
                done_ids, done = done_ids[batch_size:], [stacked[batch_size:]]
    if done_ids:
        yield done_ids, _normalise(torch.cat(done), spec, dtype)


def region_batches(regions: Sequence[Region], transform: Any, device: Any = "cpu", dtype: Any = None,
                   batch_size: int = 64, *, backend: str | None = None, pool: DecodePool | None = None,
                   compute_dtype: Any = None, inline_below: int = INLINE_BELOW, background: bool = True,
                   ) -> Iterator[tuple[list[Region], Any]]:
    """``(regions, pixels)`` batches of ``batch_size`` (the last smaller):
    the model inputs ``[n, 3, H, W]`` in ``dtype`` on ``device`` that
    ``transform`` (a torchvision Compose, or a :class:`PixelSpec`) gives the
    regions, as decoding proceeds. Regions come grouped by image, not in
    the given order. ``backend``: "matrix" or "interpolate" (default: by
    device); ``compute_dtype``: the matrix backend's (float32; float64
    reproduces Pillow exactly). With ``background`` the batches are made
    in a thread of their own, up to 2 ahead, while the caller runs its
    model on the last one. Raises the first ImageError met."""
    batches = _indexed_batches(regions, transform, device, dtype, batch_size, backend, pool, compute_dtype,
                               inline_below)
    if background:
        batches = in_background(batches, depth=2)
    with contextlib.closing(batches):
        for indices, pixels in batches:
            yield [regions[i] for i in indices], pixels



def reproducible_spec(transform: Any, what: str, logger: Any) -> PixelSpec | None:
    """:func:`pixel_spec` of ``transform``, or None after one warning on
    ``logger`` naming ``what``: the caller then embeds with the exact pipeline."""
    spec, why = pixel_spec(transform)
    if spec is None:
        logger.warning("%s: image_pipeline='fast' uses the exact PIL pipeline: %s", what, why)
    return spec


def encoded_batches(regions: Sequence[Region], spec: Any, device: Any, dtype: Any, batch_size: int, encode,
                    ) -> Iterator[tuple[list[Region], Any]]:
    """``(regions, encode(pixels))`` per batch of :func:`region_batches`:
    decoding and preprocessing go on while ``encode`` runs the model on the
    last batch; the workers' batches are released when the caller stops early."""
    batches = region_batches(regions, spec, device, dtype, batch_size)
    with contextlib.closing(batches):
        for chunk, pixels in batches:
            yield chunk, encode(pixels)

_END = object()


def in_background(items: Iterator, depth: int = 2, poll_s: float = 0.2) -> Iterator:
    """``items`` produced in a daemon thread, at most ``depth`` ahead of the
    consumer; the producer's exception is raised in the consumer, and
    closing this generator stops the producer (waits are bounded: each
    side checks the other every ``poll_s``). In the thread, torch runs its
    small preprocessing ops on 1 OpenMP thread (a per-thread setting with
    the OpenMP backend): intra-op threads contending with the decode
    workers for the cores cost more than they gain on such ops."""
    import queue

    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        _single_threaded_torch()
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        buffer.put((item, None), timeout=poll_s)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            outcome = (_END, None)
        except BaseException as exc:  # handed to the consumer
            outcome = (None, exc)
        finally:
            if stop.is_set():
                items.close()
        while not stop.is_set():
            try:
                buffer.put(outcome, timeout=poll_s)
                return
            except queue.Full:
                continue

    thread = threading.Thread(target=produce, name="storyrl-preprocess", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item, exc = buffer.get(timeout=poll_s)
            except queue.Empty:
                if not thread.is_alive() and buffer.empty():
                    raise RuntimeError("the preprocessing thread stopped without a result") from None
                continue
            if exc is not None:
                raise exc
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=30.0)


def _single_threaded_torch() -> None:
    import torch

    if "ATen parallel backend: OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(1)  # this thread only: OpenMP's thread count is per thread


def region_pixels(regions: Sequence[Region], transform: Any, device: Any = "cpu", dtype: Any = None, **options):
    """All of ``regions``' pixels as one ``[len(regions), 3, H, W]`` tensor,
    in their order (options as :func:`region_batches`)."""
    import torch

    if not regions:
        raise ValueError("no regions")
    order, parts = [], []
    for indices, pixels in _indexed_batches(regions, transform, device, dtype, options.pop("batch_size", 256),
                                            options.pop("backend", None), options.pop("pool", None),
                                            options.pop("compute_dtype", None),
                                            options.pop("inline_below", INLINE_BELOW)):
        order.extend(indices)
        parts.append(pixels)
    if options:
        raise TypeError(f"unknown options: {', '.join(options)}")
    stacked = torch.cat(parts)
    position = torch.empty(len(order), dtype=torch.long)
    position[torch.as_tensor(order)] = torch.arange(len(order))
    return stacked[position.to(stacked.device)]
