"""llama.cpp's Pillow-compatible resampling (mtmd-image.cpp, img_tool::resize_pillow), in numpy.

Separable: a horizontal pass then a vertical one, each output pixel a weighted sum of the input pixels
under the filter, weights normalised in double precision then stored as 22-bit fixed point and summed in
int32 with a rounding bias. Written out here rather than calling Pillow so that the arithmetic is the one
llama.cpp runs (and is tested against it), whatever Pillow version is installed.
"""

from __future__ import annotations

import enum
import math

import numpy as np

PRECISION_BITS = 32 - 8 - 2
MAX_SIDE = 65536  # llama.cpp refuses larger targets


class Filter(enum.Enum):
    BILINEAR = 1.0  # the filter's support radius
    BICUBIC = 2.0
    LANCZOS = 3.0


def _filter(kind: Filter, x: np.ndarray) -> np.ndarray:
    if kind is Filter.LANCZOS:
        def sinc(v: np.ndarray) -> np.ndarray:
            pv = v * 3.141592653589793
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(v == 0.0, 1.0, np.sin(pv) / pv)
        return np.where((x >= -3.0) & (x < 3.0), sinc(x) * sinc(x / 3.0), 0.0)
    x = np.abs(x)
    if kind is Filter.BILINEAR:
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _weights(in_size: int, out_size: int, kind: Filter) -> tuple[np.ndarray, np.ndarray]:
    """For each output pixel, its first input pixel and the fixed-point weights of ksize inputs from there
    (zero past the image's edge): precompute_weights of mtmd-image.cpp."""
    scale = filterscale = in_size / out_size
    filterscale = max(filterscale, 1.0)
    support = kind.value * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    ss = 1.0 / filterscale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
    taps = np.arange(ksize)
    weights = _filter(kind, (taps[None, :] + xmin[:, None] - center[:, None] + 0.5) * ss)
    weights = np.where(taps[None, :] < xmax[:, None], weights, 0.0)
    total = np.zeros(out_size)
    for x in range(ksize):  # in order, as the C loop sums (numpy's pairwise sum could round differently)
        total += weights[:, x]
    weights = np.divide(weights, total[:, None], out=weights, where=total[:, None] != 0.0)
    fixed = weights * math.ldexp(1.0, PRECISION_BITS) + np.where(weights < 0, -0.5, 0.5)
    return xmin, np.trunc(fixed).astype(np.int32)


def _rows(source: np.ndarray, out_size: int, kind: Filter) -> np.ndarray:
    """Resample axis 0 of (in_size, n) uint8 to (out_size, n). The sums are exact int32 ones, so their order is
    free: each tap gathers whole rows (contiguous), much faster than gathering along a middle axis."""
    in_size = source.shape[0]
    first, weights = _weights(in_size, out_size, kind)
    acc = np.full((out_size, source.shape[1]), 1 << (PRECISION_BITS - 1), dtype=np.int32)
    term = np.empty_like(acc)
    for x in range(weights.shape[1]):
        row = np.minimum(first + x, in_size - 1)  # past the edge the weight is 0
        np.multiply(source[row], weights[:, x, None], out=term)
        acc += term
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)


def resize(pixels: np.ndarray, width: int, height: int, kind: Filter = Filter.BILINEAR) -> np.ndarray:
    """(height, width, 3) uint8 pixels resampled to the given size, as llama.cpp's resize_pillow: the horizontal
    pass first (on the transposed image, columns as rows), then the vertical one."""
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise ValueError(f"resize target {width}x{height} is out of range (max {MAX_SIDE})")
    rows, columns, channels = pixels.shape
    out = pixels
    if width != columns:
        out = _rows(pixels.transpose(1, 0, 2).reshape(columns, rows * channels), width, kind)
        out = out.reshape(width, rows, channels).transpose(1, 0, 2)
    if height != rows:
        out = _rows(np.ascontiguousarray(out).reshape(rows, -1), height, kind).reshape(height, -1, channels)
    return np.ascontiguousarray(out)
