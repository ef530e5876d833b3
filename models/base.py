"""What every architecture builds on: weights declared by GGUF name, hyper-parameters, the registry.

A model lists its weights as dataclass fields, each tied to a GGUF tensor name:

    @dataclass
    class Layer:
        attn_norm: Tensor = weight("attn_norm.weight")
        q_bias: Tensor | None = weight("attn_q.bias", optional=True)

and `bind(Layer, backend, "blk.3.")` fills them from the backend. A missing required tensor is an
error that names it, so a file that does not fit its architecture fails at load, not mid-graph.
Graph tensors are named as llama.cpp names them (the cb(cur, "name", il) calls in its
src/models/<arch>.cpp), so that `ollama-engine diff` can compare them with llama.cpp's, layer by layer:
`x.set_name(f"attn_norm-{i}")` in layer i, a bare name after the last layer. Name a tensor only where
it means what llama.cpp's tensor of that name means (same values, same logical shape); where llama.cpp
names several tensors alike, its last one counts. The usual ones, in order:

    embd (token embeddings)  attn_norm-i  Qcur-i Kcur-i (after RoPE)  Vcur-i
    kqv_out-i (attention, before its output projection)  attn_out-i  ffn_inp-i (residual added)
    ffn_norm-i  ffn_gate-i ffn_up-i ffn_swiglu-i  ffn_out-i (before the residual)  l_out-i (layer output)
    result_norm  result_output (logits)

Naming costs nothing per token: a graph is built once per batch shape and reused.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Cache
from ollama_engine.ml import Backend, Context, DType, Tensor, TensorGroups
from ollama_engine.tokenizer import Tokenizer

from .graphs import Graphs

T = TypeVar("T")


class ModelError(ValueError):
    """A GGUF file this engine cannot run: unknown architecture, missing tensor or hyper-parameter."""


def weight(name: str, *, optional: bool = False, matrix: bool = False) -> Any:
    """A dataclass field holding the tensor `name` (relative to the prefix given to bind()). matrix: only ever
    multiplied, so one that ggml sees as a vector (one row: a classifier's single output) may have any type."""
    return dataclasses.field(metadata={"gguf": name, "optional": optional, "matrix": matrix})


def bind(cls: type[T], backend: Backend, prefix: str = "") -> T:
    """An instance of the dataclass `cls` whose fields are the backend's tensors of those names."""
    values: dict[str, Tensor | None] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = prefix + field.metadata["gguf"]
        tensor = backend.get(name)
        source = backend.model.path if backend.model is not None else "the backend"
        if tensor is None and not field.metadata["optional"]:
            raise ModelError(f"{source}: model is missing required tensor {name}")
        if tensor is not None and len(tensor.shape) == 1 and tensor.dtype != DType.F32 and not field.metadata["matrix"]:
            # norms, biases and frequency factors enter element-wise ops, which ggml aborts on for other types
            raise ModelError(f"{source}: tensor {name} is a vector of type {tensor.dtype.name}; vectors must be F32")
        values[field.name] = tensor
    return cls(**values)


def require_uint(config: Config, key: str) -> int:
    """A hyper-parameter without which the model cannot be built."""
    if key not in config:
        raise ModelError(f"model is missing required hyper-parameter {config.full_key(key)}")
    value = config.get_uint(key, -1)
    if value < 0:
        raise ModelError(f"hyper-parameter {config.full_key(key)} must be a non-negative integer, got "
                         f"{config.value(key)!r}")
    return value


class Model:
    """A text model: its backend, tokenizer and cache, and the graph of one forward pass.

    `forward` returns the logits (vocab, len(batch.outputs)) of the rows batch.outputs lists, or None
    for a batch that asks for none (its keys and values are still stored). The caller starts the
    cache's forward pass first (see ollama_engine.models.forward).
    """

    cache: Cache | None
    reuse_graphs = False
    """True when every graph input forward() creates, apart from the cache's, is a batch array named
    after it (see graphs.BATCH_INPUTS), or one of batch_inputs(): then a built graph can serve later batches
    of the same shape. graphs.stale_inputs() finds an input left out (tests/test_graph_inputs.py runs it on
    every architecture's tiny preset)."""
    position_components = 1
    """How many position components each row has (llama.cpp's n_pos_per_embd): 4 for multimodal RoPE, whose
    image rows the runner gives their own (Batch.rope_positions)."""
    rows_alone = True
    """Compute each sequence's rows of a batch with the kernels its rows alone would get, where a model's
    float matmuls would otherwise round them by the batch's size (models/alone.py): batched equals solo.
    llama.cpp's batches do not, so a test replaying llama.cpp's multi-sequence batches turns it off."""

    tensor_groups = TensorGroups(
        outputs=frozenset({"output", "output_norm", "cls", "v", "mm", "s"}),
        per_layer=frozenset({"rope_freqs", "rope_factors_long", "rope_factors_short"}),
        tied=(("token_embd.weight", "output.weight"),),
    )
    """The tensors that belong to no repeating layer, by name parts, for the Backend to place: llama.cpp's
    output head (its classifier too) and per-layer RoPE factors, a vision tower stored beside the text model;
    a file without output.weight uses token_embd's. An architecture with tensors of its own adds them
    (TensorGroups.extended); any other tensor of no layer is an input weight."""

    @classmethod
    def unused_tensors(cls, config: Config) -> Callable[[str], bool]:
        """Which of the file's tensors this model never reads, so that they are neither allocated nor
        counted: by default the vision tower and projector Ollama stores beside a text model (gemma3,
        mistral3, llama4 files), which the text model does not run."""
        return lambda name: name.startswith(("v.", "mm."))

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        if backend.model is None:
            raise ValueError("a model needs a backend built from a GGUF file")
        self.backend = backend
        self.config = backend.model.config
        self.tokenizer = tokenizer
        if tokenizer is not None:  # llama.cpp's rule: one embedding row and one logit per token of the vocabulary
            for name in ("token_embd.weight", "output.weight"):
                tensor = backend.get(name)
                if tensor is not None and len(tensor.shape) > 1 and tensor.shape[1] != tokenizer.vocab_size:
                    raise ModelError(f"{backend.model.path}: {name} has {tensor.shape[1]} rows for a vocabulary of "
                                     f"{tokenizer.vocab_size} tokens")
        self.graphs = Graphs(self)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        raise NotImplementedError

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        """Graph inputs, by name, that forward() computes from the batch beyond its own arrays (mistral3's
        per-position query scale): a reused graph gets them written again for each batch."""
        return {}

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        """The stored `key` of `layer` moved by `delta` positions (I32, one per cell): RoPE by the delta."""
        raise NotImplementedError

    def close(self) -> None:
        self.graphs.close()
        if self.cache is not None:
            self.cache.close()
        self.backend.close()


ModelFactory = Callable[[Backend, Tokenizer | None], Model]
REGISTRY: dict[str, ModelFactory] = {}


def register(*names: str) -> Callable[[type[Model]], type[Model]]:
    """Class decorator: the architecture names (general.architecture, or `<arch>_embed`) it serves."""

    def add(cls: type[Model]) -> type[Model]:
        for name in names:
            if name in REGISTRY:
                raise ValueError(f"architecture {name} is registered twice")
            REGISTRY[name] = cls
        return cls

    return add


def registry_name(config: Config) -> str:
    """general.architecture, with `_embed` for a pooling (embedding) model."""
    arch = config.architecture()
    if not arch:
        raise ModelError("the file has no general.architecture")
    return f"{arch}_embed" if config.get_uint("pooling_type", 0) != 0 else arch


_PACKAGE = __name__.rpartition(".")[0]


def _modules() -> list[str]:
    return [module.name for module in pkgutil.iter_modules(sys.modules[_PACKAGE].__path__)]


def architectures() -> dict[str, ModelFactory]:
    """Every architecture, by the names it serves: each module of this package is imported (an architecture's
    registers itself, so a new one is its file alone; shared modules register nothing)."""
    for module in _modules():
        importlib.import_module(f"{_PACKAGE}.{module}")
    return REGISTRY


def model_class(config: Config) -> ModelFactory:
    """The architecture's class. Its module is imported first where it bears the architecture's name (llama.py
    serves llama), the others only when it does not: every architecture's module is ~0.07 s of a runner's start."""
    name = registry_name(config)
    if name not in REGISTRY and (stem := name.removesuffix("_embed")) in _modules():
        importlib.import_module(f"{_PACKAGE}.{stem}")
    if name not in REGISTRY and name not in architectures():
        raise ModelError(f"unknown model architecture: {name!r} (supported: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]
