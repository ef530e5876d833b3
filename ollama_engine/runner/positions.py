"""Rows' multimodal RoPE positions (models with Model.position_components 4: Qwen2-VL, Qwen2.5-VL).

Such a model rotates each row by 4 position components, time, height, width and a spare one. A text row at
text position p has p, p, p, 0. An image laid out as a grid of rows x cols embeddings starting at text
position p0 has, for its i-th embedding, p0, p0 + i // cols, p0 + i % cols, 0, and the text after it starts
at p0 + max(rows, cols): llama.cpp's mtmd (mtmd_image_tokens_get_decoder_pos, MTMD_POS_TYPE_MROPE, and
mtmd_image_tokens_get_n_pos).

The KV cache keeps its own positions, one per input (what its causal mask orders): an image's embeddings
are in raster order, so that mask is llama.cpp's for M-RoPE (a row sees the image rows above it and those
left of it on its own row, and every later row sees the whole image). Only the rotation uses the text
positions, so the runner computes them here from the sequence's inputs: each image view's first input
carries its rows' offsets (Input.positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .inputs import Input, ViewPositions


def grid_views(rows: int, cols: int, view_starts: Sequence[int], view_lengths: Sequence[int]) -> list[ViewPositions]:
    """The positions of an image of rows x cols embeddings (raster order) cut into views (first row, length)."""
    i = np.arange(rows * cols, dtype=np.int32)
    offsets = np.stack([np.zeros_like(i), i // cols, i % cols, np.zeros_like(i)], axis=1)
    last = len(view_starts) - 1
    return [ViewPositions(offsets[first : first + length], max(rows, cols) if k == last else 0)
            for k, (first, length) in enumerate(zip(view_starts, view_lengths, strict=True))]


def text_position(*histories: Sequence[Input]) -> int:
    """The text position of the input after these ones (a sequence's inputs, in order, from its start)."""
    behind = 0
    count = 0
    for history in histories:
        count += len(history)
        for inp in history:
            if inp.positions is not None:
                behind += len(inp.positions.offsets) - inp.positions.advance
    return count - behind


def rope_positions(start: int, inputs: Sequence[Input]) -> np.ndarray:
    """(4, len(inputs)) int32 position components of inputs that follow text position `start`."""
    out = np.empty((4, len(inputs)), dtype=np.int32)
    p = start
    i = 0
    while i < len(inputs):
        view = inputs[i].positions
        if view is None:
            out[:, i] = (p, p, p, 0)
            p += 1
            i += 1
            continue
        n = len(view.offsets)
        if i + n > len(inputs):
            raise ValueError(f"an image view of {n} rows cut at {len(inputs) - i}: its rows go in one batch")
        out[:, i : i + n] = (view.offsets + np.array([p, p, p, 0], dtype=np.int32)).T
        p += view.advance
        i += n
    return out
