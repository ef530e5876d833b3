"""Vision towers: what turns an image into embeddings in the text model's width, and their registry.

A tower is read from either file layout: llama.cpp's separate mmproj GGUF (general.architecture
"clip", hyper-parameters under clip.vision.*, the tower chosen by clip.projector_type) or Ollama's
single GGUF, where the v.* and mm.* tensors sit beside the text model and the hyper-parameters under
<arch>.vision.* (the tower chosen by the text architecture). Both keep keys as <arch>.vision.<key>, so
`config.get_uint("vision.block_count")` reads either. Tensors are named as llama.cpp's mmproj names them;
a tower lists how Ollama's names differ (`OLLAMA_NAMES`).

A tower's graph is separate from the text model's: it has its own backend and scheduler, and its
graph (fixed-size towers have one shape) is built once and computed again for each new image.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ollama_engine.fs import Config, GGUFFile
from ollama_engine.image import DecodedImage, PixelSpec
from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, DeviceID, DType, GPULayers, ShapeError, Tensor, TensorGroups

from .base import ModelError, require_uint
from .vit import VisionWeights

MMPROJ_ARCH = "clip"


def is_mmproj(config: Config) -> bool:
    return config.architecture() == MMPROJ_ARCH


def projector_type(config: Config) -> str:
    """Which tower a file holds: clip.projector_type in an mmproj, else the text architecture; '' if none."""
    if is_mmproj(config):
        if not config.get_bool("has_vision_encoder", True):
            return ""
        return config.get_string("projector_type") or config.get_string("vision.projector_type")
    return config.architecture() if "vision.block_count" in config else ""


class VisionModel:
    """A vision tower and its projector: image -> (tokens, text n_embd) embeddings.

    Subclasses set `projector` (registry key), `OLLAMA_NAMES`, `DEFAULT_PIXELS`, and implement `pixels`
    (the image as the tower's input planes) and `build` (the graph from those planes).
    """

    projector: ClassVar[str] = ""
    tensor_groups: ClassVar[TensorGroups] = TensorGroups(outputs=frozenset({"v", "mm"}))
    """The tower is placed with the text model's output layer."""
    OLLAMA_NAMES: ClassVar[dict[str, str]] = {}
    DEFAULT_PIXELS: ClassVar[PixelSpec] = PixelSpec()
    non_causal: ClassVar[bool] = False
    """True when the text model lets an image's tokens attend to each other both ways (Gemma 3)."""
    image_begin: ClassVar[str] = ""
    image_end: ClassVar[str] = ""
    """Text around an image's embeddings, tokenized with special tokens (llama.cpp's mtmd img_beg/img_end)."""

    def __init__(self, backend: Backend):
        if backend.model is None:
            raise ValueError("a vision tower needs a backend built from a GGUF file")
        self.backend = backend
        self.config = backend.model.config
        self.layout = "mmproj" if is_mmproj(self.config) else "ollama"
        self.weights = VisionWeights(backend, self.OLLAMA_NAMES if self.layout == "ollama" else {})
        self.n_embd = require_uint(self.config, "vision.embedding_length")
        self.n_head = require_uint(self.config, "vision.attention.head_count")
        self.n_layer = require_uint(self.config, "vision.block_count")
        self.image_size = require_uint(self.config, "vision.image_size")
        self.patch_size = require_uint(self.config, "vision.patch_size")
        if not self.n_head or self.n_embd % self.n_head or not self.patch_size or self.image_size % self.patch_size:
            raise ModelError(f"{backend.model.path}: vision tower of width {self.n_embd}, {self.n_head} heads, "
                             f"image {self.image_size} in patches of {self.patch_size} does not divide")
        self.eps = self.config.get_float("vision.attention.layer_norm_epsilon", 1e-6)
        mean = self.config.get_floats("vision.image_mean") or list(self.DEFAULT_PIXELS.mean)
        std = self.config.get_floats("vision.image_std") or list(self.DEFAULT_PIXELS.std)
        if len(mean) < 3 or len(std) < 3 or not all(s > 0 for s in std[:3]):
            raise ModelError(f"{backend.model.path}: vision image_mean/image_std need 3 values, std positive")
        self.pixel_spec = PixelSpec(tuple(mean[:3]), tuple(std[:3]))  # type: ignore[arg-type]
        self._graph: tuple[Context, Tensor, Tensor] | None = None
        self.compute_backend = backend
        """Whose scheduler computes the image graphs: the text model's where the runner shares it (compute_with)."""

    # ------------------------------------------------------------ what subclasses provide

    def pixels(self, image: DecodedImage) -> np.ndarray:
        """The tower's input: (3, height, width) float32 planes."""
        raise NotImplementedError

    def build(self, ctx: Context, pixels: Tensor) -> Tensor:
        """The embeddings (text n_embd, tokens) of pixels (width, height, 3)."""
        raise NotImplementedError

    @property
    def text_embd(self) -> int:
        """The width of the embeddings the projector writes (the text model's n_embd)."""
        raise NotImplementedError

    def tokens(self, image: DecodedImage) -> int:
        """How many embeddings (text positions) the image becomes."""
        raise NotImplementedError

    # ------------------------------------------------------------ encoding

    def encode(self, image: DecodedImage) -> np.ndarray:
        """(tokens, text n_embd) float32 embeddings of the image."""
        planes = self.pixels(image)
        ctx, inp, out = self._graph_for(planes.shape)
        ctx.set_input(inp, planes)
        result = ctx.compute(out, read=out)
        assert result is not None
        return result

    def encode_chunks(self, image: DecodedImage) -> list[np.ndarray]:
        """The image's embeddings as llama.cpp's mtmd chunks them, each chunk decoded in batches of its own:
        one for most towers; a tiling tower (Llama 4) overrides it with one per tile and the thumbnail."""
        return [self.encode(image)]

    def reserve(self) -> None:
        """Size (or allocate, per the backend) the compute buffers of the largest image graph."""
        ctx, _, out = self._graph_for((3, self.image_size, self.image_size))
        ctx.reserve(out)

    def _graph_for(self, shape: tuple[int, ...]) -> tuple[Context, Tensor, Tensor]:
        if self._graph is not None and self._graph[1].shape == tuple(reversed(shape)):
            return self._graph
        if self._graph is not None:
            self._graph[0].close()
            self._graph = None
        ctx = self.compute_backend.new_context(self.backend.max_graph_nodes)
        inp = ctx.input().zeros(DType.F32, *reversed(shape)).set_name("inp_raw")
        out = self.build(ctx, inp)
        self._graph = (ctx, inp, out)
        return self._graph

    def compute_with(self, backend: Backend) -> bool:
        """Compute the image graphs on `backend`'s scheduler (the text model's), so that one compute buffer per
        device serves the text and the image graph, the larger of the two, as in Ollama's engine (llama.cpp's mtmd
        keeps a buffer of its own). Not where its graphs could outgrow that scheduler's; returns whether it does."""
        if backend.max_graph_nodes < self.backend.max_graph_nodes:
            return False
        self.close_graph()
        self.compute_backend = backend
        return True

    def close_graph(self) -> None:
        if self._graph is not None:
            self._graph[0].close()
            self._graph = None

    def close(self) -> None:
        self.close_graph()
        self.backend.close()


VISION_REGISTRY: dict[str, type[VisionModel]] = {}


def register_vision(cls: type[VisionModel]) -> type[VisionModel]:
    """Class decorator: the tower serves its `projector` (clip.projector_type, or the text architecture)."""
    if cls.projector in VISION_REGISTRY:
        raise ValueError(f"vision projector {cls.projector} is registered twice")
    VISION_REGISTRY[cls.projector] = cls
    return cls


def vision_tensor(name: str) -> bool:
    return name.startswith(("v.", "mm."))


def load_vision(
    path: str | os.PathLike[str], *, num_threads: int | None = None, flash_attention: bool = False,
    allocate: bool = True, file: GGUFFile | None = None, device: DeviceID | None = None,
) -> VisionModel | None:
    """The vision tower in the GGUF at `path` (an mmproj, or a text model holding one), with its weights
    allocated but not read (call `tower.backend.load()`); None when the file has none. `device`: the GPU that
    holds the text model's output layer, where Ollama's engine put the tower (None: the CPU)."""
    file = file or GGUFFile.open(path)
    kind = projector_type(file.config)
    if not kind:
        return None
    if kind not in VISION_REGISTRY:
        raise ModelError(f"{path}: unsupported vision projector {kind!r} "
                         f"(supported: {', '.join(sorted(VISION_REGISTRY))})")
    unused: Callable[[str], bool] = (lambda name: False) if is_mmproj(file.config) else (
        lambda name: not vision_tensor(name))
    # every tower tensor is in the output layer's group: the output layer's index is the file's block_count
    placed = [GPULayers(device, [file.config.get_uint("block_count", 0)])] if device is not None else []
    backend = Backend(file, placed, allocate=allocate, num_threads=num_threads, flash_attention=flash_attention,
                      repack_weights=False, unused_tensors=unused, tensor_groups=VISION_REGISTRY[kind].tensor_groups)
    try:
        return VISION_REGISTRY[kind](backend)
    except BaseException:
        backend.close()
        raise


# ------------------------------------------------------------ the text model's side


def embedded_rows(batch: Batch) -> list[int]:
    """The batch rows whose input is an embedding."""
    return [first + i for first, rows in batch.embeddings for i in range(len(rows))]


def place_embeddings(inputs: Context, batch: Batch, h: Tensor) -> Tensor:
    """h (n_embd, rows), the token embeddings, with the batch's embedded rows replaced by their embeddings.

    As h * keep + given (keep 0 on those rows, 1 elsewhere; given the embeddings there, 0 elsewhere): exact,
    since x * 1 + 0 == x and x * 0 + e == e for finite x, and the graph's shape depends only on the batch's.
    """
    if not batch.embeddings:
        return h
    n_embd = h.ne[0]
    keep = np.ones((len(batch), 1), dtype=np.float32)
    given = np.zeros((len(batch), n_embd), dtype=np.float32)
    for first, rows in batch.embeddings:
        if rows.shape[1] != n_embd:
            raise ShapeError(f"embeddings of width {rows.shape[1]} for a model of width {n_embd}")
        keep[first : first + len(rows)] = 0.0
        given[first : first + len(rows)] = rows
    keep_t = inputs.from_numpy(keep).set_name("embd_keep")
    return h.mul(keep_t).add(inputs.from_numpy(given).set_name("embd_given"))


from . import gemma3_vision, llama4_vision, mistral3_vision, qwen25vl_vision  # noqa: E402, F401 - the towers (one line)
