"""Llama 4's tiles, as llama.cpp's mtmd cuts an image for it (mtmd-image.cpp, the llava-uhd preprocessor
with the pinpoints clip.cpp sets for PROJECTOR_TYPE_LLAMA4).

An image no larger than one tile (image_size a side) becomes the thumbnail alone: the image stretched to
the square (bicubic, no padding). A larger one also gets tiles: the grid of up to 3 x 3 tiles whose area
keeps most of the image's resolution and wastes least (select_best_resolution), the image fitted into it
keeping its aspect ratio (bicubic, black padding, centred) and cut row by row. mtmd puts the tiles first
and the thumbnail last, with no text between them (Ollama's Go engine put tile separators and <|image|>
there; the pinned llama.cpp does not, and we follow llama.cpp).
"""

from __future__ import annotations

import numpy as np

from .preprocess import fit_box
from .resize import Filter, resize

MAX_TILES_A_SIDE = 3  # clip.cpp: set_llava_uhd_res_candidates(model, 3)


def candidates(size: int) -> list[tuple[int, int]]:
    """The grids' (width, height) in pixels, in clip.cpp's order, the single tile left out."""
    return [(x * size, y * size) for x in range(1, MAX_TILES_A_SIDE + 1) for y in range(1, MAX_TILES_A_SIDE + 1)
            if (x, y) != (1, 1)]


def best_resolution(width: int, height: int, size: int) -> tuple[int, int]:
    """select_best_resolution: the candidate where the image, scaled to fit, keeps most of its pixels (at
    most its own), then the one wasting least; float32 scales truncated as the C++ computes them."""
    best, most, least_waste = (0, 0), 0, 2**31 - 1  # INT_MAX
    for cw, ch in candidates(size):
        scale = min(np.float32(cw) / np.float32(width), np.float32(ch) / np.float32(height))
        fitted = int(np.float32(width) * scale) * int(np.float32(height) * scale)
        effective = min(fitted, width * height)
        waste = cw * ch - effective
        if effective > most or (effective == most and waste < least_waste):
            best, most, least_waste = (cw, ch), effective, waste
    return best


def tile_count(width: int, height: int, size: int) -> int:
    """How many chunks tiles() makes of a width x height image, without resizing it."""
    if width <= size and height <= size:
        return 1
    grid_width, grid_height = best_resolution(width, height, size)
    return (grid_width // size) * (grid_height // size) + 1


def tiles(pixels: np.ndarray, size: int) -> list[np.ndarray]:
    """(height, width, 3) uint8 -> the tiles row by row, then the thumbnail: each (size, size, 3) uint8."""
    height, width = pixels.shape[:2]
    thumbnail = pixels.copy() if (width, height) == (size, size) else resize(pixels, size, size, Filter.BICUBIC)
    if width <= size and height <= size:
        return [thumbnail]
    grid_width, grid_height = best_resolution(width, height, size)
    refined = fit_box(pixels, grid_width, grid_height, Filter.BICUBIC)
    out = [np.ascontiguousarray(refined[y : y + size, x : x + size])
           for y in range(0, grid_height, size) for x in range(0, grid_width, size)]
    return [*out, thumbnail]
