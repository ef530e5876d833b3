"""From decoded pixels to the float planes a tower reads, as llama.cpp's mtmd prepares them."""

from __future__ import annotations

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
    """The image scaled to fit size x size keeping its aspect ratio (sides rounded up), centred on `pad`:
    img_tool::resize with PAD_CEIL, llama.cpp's fixed-size preprocessing (Gemma 3's). Ollama's Go engine
    stretched the image to the square instead; we follow llama.cpp."""
    height, width = pixels.shape[:2]
    if (width, height) == (size, size):
        return pixels.copy()
    target = np.float32(size)
    scale = min(target / np.float32(width), target / np.float32(height))  # float, as the C++ computes it
    new_width = min(int(np.ceil(np.float32(width) * scale)), size)
    new_height = min(int(np.ceil(np.float32(height) * scale)), size)
    scaled = pixels if (new_width, new_height) == (width, height) else resize(pixels, new_width, new_height, kind)
    out = np.empty((size, size, 3), dtype=np.uint8)
    out[:] = np.asarray(pad, dtype=np.uint8)
    x, y = (size - new_width) // 2, (size - new_height) // 2
    out[y : y + new_height, x : x + new_width] = scaled
    return out


def to_planar(pixels: np.ndarray, spec: PixelSpec) -> np.ndarray:
    """(3, height, width) float32: each channel u8 / 255 then (v - mean) / std in float32 (clip_image_f32's
    from_u8 and normalize), channel planes as llama.cpp's inp_raw lays them out."""
    values = pixels.astype(np.float32) / np.float32(255.0)
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    values = (values - mean) / std
    return np.ascontiguousarray(values.transpose(2, 0, 1))
