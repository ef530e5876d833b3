"""The parent's load loop: fit → alloc → commit, re-planning the layout from each memory report.

A port of Ollama's ollamaServer.Load (llm/server.go, f63eea3d). The first layout is a guess made with no
knowledge (every layer costs nothing); each /load answers with what the layout really costs, and the next
layout is planned from that. A layout the runner could not allocate is retried with part of every GPU's
free memory held back (`backoff`, 0.1 more per failure, up to 1.0). Whatever goes wrong before the commit,
the runner's model is closed so that it holds no memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ollama_engine.ml.memory import BackendMemory, DeviceID, DeviceInfo, GPULayersList, SystemInfo
from ollama_engine.server.wire import LoadOperation

from .layout import create_layout

log = logging.getLogger(__name__)


class LoadError(Exception):
    """The runner could not be given a layout that it can allocate."""


class LoadTarget(Protocol):
    """What the loop talks to: a RunnerHandle (or a test double around one)."""

    def load(self, request: dict[str, Any]) -> tuple[bool, BackendMemory]: ...


@dataclass
class LoadOptions:
    """The /load request fields that stay the same through the loop (Ollama's opts and LoadRequest)."""

    num_ctx: int = 2048
    parallel: int = 1
    batch_size: int = 512
    num_gpu: int = -1  # layers to offload; -1: as many as fit
    num_threads: int = 0
    flash_attention: int = 0  # -1 auto, 0 disabled, 1 enabled
    flash_attention_reason: str = ""  # how the parent chose it (shown by `plan`), not sent
    kv_cache_type: str = ""
    kv_cache_type_k: str = ""  # the key or the value cache alone, where it differs from kv_cache_type
    kv_cache_type_v: str = ""
    projector_path: str = ""  # a separate vision projector (llama.cpp's mmproj GGUF), sent as ProjectorPath
    draft_path: str = ""  # a draft model for speculative decoding, sent as DraftPath (only when set)
    multi_user_cache: bool = False
    use_mmap: bool = False  # map the file for the CPU's weights (see mmap_weights)
    gpu_overhead: int = 0  # OLLAMA_GPU_OVERHEAD
    sched_spread: bool = False  # OLLAMA_SCHED_SPREAD

    def request(self, operation: LoadOperation, gpu_layers: GPULayersList) -> dict[str, Any]:
        """The LoadRequest JSON; the KV cache holds num_ctx tokens for every parallel sequence. Our separate
        key and value types travel only when set, so the request is Ollama's own otherwise."""
        separate = {key: value for key, value in (("KvCacheTypeK", self.kv_cache_type_k),
                                                  ("KvCacheTypeV", self.kv_cache_type_v),
                                                  ("DraftPath", self.draft_path)) if value}
        return {
            "Operation": int(operation), "LoraPath": None, "Parallel": self.parallel,
            "BatchSize": min(self.batch_size, self.num_ctx), "FlashAttention": self.flash_attention,
            "KvSize": self.num_ctx * self.parallel, "KvCacheType": self.kv_cache_type, **separate,
            "NumThreads": self.num_threads, "GPULayers": gpu_layers.to_json() or None,
            "MultiUserCache": self.multi_user_cache, "ProjectorPath": self.projector_path, "MainGPU": 0,
            "UseMmap": self.use_mmap,
        }


def mmap_weights(requested: bool | None, gpus: Sequence[DeviceInfo], free_memory: int, file_size: int) -> bool:
    """Whether the runner maps the model file (the `use_mmap` option where set), by Ollama's rule otherwise:
    not for a CPU-only load (the weights should be memory of their own, not page cache that the kernel may
    drop and read again) nor for a file larger than the free memory (mapped pages would thrash)."""
    if requested is not None:
        return requested
    return bool(gpus) and file_size <= free_memory


@dataclass
class Attempt:
    """One /load request of the loop and its answer."""

    operation: LoadOperation
    gpu_layers: GPULayersList
    success: bool
    backoff: float


@dataclass
class LoadResult:
    gpu_layers: GPULayersList
    memory: BackendMemory
    attempts: list[Attempt] = field(default_factory=list)

    def device_ids(self) -> list[DeviceID]:
        return self.gpu_layers.device_ids()


def load(
    target: LoadTarget,
    system_info: SystemInfo,
    gpus: Sequence[DeviceInfo],
    total_layers: int,
    options: LoadOptions,
    require_full: bool = False,
    on_attempt: Callable[[Attempt], None] | None = None,
) -> LoadResult:
    """Find a layout the runner can allocate, allocate it and commit it (the weights then load in the background).

    total_layers: block_count + 1 (the output layer). Raises LoadError, LoadRequiredFullError,
    InsufficientSystemMemoryError or RunnerError; in every such case the runner's model has been closed.
    """
    loop = _LoadLoop(target, system_info, gpus, options, require_full, on_attempt)
    try:
        return loop.run(total_layers)
    except BaseException:
        try:
            target.load(options.request(LoadOperation.CLOSE, GPULayersList()))
        except Exception as err:  # the original failure is the one worth reporting
            log.warning("closing the model after a failed load: %s", err)
        raise


class _LoadLoop:
    def __init__(
        self,
        target: LoadTarget,
        system_info: SystemInfo,
        gpus: Sequence[DeviceInfo],
        options: LoadOptions,
        require_full: bool,
        on_attempt: Callable[[Attempt], None] | None,
    ) -> None:
        self.target = target
        self.system_info = system_info
        self.gpus = list(gpus)
        self.options = options
        self.require_full = require_full
        self.on_attempt = on_attempt
        self.backoff = np.float32(0)
        self.attempts: list[Attempt] = []

    def layout(self, memory: BackendMemory, num_gpu: int | None = None) -> GPULayersList:
        return create_layout(
            self.system_info, self.gpus, memory, self.require_full, self.backoff,
            num_gpu=self.options.num_gpu if num_gpu is None else num_gpu,
            gpu_overhead=self.options.gpu_overhead, sched_spread=self.options.sched_spread,
        )

    def send(self, operation: LoadOperation, gpu_layers: GPULayersList) -> tuple[bool, BackendMemory]:
        success, memory = self.target.load(self.options.request(operation, gpu_layers))
        attempt = Attempt(operation, gpu_layers, success, float(self.backoff))
        self.attempts.append(attempt)
        log.info("load request operation=%s success=%s layers=%s", operation.name.lower(), success, gpu_layers)
        if self.on_attempt is not None:
            self.on_attempt(attempt)
        return success, memory

    def run(self, total_layers: int) -> LoadResult:
        num_gpu = self.options.num_gpu
        gpu_layers = self.layout(BackendMemory.unknown(total_layers))
        past: set[int] = set()
        for operation in (LoadOperation.FIT, LoadOperation.ALLOC):
            while True:  # one request per pass
                success, memory = self.send(operation, gpu_layers)
                past.add(gpu_layers.hash())
                converged = False
                while True:  # plan again with what was learnt, backing off until something new is worth a try
                    candidate = self.layout(memory)
                    if candidate.hash() not in past and candidate.sum() <= gpu_layers.sum():
                        gpu_layers = candidate  # fewer layers: every report only adds information
                        break
                    if num_gpu < 0 and candidate.sum() - gpu_layers.sum() > 1:
                        # The plan swings between fewer and more layers (say 39 and 41): try those between.
                        for layers in range(candidate.sum() - 1, gpu_layers.sum() - 1, -1):
                            between = self.layout(memory, num_gpu=layers)
                            success, between_memory = self.send(operation, between)
                            if success and between.sum() <= self.layout(between_memory).sum():
                                gpu_layers, memory, converged = between, between_memory, True
                                past.clear()
                                break
                        if converged:
                            break
                    if success:  # the latest request succeeded: keep what it allocated
                        converged = True
                        break
                    if num_gpu >= 0:
                        raise LoadError(f"memory layout cannot be allocated with num_gpu = {num_gpu}")
                    if self.backoff > 1:
                        log.warning("memory layout cannot be allocated memory=%s", memory.go_format())
                        raise LoadError("memory layout cannot be allocated")
                    self.backoff += np.float32(0.1)
                    log.info("model layout did not fit, applying backoff backoff=%.2f", self.backoff)
                if converged:
                    break

        success, memory = self.send(LoadOperation.COMMIT, gpu_layers)
        if not success:
            log.warning("failed to commit memory for model memory=%s", memory.go_format())
            raise LoadError("failed to commit memory for model")
        return LoadResult(gpu_layers, memory, self.attempts)
