"""PIL's resampling of uint8 images, written as tensor operations (pure
math, no state).

Pillow resizes an 8-bit image in two separable passes, each rounding back
to uint8: horizontal then vertical, except that Pillow 13 runs the vertical
pass first when the height shrinks by more than twice as many pixels as the
width does (:func:`vertical_first`; found by comparing both orders with
Pillow, and checked against the installed Pillow at run time). For every output pixel of an axis it
computes the weights of a filter (bicubic with a = -0.5, or the bilinear
triangle) over the input pixels in ``centre ± support``: ``scale = in / out``,
``support = filter support x max(scale, 1)``, ``centre = (i + 0.5) x scale``,
the weights normalised per output pixel, the taps clipped to the input, then
quantised to 22-bit fixed point; each pass sums, rounds half up and clamps
to 0..255 (Pillow's ``Resample.c``).

Two backends compute this on tensors:

* ``"matrix"``: each axis's weights as a dense ``[out, in]`` matrix
  (:func:`axis_weights`, :func:`dense_weights`), so a resize is
  ``round(Wy @ round(img @ Wx^T))`` in batched fp32 matmuls. A crop box and a
  centre crop fold into the matrices (their rows and columns), so all the
  regions of one decoded image come out of two matmuls. Equals Pillow except
  where fp32 rounding of the 22-bit sums lands a value within ~1e-5 of a
  rounding boundary (off by one level there). Runs on any device: the one
  meant for CUDA, where no uint8 bicubic exists.
* ``"interpolate"``: ``torch.nn.functional.interpolate`` on uint8 with
  ``antialias=True``, torch's CPU port of Pillow's algorithm (its own weight
  precision: off by one level in under 1% of the values). The float
  ``interpolate`` antialias path is *not* used: when upscaling it applies
  another kernel (off by up to ~20 levels on noise).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Pillow's fixed-point precision of 8-bit resampling weights (32 - 8 - 2 bits).
PRECISION_BITS = 22
BACKENDS = ("matrix", "interpolate")


def _bicubic(x: np.ndarray) -> np.ndarray:
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


#: filter name -> (support, function), as Pillow defines them.
FILTERS = {"bicubic": (2.0, _bicubic), "bilinear": (1.0, _bilinear)}


def axis_weights(in_sizes, out_sizes, starts, count: int, filter: str = "bicubic",  # noqa: A002
                 quantize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's weights for resizing ``N`` inputs of ``in_sizes[n]`` pixels
    to ``out_sizes[n]``, keeping the outputs ``starts[n] .. starts[n] +
    count`` (a centre crop; outputs outside ``[0, out)`` get no weights:
    zero padding).

    Returns ``(first, weights)``: ``first [N, count]`` the first input pixel
    of each output pixel's taps and ``weights [N, count, K]`` (float64;
    taps past the input are 0), quantised to Pillow's 22-bit fixed point
    unless ``quantize`` is False."""
    support, function = FILTERS[filter]
    in_sizes = np.asarray(in_sizes, dtype=np.float64)[:, None]
    out_sizes = np.asarray(out_sizes, dtype=np.float64)[:, None]
    if np.any(in_sizes < 1) or np.any(out_sizes < 1):
        raise ValueError("resampling needs at least 1 input and 1 output pixel")
    scale = in_sizes / out_sizes
    filterscale = np.maximum(scale, 1.0)
    reach = support * filterscale
    out = np.asarray(starts, dtype=np.float64)[:, None] + np.arange(count, dtype=np.float64)[None, :]
    centre = (out + 0.5) * scale
    # C's (int) cast truncates toward zero; the bounds are then clipped to the input.
    first = np.clip(np.trunc(centre - reach + 0.5), 0, in_sizes - 1)
    last = np.minimum(np.trunc(centre + reach + 0.5), in_sizes)
    taps = int(np.ceil(reach.max())) * 2 + 1
    x = first[..., None] + np.arange(taps, dtype=np.float64)
    weights = function((x - centre[..., None] + 0.5) / filterscale[..., None])
    inside = (out >= 0) & (out < out_sizes)
    weights = np.where((x < last[..., None]) & inside[..., None], weights, 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0.0)
    if quantize:
        one = float(1 << PRECISION_BITS)
        weights = np.where(weights < 0, np.trunc(-0.5 + weights * one), np.trunc(0.5 + weights * one)) / one
    return first.astype(np.int64), weights


def dense_weights(in_size: int, out_size: int, filter: str = "bicubic", *, start: int = 0,  # noqa: A002
                  count: int | None = None, offset: int = 0, total: int | None = None) -> np.ndarray:
    """One axis's weights as a dense ``[count, total]`` float64 matrix: the
    input spans ``offset .. offset + in_size`` of ``total`` pixels (a crop)
    and outputs ``start .. start + count`` of ``out_size`` are kept."""
    count = out_size if count is None else count
    total = in_size if total is None else total
    first, weights = axis_weights([in_size], [out_size], [start], count, filter)
    matrix = np.zeros((count, total + weights.shape[-1]))
    cols = offset + first[0][:, None] + np.arange(weights.shape[-1])
    np.add.at(matrix, (np.arange(count)[:, None], cols), weights[0])
    return matrix[:, :total]


def scatter_weights(first, weights, offsets, total: int, device: Any = None):
    """``[N, count, total]`` fp32 dense matrices on ``device`` from
    :func:`axis_weights`' taps, each placed at ``offsets[n]`` of ``total``
    input pixels (built on the device: only the taps are copied there)."""
    import torch

    n, count, taps = weights.shape
    cols = torch.as_tensor(np.asarray(offsets)[:, None, None] + first[..., None] + np.arange(taps), device=device)
    values = torch.as_tensor(weights, dtype=torch.float32, device=device)
    # Taps past the input carry weight 0; send them to a spare column that is cut off.
    cols = torch.where(values != 0, cols, total).clamp_(max=total)
    dense = torch.zeros(n, count, total + 1, dtype=torch.float32, device=device)
    dense.scatter_add_(2, cols, values)
    return dense[..., :total]


def round_uint8(x):
    """Pillow's output rounding of a pass: half up, clamped to 0..255 (kept float)."""
    return (x + 0.5).floor_().clamp_(0.0, 255.0)


def _pillow13_order(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    return out_h < in_h and in_h - out_h > 2 * (in_w - out_w)


def _horizontal_order(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    return False


#: Pass orders of Pillow versions, newest first: name -> vertical_first(in_h, in_w, out_h, out_w).
PASS_ORDERS = {"pillow13": _pillow13_order, "horizontal_first": _horizontal_order}
#: (in_h, in_w, out_h, out_w) sizes whose pass order tells the rules apart.
_PROBES = ((8, 6, 4, 9), (12, 10, 5, 8), (12, 10, 9, 6), (6, 8, 9, 12))
_order: list = []


def _two_pass(pixels: np.ndarray, out_h: int, out_w: int, filter: str, vertical: bool) -> np.ndarray:  # noqa: A002
    """Pillow's two passes in numpy (float64, exact), in the given order."""
    wy = dense_weights(pixels.shape[0], out_h, filter)
    wx = dense_weights(pixels.shape[1], out_w, filter)

    def rnd(v):
        return np.clip(np.floor(v + 0.5), 0, 255)

    if vertical:
        return rnd(np.einsum("xw,hwc->hxc", wx, rnd(np.einsum("yh,hwc->ywc", wy, pixels))))
    return rnd(np.einsum("yh,hwc->ywc", wy, rnd(np.einsum("xw,hwc->hxc", wx, pixels))))


def pillow_pass_order() -> str:
    """The name of the :data:`PASS_ORDERS` rule the installed Pillow follows,
    found once by resizing small noise images both ways; ``"unknown"``
    (horizontal first is then used) when none matches."""
    if not _order:
        from PIL import Image

        rng = np.random.default_rng(0)
        found = "unknown"
        for name, rule in PASS_ORDERS.items():
            ok = True
            for in_h, in_w, out_h, out_w in _PROBES:
                pixels = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
                pil = np.asarray(Image.fromarray(pixels).resize((out_w, out_h), Image.BICUBIC), dtype=np.float64)
                mine = _two_pass(pixels.astype(np.float64), out_h, out_w, "bicubic",
                                 rule(in_h, in_w, out_h, out_w))
                ok = ok and bool(np.array_equal(pil, mine))
            if ok:
                found = name
                break
        _order.append(found)
    return _order[0]


def vertical_first(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    """Whether the installed Pillow resizes ``in -> out`` vertical pass first."""
    return PASS_ORDERS.get(pillow_pass_order(), _horizontal_order)(in_h, in_w, out_h, out_w)


def resample_matrix(image, wy, wx, vertical: bool = False):
    """Regions of one image resized as Pillow does: ``image`` ``[C, H, W]``
    (float, uint8 values), ``wy [R, Sy, H]`` and ``wx [R, Sx, W]`` dense
    weights (:func:`scatter_weights`). Returns ``[R, C, Sy, Sx]`` float with
    uint8 values; each pass rounded, the vertical one first if ``vertical``."""
    c, h, w = image.shape
    r, sy, sx = wy.shape[0], wy.shape[1], wx.shape[1]
    if vertical:
        # Every column of every channel against all regions' rows at once.
        tmp = wy.reshape(r * sy, h) @ image.permute(1, 0, 2).reshape(h, c * w)  # [R*Sy, C*W]
        tmp = round_uint8(tmp).reshape(r, sy * c, w)
        out = round_uint8(tmp @ wx.transpose(1, 2))  # [R, Sy*C, Sx]
        return out.reshape(r, sy, c, sx).permute(0, 2, 1, 3)
    tmp = image.reshape(c * h, w) @ wx.reshape(r * sx, w).T  # [C*H, R*Sx]
    tmp = round_uint8(tmp).reshape(c, h, r, sx).permute(2, 1, 0, 3).reshape(r, h, c * sx)
    out = round_uint8(wy @ tmp)  # [R, Sy, C*Sx]
    return out.reshape(r, sy, c, sx).permute(0, 2, 1, 3)


def resample_interpolate(image, size: tuple[int, int], filter: str = "bicubic",  # noqa: A002
                         vertical: bool = False):
    """``image`` ``[N, C, h, w]`` uint8 resized to ``size`` (h, w) by torch's
    uint8 antialiased kernel (CPU, horizontal pass first); with ``vertical``
    the vertical pass runs first, as a call of its own. uint8 out."""
    import torch

    if tuple(image.shape[-2:]) == tuple(size):
        return image
    if vertical and image.shape[-1] != size[1]:
        image = torch.nn.functional.interpolate(image, size=(size[0], image.shape[-1]), mode=filter, antialias=True)
    return torch.nn.functional.interpolate(image, size=size, mode=filter, antialias=True)
