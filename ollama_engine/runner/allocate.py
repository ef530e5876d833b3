"""Open a model for serving: weights, KV cache, prompt cache and the worst-case compute graphs.

Everything a request can need is sized here, before the first request: the KV cache for `parallel`
sequences of `kv_size / parallel` tokens, and the compute buffers of the two largest graphs the batch
loop builds (a full prompt batch, and a decode batch with one token for every sequence). Once that
has succeeded, no allocation grows at inference time. With `allocate=False` (the `fit` operation)
the same sizes are measured and nothing is allocated.

A draft model for speculative decoding (`draft_path`) is opened beside the model the same way, on the CPU,
with a KV cache of the same slots and context, and counted in the model's memory report.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ollama_engine import envconfig
from ollama_engine.kvcache import Batch, ShiftError, cache_dtype
from ollama_engine.ml import BackendMemory, Context, DeviceID, GPULayers, gpu_devices
from ollama_engine.ml.memory import FlashAttention
from ollama_engine.models import Model, load_model
from ollama_engine.models.vision import load_vision
from ollama_engine.runner.draft import DraftModel, check_vocabulary
from ollama_engine.runner.images import ImageEncoder
from ollama_engine.runner.prompt_cache import InputCache
from ollama_engine.runner.speculate import verify_rows
from ollama_engine.runner.tower_memory import output_device, with_tower

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadParams:
    """What a /load request asks of the model (everything but the operation)."""

    parallel: int = 1
    batch_size: int = 512
    kv_size: int = 2048
    kv_cache_type: str = ""
    kv_cache_type_k: str = ""  # where set, the key or value cache's type instead of kv_cache_type
    kv_cache_type_v: str = ""
    flash_attention: int = FlashAttention.DISABLED  # -1 auto: on where every device used supports it
    num_threads: int = 0  # 0: the backend's default
    gpu_layers: tuple[GPULayers, ...] = field(default_factory=tuple)
    multi_user_cache: bool = False
    use_mmap: bool = False  # the CPU's weights mapped from the file, not read into memory of their own
    projector_path: str = ""  # a separate vision projector (mmproj GGUF); else a tower in the model's file, if any
    draft_path: str = ""  # a draft model for speculative decoding (same vocabulary), loaded on the CPU


class LoadedModel:
    """A model with its caches sized for serving; `memory` is what its backend reports."""

    def __init__(self, model: Model, input_cache: InputCache, parallel: int, batch_size: int,
                 images: ImageEncoder | None = None, draft: DraftModel | None = None,
                 image_graph: Mapping[DeviceID, int] | None = None):
        self.model = model
        self.input_cache = input_cache
        self.parallel = parallel
        self.batch_size = batch_size
        self.images = images  # the vision tower beside the model, if its file has one
        self.draft = draft  # the draft model for speculative decoding, if the load asked for one
        self.image_graph = dict(image_graph or {})  # what the tower's worst-case image graph needs, per device

    @property
    def memory(self) -> BackendMemory:
        """The model's report, with its vision tower as Ollama's Go engine counted one (runner/tower_memory.py): the
        tower's weights with the output layer, and per device the larger of the text and the image graph."""
        memory = self.model.backend.memory
        if self.images is None and self.draft is None:
            return memory
        combined = dataclasses.replace(memory, cpu=dataclasses.replace(
            memory.cpu, weights=list(memory.cpu.weights), cache=list(memory.cpu.cache)))
        if self.images is not None:
            tower = self.images.tower
            combined = with_tower(combined, tower.backend.memory, self.image_graph,
                                  shared=tower.compute_backend is self.model.backend)
        if self.draft is not None:  # on the CPU, with the output layer; its graphs are buffers of their own
            draft = self.draft.model.backend.memory
            combined.cpu.weights[-1] += draft.input_weights + sum(draft.cpu.weights)
            combined.cpu.cache[-1] += sum(draft.cpu.cache)
            combined.cpu.graph += draft.cpu.graph
        return combined

    def load(self, progress: Callable[[float], None] | None = None) -> None:
        """Read the weights: the model's, then its vision tower's and its draft model's."""
        self.model.backend.load(progress)
        if self.images is not None:
            self.images.tower.backend.load()
        if self.draft is not None:
            self.draft.model.backend.load()

    def close(self) -> None:
        if self.images is not None:  # first: its image graph may live on the model's backend
            self.images.tower.close()
        self.model.close()
        if self.draft is not None:
            self.draft.close()


def _flash_attention(params: LoadParams) -> bool:
    """Resolve auto (a parent that leaves the choice to the runner, as Ollama's llama engine does)."""
    if params.flash_attention != FlashAttention.AUTO:
        return params.flash_attention == FlashAttention.ENABLED
    used = {layers.device_id for layers in params.gpu_layers if layers.layers}
    unsupported = [gpu.name for gpu in gpu_devices() if gpu.device_id in used and not gpu.supports_flash_attention()]
    if unsupported:
        log.debug("flash attention off (auto: not supported by %s)", ", ".join(unsupported))
        return False
    log.debug("flash attention on (auto: supported by every device used)")
    return True


def open_model(path: str, params: LoadParams, allocate: bool) -> LoadedModel:
    """Build the model and size (or allocate) everything it will use.

    Raises ollama_engine.ml.NoMemory when an allocation fails; its report includes that allocation.
    """
    model = load_model(
        path, params.gpu_layers, allocate=allocate, num_threads=params.num_threads or None,
        flash_attention=_flash_attention(params), use_mmap=params.use_mmap,
    )
    try:
        parallel, batch_size = params.parallel, params.batch_size
        if model.cache is None:
            log.warning("model does not support caching, disabling parallel processing")
            parallel, batch_size = 1, max(batch_size, params.kv_size)
        input_cache = InputCache(
            model.cache, params.kv_size, parallel, batch_size,
            multi_user=params.multi_user_cache, remove_errors=ShiftError, exact=envconfig.exact_cache(),
        )
        if model.cache is not None:
            model.cache.init(model.backend, cache_dtype(params.kv_cache_type_k or params.kv_cache_type), parallel,
                             input_cache.num_ctx, batch_size,
                             value_dtype=cache_dtype(params.kv_cache_type_v or params.kv_cache_type))
        decode = min(parallel, batch_size)
        reserve_graph(model, tokens=batch_size, outputs=decode).close()
        reserve_graph(model, tokens=decode, outputs=decode, sequences=decode).close()
        if (rows := verify_rows(model, batch_size)) > decode:  # a batch verifying drafts: one output per row
            reserve_graph(model, tokens=rows, outputs=rows).close()
    except BaseException:
        model.close()
        raise
    tower = None
    try:  # the image graph is separate from the text graph, reserved in its worst case in the same buffers
        source = params.projector_path or path
        tower = load_vision(source, allocate=allocate, num_threads=params.num_threads or None,
                            flash_attention=_flash_attention(params),
                            file=None if params.projector_path else model.backend.model,
                            device=output_device(params.gpu_layers, model.backend.block_count))
        if tower is None and params.projector_path:
            raise ValueError(f"{params.projector_path}: not a vision projector")
        image_graph: dict[DeviceID, int] = {}
        if tower is not None:
            tower.compute_with(model.backend)
            with tower.compute_backend.reserving() as image_graph:
                tower.reserve()
    except BaseException:
        if tower is not None:
            tower.close()
        model.close()
        raise
    try:
        draft = open_draft(model, params, parallel, input_cache.num_ctx, batch_size, allocate) \
            if params.draft_path else None
    except BaseException:
        if tower is not None:
            tower.close()
        model.close()
        raise
    return LoadedModel(model, input_cache, parallel, batch_size, ImageEncoder(tower) if tower is not None else None,
                       draft, image_graph)


def open_draft(target: Model, params: LoadParams, parallel: int, num_ctx: int, batch_size: int,
               allocate: bool) -> DraftModel | None:
    """The draft model with its cache and worst-case graphs, on the CPU; None where speculation cannot be exact
    for the target (runner/speculate.verify_rows: nothing would use it). Raises VocabularyMismatch."""
    if verify_rows(target) < 2:
        log.warning("draft model not loaded: speculative decoding is not exact for this model's layout")
        return None
    model = load_model(params.draft_path, allocate=allocate, num_threads=params.num_threads or None,
                       flash_attention=_flash_attention(params), use_mmap=params.use_mmap)
    try:
        check_vocabulary(target, model)
        if model.cache is None:
            raise ValueError(f"{params.draft_path}: a draft model needs a KV cache (a causal language model)")
        model.cache.init(model.backend, cache_dtype(params.kv_cache_type_k or params.kv_cache_type), parallel,
                         num_ctx, batch_size, value_dtype=cache_dtype(params.kv_cache_type_v or params.kv_cache_type))
        decode = min(parallel, batch_size)  # every sequence drafts in the same batches (runner/draft.py)
        reserve_graph(model, tokens=batch_size, outputs=decode).close()  # catching up with prompts
        reserve_graph(model, tokens=decode, outputs=decode, sequences=decode).close()  # a draft step
    except BaseException:
        model.close()
        raise
    return DraftModel(model, batch_size, parallel)


def reserve_graph(model: Model, tokens: int, outputs: int, sequences: int = 1) -> Context:
    """Reserve compute buffers for a batch of this many tokens, outputs and sequences (each attending to
    the whole of its cache region).

    The first reservation also creates the KV cache tensors (they are made at the first put), which is
    how their size reaches the memory report. Returns the graph's context, for the caller to close.
    """
    batch = Batch(
        positions=np.arange(tokens), sequences=np.arange(tokens) * sequences // tokens, outputs=np.zeros(outputs),
        tokens=np.zeros(tokens),
    )
    ctx = model.backend.new_context()
    try:
        if model.cache is not None:
            model.cache.start_forward(ctx, batch, reserve=True)
        logits = model.forward(ctx, batch)
        ctx.reserve(*([logits] if logits is not None else []))
    except BaseException:
        ctx.close()
        raise
    return ctx
