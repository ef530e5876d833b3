"""From decoded pixels to the float planes a tower reads, as llama.cpp's mtmd prepares them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .resize import Filter, resize


@dataclass(frozen=True)
class PixelSpec:
    """A tower's normalisation: per-channel mean and std applied to values scaled to 0..1."""

    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


def fit_square(pixels: np.ndarray, size: int, kind: Filter = Filter.BILINEAR,
               pad: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """The image fitted into size x size (fit_box): llama.cpp's fixed-size preprocessing (Gemma 3's). Ollama's
    Go engine stretched the image to the square instead; we follow llama.cpp."""
    return fit_box(pixels, size, size, kind, pad)


def fit_box(pixels: np.ndarray, width: int, height: int, kind: Filter = Filter.BILINEAR,
            pad: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """The image scaled to fit width x height keeping its aspect ratio (sides rounded up), centred on `pad`:
    img_tool::resize with PAD_CEIL, in float32 as the C++ computes it."""
    in_height, in_width = pixels.shape[:2]
    if (in_width, in_height) == (width, height):
        return pixels.copy()
    scale = min(np.float32(width) / np.float32(in_width), np.float32(height) / np.float32(in_height))
    new_width = min(int(np.ceil(np.float32(in_width) * scale)), width)
    new_height = min(int(np.ceil(np.float32(in_height) * scale)), height)
    scaled = pixels if (new_width, new_height) == (in_width, in_height) else resize(pixels, new_width, new_height, kind)
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[:] = np.asarray(pad, dtype=np.uint8)
    x, y = (width - new_width) // 2, (height - new_height) // 2
    out[y : y + new_height, x : x + new_width] = scaled
    return out


def size_preserved_ratio(width: int, height: int, align: int, min_pixels: int = 0,
                         max_pixels: int = 0) -> tuple[int, int]:
    """img_tool::calc_size_preserved_ratio (transformers' smart_resize): each side rounded to a multiple of
    `align`, then scaled down to at most max_pixels or up to at least min_pixels (0: no bound), keeping the
    aspect ratio; float32 arithmetic and C's round-half-away, as llama.cpp's."""
    f = np.float32(align)

    def rounded(x: np.float32) -> int:
        return int(math.floor(float(x / f) + 0.5)) * align  # x >= 0: std::round

    def floored(x: np.float32) -> int:
        return int(math.floor(float(x / f))) * align

    def ceiled(x: np.float32) -> int:
        return int(math.ceil(float(x / f))) * align

    w, h = np.float32(width), np.float32(height)
    w_bar, h_bar = max(align, rounded(w)), max(align, rounded(h))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(h * w / np.float32(max_pixels))
        h_bar, w_bar = max(align, floored(h / beta)), max(align, floored(w / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(np.float32(min_pixels) / (h * w))
        h_bar, w_bar = ceiled(h * beta), ceiled(w * beta)
    return w_bar, h_bar


def to_planar(pixels: np.ndarray, spec: PixelSpec) -> np.ndarray:
    """(3, height, width) float32: each channel u8 / 255 then (v - mean) / std in float32 (clip_image_f32's
    from_u8 and normalize), channel planes as llama.cpp's inp_raw lays them out."""
    values = pixels.astype(np.float32) / np.float32(255.0)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    values = (values - mean) / std
    return np.ascontiguousarray(values.transpose(2, 0, 1))
