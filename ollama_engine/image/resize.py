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


def _pass(pixels: np.ndarray, out_size: int, kind: Filter) -> np.ndarray:
    """Resample axis 1 of (rows, columns, 3) uint8 to out_size columns. The sums are exact int32 ones, so
    their order is free: each tap is a gather of whole input columns (contiguous rows of the transposed
    image), twice as fast as gathering along the middle axis."""
    rows, in_size, channels = pixels.shape
    first, weights = _weights(in_size, out_size, kind)
    source = pixels.transpose(1, 0, 2).reshape(in_size, rows * channels).astype(np.int32)
    acc = np.full((out_size, rows * channels), 1 << (PRECISION_BITS - 1), dtype=np.int32)
    term = np.empty_like(acc)
    for x in range(weights.shape[1]):
        column = np.minimum(first + x, in_size - 1)  # past the edge the weight is 0
        np.multiply(source[column], weights[:, x, None], out=term)
        acc += term
    out = np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)
    return out.reshape(out_size, rows, channels).transpose(1, 0, 2)


def resize(pixels: np.ndarray, width: int, height: int, kind: Filter = Filter.BILINEAR) -> np.ndarray:
    """(height, width, 3) uint8 pixels resampled to the given size, as llama.cpp's resize_pillow."""
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise ValueError(f"resize target {width}x{height} is out of range (max {MAX_SIDE})")
    out = pixels
    if width != pixels.shape[1]:
        out = _pass(out, width, kind)
    if height != pixels.shape[0]:
        out = _pass(out.transpose(1, 0, 2), height, kind).transpose(1, 0, 2)
    return np.ascontiguousarray(out)
