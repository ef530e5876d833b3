"""A prompt with images (Ollama's runner wire): `[img-N]` tags in the text, the image with id N among the
request's ImageData. Each image is decoded, encoded by the vision tower once and cached by its hash (a second
question about the same image does not encode it again), and becomes runs of inputs, each decoded in a batch
of its own: the first input of a run carries its embeddings, the others are placeholders. A tower gives one
chunk per image (Gemma 3) or several (Llama 4: a chunk per tile and the thumbnail, as mtmd's chunks), and a
chunk longer than a batch is cut into views of at most batch_size rows, decoded one batch after the other
as llama.cpp's mtmd_helper_decode_image_chunk decodes an image chunk in n_batch pieces. The tower's
begin/end text goes around the image, as llama.cpp's mtmd puts it (Gemma 3: <start_of_image> ...
<end_of_image>).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ollama_engine.image import ImageError, decode_image, image_hash
from ollama_engine.models.vision import VisionModel
from ollama_engine.tokenizer import Tokenizer

from .inputs import Input
from .positions import grid_views

IMAGE_TAG = re.compile(r"\[img-(\d+)\]")


@dataclass(frozen=True)
class ImageData:
    """llm.ImageData: an image's encoded bytes and the id its [img-N] tag names."""

    id: int
    data: bytes


@dataclass
class ImageStats:
    """A prompt's images: how many there were, how many the tower encoded (not cached), in what time."""

    count: int = 0
    encoded: int = 0
    encode_seconds: float = 0.0


class ImageEncoder:
    """The vision tower behind a cache of the last `capacity` images' embeddings, by sha256 of their bytes."""

    def __init__(self, tower: VisionModel, capacity: int = 16):
        self.tower = tower
        self.capacity = capacity
        self._cache: OrderedDict[str, list[np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self.encoded = 0  # images run through the tower
        self.encode_seconds = 0.0

    def embeddings(self, data: bytes, stats: ImageStats | None = None) -> tuple[list[np.ndarray], str]:
        """The image's chunks of (tokens, n_embd) embeddings, and its hash; ImageError for a bad image."""
        stats = stats if stats is not None else ImageStats()
        stats.count += 1
        digest = image_hash(data)
        with self._lock:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                return self._cache[digest], digest
            image = decode_image(data)
            started = time.perf_counter()
            out = self.tower.encode_chunks(image)
            seconds = time.perf_counter() - started
            self.encode_seconds += seconds
            self.encoded += 1
            stats.encoded += 1
            stats.encode_seconds += seconds
            self._cache[digest] = out
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return out, digest


def prompt_inputs(prompt: str, images: Sequence[ImageData], tokenizer: Tokenizer,
                  encoder: ImageEncoder | None, stats: ImageStats | None = None,
                  batch_size: int | None = None) -> list[Input]:
    """The prompt's inputs: text tokens (special ones only at the start), each tagged image's runs, none longer
    than batch_size (when given)."""
    if encoder is None:
        if images:
            raise ImageError("this model does not support images: it has no vision tower")
        return [Input(token=t) for t in tokenizer.encode(prompt, add_special=True)]
    parts = IMAGE_TAG.split(prompt)  # text, id, text, id, ..., text
    by_id = {image.id: image for image in images}
    tower = encoder.tower
    inputs: list[Input] = []
    for i in range(0, len(parts), 2):
        inputs += [Input(token=t) for t in tokenizer.encode(parts[i], add_special=i == 0)]
        if i + 1 == len(parts):
            break
        image = by_id.get(int(parts[i + 1]))
        if image is None:
            raise ImageError(f"invalid image index: {parts[i + 1]}")
        chunks, digest = encoder.embeddings(image.data, stats)
        inputs += [Input(token=t) for t in tokenizer.encode(tower.image_begin, add_special=False)]
        for chunk in chunks:
            inputs += image_run(chunk, int(digest[:16], 16), batch_size)
        inputs += [Input(token=t) for t in tokenizer.encode(tower.image_end, add_special=False)]
    return inputs


def image_run(embeddings: np.ndarray, digest: int, batch_size: int | None = None) -> list[Input]:
    """One chunk's inputs: views of at most batch_size rows, each a same-batch group whose first input carries
    its rows (numpy views: nothing is copied). A chunk shaped (rows, cols, n_embd) is a grid, whose views
    also carry their rows' multimodal RoPE positions (runner/positions.py)."""
    grid = embeddings.shape[:2] if embeddings.ndim == 3 else None
    embeddings = embeddings.reshape(-1, embeddings.shape[-1])
    step = batch_size if batch_size and batch_size > 0 else max(len(embeddings), 1)
    starts = list(range(0, len(embeddings), step))
    views = [embeddings[first : first + step] for first in starts]
    placed = grid_views(*grid, starts, [len(v) for v in views]) if grid is not None else [None] * len(views)
    run: list[Input] = []
    for view, positions in zip(views, placed, strict=True):
        run.append(Input(multimodal=view, multimodal_hash=digest, same_batch=len(view) - 1, positions=positions))
        run += [Input() for _ in range(len(view) - 1)]
    return run


def batch_embeddings(inputs: Sequence[Input]) -> tuple[tuple[int, np.ndarray], ...]:
    """Batch.embeddings for a batch of these inputs: each image's first row and its embeddings."""
    return tuple((row, inp.multimodal) for row, inp in enumerate(inputs) if inp.multimodal is not None)
