"""Model definitions, imported as ollama_engine.models: one file per architecture, and the registry.

`load_model(path)` opens a GGUF file, picks the architecture by general.architecture (`<arch>_embed`
for pooling models; its module is imported then, and an architecture registers itself: `architectures()`),
and builds the backend (weights placed and, unless fitting, allocated but not yet read: call
`model.backend.load()`), the tokenizer, the model and its cache (not yet sized: the caller knows the
context and batch sizes and calls `model.cache.init`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ollama_engine.fs import GGUFFile
from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, GPULayers, Tensor
from ollama_engine.tokenizer import Tokenizer, from_metadata

from .base import Model, ModelError, architectures, bind, model_class, register, registry_name, require_uint, weight
from .graphs import Graph, Graphs


def load_model(
    path: str | os.PathLike[str],
    gpu_layers: Iterable[GPULayers] = (),
    *,
    allocate: bool = True,
    num_threads: int | None = None,
    flash_attention: bool = False,
    repack_weights: bool = True,
    use_mmap: bool = False,
    op_offload: bool = True,
) -> Model:
    """The model in the GGUF file at `path`, on the devices `gpu_layers` chooses (default: the CPU).

    repack_weights=False keeps ggml's plain weight layout on the CPU; use_mmap=True maps the file for the
    CPU's weights instead of reading them (see Backend); op_offload=False keeps a big batch's work on the
    weights' own device (llama.cpp's --no-op-offload).
    """
    file, tokenizer = _read(path)
    factory = model_class(file.config)
    backend = Backend(
        file, gpu_layers, allocate=allocate, num_threads=num_threads, flash_attention=flash_attention,
        repack_weights=repack_weights, unused_tensors=factory.unused_tensors(file.config), use_mmap=use_mmap,
        tensor_groups=factory.tensor_groups, op_offload=op_offload,
    )
    try:
        return factory(backend, tokenizer)
    except BaseException:
        backend.close()
        raise


_last_read: list[tuple[tuple, GGUFFile, Tokenizer]] = []


def _read(path: str | os.PathLike[str]) -> tuple[GGUFFile, Tokenizer]:
    """The file's metadata and its tokenizer; those of the last file read are kept.

    The runner opens every model twice in a row (fit, then allocate), and a 128k vocabulary takes about a
    second to parse and index. Both are read-only once built. A file changed since (size or time) is read again.
    """
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if _last_read and _last_read[0][0] == key:
        return _last_read[0][1], _last_read[0][2]
    file = GGUFFile.open(path)
    model_class(file.config)  # an unknown architecture is reported before the tokenizer is built
    blocks = file.config.get_uint("block_count", 0)
    if blocks > len(file.tensors):  # every block has tensors; the backend sizes per-block tables by this count
        raise ModelError(f"{path}: block_count {blocks} but the file has only {len(file.tensors)} tensors")
    try:
        tokenizer = from_metadata(file.metadata)
    except (ValueError, TypeError, AttributeError, LookupError, RuntimeError) as err:  # RuntimeError: sentencepiece
        raise ModelError(f"{path}: invalid tokenizer metadata: {err}") from err
    _last_read[:] = [(key, file, tokenizer)]
    return file, tokenizer


def forward(model: Model, ctx: Context, batch: Batch) -> Tensor | None:
    """One forward pass: place the batch in the model's cache, then build the model's graph in ctx."""
    if model.cache is not None:
        model.cache.start_forward(ctx, batch)
    return model.forward(ctx, batch)


__all__ = [
    "Graph", "Graphs", "Model", "ModelError", "architectures", "bind", "forward", "load_model", "model_class",
    "register", "registry_name", "require_uint", "weight",
]
