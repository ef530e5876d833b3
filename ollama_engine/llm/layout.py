"""Which layers to offload to which GPU, given the runner's latest memory report.

A port of Ollama's createLayout (llm/server.go at f63eea3d): buildLayout picks the layers, verifyLayout
checks what stays in system memory. The load loop calls `create_layout` after every `/load` response, with
more information each time, until the runner accepts a layout.

The arithmetic follows Go exactly where it decides boundaries: free memory is scaled by a float32 factor
and truncated to an integer, and the binary search runs in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence

import numpy as np

from ollama_engine.ml.memory import (
    BackendMemory,
    DeviceInfo,
    GPULayers,
    GPULayersList,
    SystemInfo,
    group_by_library,
    group_by_performance,
    human_bytes2,
    sort_by_free_memory,
)

log = logging.getLogger(__name__)

LOAD_REQUIRED_FULL = "unable to load full model on GPU"

# The binary search stops once high - low is within this (compared in float32, as Go does).
_SEARCH_TOLERANCE = np.float32(1e-6)


class LoadRequiredFullError(Exception):
    """The model does not fit entirely on the GPUs while the caller demanded it (ErrLoadRequiredFull).

    The scheduler reacts by evicting another model and trying again.
    """

    def __init__(self, message: str = LOAD_REQUIRED_FULL) -> None:
        super().__init__(message)


class InsufficientSystemMemoryError(Exception):
    """What stays on the CPU does not fit in free RAM plus free swap."""


def create_layout(
    system_info: SystemInfo,
    gpus: Sequence[DeviceInfo],
    memory: BackendMemory,
    require_full: bool,
    backoff: float,
    *,
    num_gpu: int = -1,
    gpu_overhead: int = 0,
    sched_spread: bool = False,
    darwin: bool = sys.platform == "darwin",
) -> GPULayersList:
    """Assign as many layers as fit to the fewest GPUs of one library; the rest stay on the CPU.

    memory: the runner's last report; before the first `/load` pass `BackendMemory.unknown(total_layers)`.
    require_full: fail with LoadRequiredFullError unless every layer (or num_gpu layers) is offloaded and the
        CPU part fits in free RAM; the scheduler asks for this while other models are loaded.
    backoff: fraction of each GPU's free memory to hold back. The load loop raises it by 0.1 per failure;
        keep that sum a numpy.float32 as Ollama does, so that ten steps make 1.0000001.
    num_gpu: layers to offload as the user asked (-1: as many as fit; over capacity is forced on the GPUs).
    gpu_overhead: OLLAMA_GPU_OVERHEAD, bytes reserved on every GPU.
    sched_spread: OLLAMA_SCHED_SPREAD, spread layers over all GPUs instead of packing the fewest.
    darwin: macOS has no fixed swap, so the system-memory check differs (see `_verify_layout`).
    """
    gpu_layers, layers = _build_layout(
        gpus, memory, require_full, np.float32(backoff), num_gpu, gpu_overhead, sched_spread
    )
    return _verify_layout(system_info, gpus, memory, require_full, gpu_layers, layers, num_gpu, darwin)


def _build_layout(
    system_gpus: Sequence[DeviceInfo],
    memory: BackendMemory,
    require_full: bool,
    backoff: np.float32,
    num_gpu: int,
    gpu_overhead: int,
    sched_spread: bool,
) -> tuple[GPULayersList, list[int]]:
    """The best layout of any single library, and the size of every layer (wherever it is now)."""
    total_layers = len(memory.cpu.weights)
    for reported in [memory.cpu, *memory.gpus]:
        if len(reported.weights) != total_layers or len(reported.cache) != total_layers:
            raise ValueError(
                f"memory report for device {reported.name!r} has {len(reported.weights)} weights and "
                f"{len(reported.cache)} cache entries, want {total_layers} of each"
            )
    layers = [
        sum(device.weights[i] + device.cache[i] for device in [*memory.gpus, memory.cpu])
        for i in range(total_layers)
    ]

    best = GPULayersList()
    for group in group_by_library(sort_by_free_memory(list(system_gpus))):
        # A GPU that already holds a graph stays in use: dropping it would throw away what the last
        # allocation taught us and could make the load loop cycle.
        last_used_gpu = 0
        available = []
        for i, gpu in enumerate(group):
            reported = next((m for m in memory.gpus if m.device_id == gpu.device_id), None)
            if reported is None:
                # The runner does not see this GPU, so nothing can go there.
                available.append(dataclasses.replace(gpu, free_memory=0))
                continue
            if reported.graph != 0:
                last_used_gpu = i
            held_back = int(np.float32(gpu.free_memory) * backoff)
            reserved = held_back + gpu.minimum_memory() + gpu_overhead + reported.graph
            free = gpu.free_memory - reserved if gpu.free_memory > reserved else 0
            log.debug(
                "available gpu id=%s library=%s available_layer_vram=%s backoff=%.2f minimum=%s overhead=%s "
                "graph=%s",
                gpu.device_id.id, gpu.device_id.library, human_bytes2(free), backoff,
                human_bytes2(gpu.minimum_memory()), human_bytes2(gpu_overhead), human_bytes2(reported.graph),
            )
            available.append(dataclasses.replace(gpu, free_memory=free))

        placed = _assign_layers(layers, available, require_full, num_gpu, last_used_gpu, sched_spread)
        if placed.sum() > best.sum():  # strictly: the first library wins a tie
            best = placed
    return best, layers


def _verify_layout(
    system_info: SystemInfo,
    system_gpus: Sequence[DeviceInfo],
    memory: BackendMemory,
    require_full: bool,
    gpu_layers: GPULayersList,
    layers: list[int],
    num_gpu: int,
    darwin: bool,
) -> GPULayersList:
    """Reject layouts that leave too much on the CPU; return the layout to use."""
    cpu_size = memory.input_weights + memory.cpu.graph
    vram_size = 0
    for entry in gpu_layers:
        reported = next((m for m in memory.gpus if m.device_id == entry.device_id), None)
        if reported is not None:
            vram_size += reported.graph
    offloaded = {layer for entry in gpu_layers for layer in entry.layers}
    for i, size in enumerate(layers):
        if i in offloaded:
            vram_size += size
        else:
            cpu_size += size

    if require_full:
        if system_gpus and gpu_layers.sum() < len(layers) and (num_gpu < 0 or gpu_layers.sum() < num_gpu):
            log.info(
                "model requires more gpu memory than is currently available, evicting a model to make space "
                "loaded_layers=%d", gpu_layers.sum(),
            )
            raise LoadRequiredFullError()
        if cpu_size > system_info.free_memory:
            log.info(
                "model requires more system memory than is currently available, evicting a model to make "
                "space required=%d free=%d", cpu_size, system_info.free_memory,
            )
            # Go wraps ErrLoadRequiredFull with "%w" and no separator; the text reads exactly so.
            raise LoadRequiredFullError(
                f"model requires more system memory than is currently available {LOAD_REQUIRED_FULL}"
            )

    if not darwin:
        # Over-committing system memory on Linux and Windows almost always ends in an error.
        available = system_info.free_memory + system_info.free_swap
        if cpu_size > available:
            log.warning(
                "model request too large for system requested=%s available=%s total=%s free=%s swap=%s",
                human_bytes2(cpu_size), human_bytes2(available), human_bytes2(system_info.total_memory),
                human_bytes2(system_info.free_memory), human_bytes2(system_info.free_swap),
            )
            raise InsufficientSystemMemoryError(
                f"model requires more system memory ({human_bytes2(cpu_size)}) "
                f"than is available ({human_bytes2(available)})"
            )
    elif vram_size > system_info.total_memory:
        # Partial offload of a model larger than unified memory can lock the machine up. Ollama sets
        # num_gpu = 0 for the later layout calls, so its load loop ends on the empty layout; we return
        # that layout at once.
        log.info("model larger than total system memory, disabling partial offload")
        gpu_layers = GPULayersList()

    if system_gpus and gpu_layers.sum() == 0:
        log.debug("insufficient VRAM to load any model layers")
    return gpu_layers


def _assign_layers(
    layers: list[int],
    gpus: list[DeviceInfo],
    require_full: bool,
    requested_layers: int,
    last_used_gpu: int,
    sched_spread: bool,
) -> GPULayersList:
    """Pack as many layers as possible onto the fewest GPUs (a prefix of the sorted list)."""
    if requested_layers >= 0 or sched_spread:
        # A user who sets num_gpu (or spreading) wants GPUs treated alike, split by free memory.
        gpus = [dataclasses.replace(gpu, integrated=False) for gpu in gpus]

    placed = GPULayersList()
    # If not everything fits, try again without the output layer: repeating layers are worth more on a GPU.
    for _ in range(2):
        requested_layers = min(len(layers), requested_layers)  # -1 (no limit) stays -1
        if sched_spread:
            placed = _find_best_fit(layers, gpus, requested_layers, not require_full)
        else:
            for i in range(last_used_gpu, len(gpus)):
                force_request = i == len(gpus) - 1 and not require_full
                placed = _find_best_fit(layers, gpus[: i + 1], requested_layers, force_request)
                if placed.sum() in (len(layers), requested_layers):
                    break
        # Even when the request was met, the pass without the output layer may still do better.
        if placed.sum() == len(layers):
            return placed
        layers = layers[:-1]
    return placed


def _find_best_fit(
    layers: list[int], gpus: list[DeviceInfo], requested_layers: int, force_request: bool
) -> GPULayersList:
    """Place the most layers, spread as evenly as possible: the smallest capacity factor that still fits.

    Faster GPUs (the first performance group) take the end of the model; slower ones the layers before.
    """
    placed = GPULayersList()
    for group in group_by_performance(gpus):
        low = np.float32(0)
        # To honour an explicit request on the last GPU, pretend there is almost infinite VRAM.
        high = np.float32(1000 if requested_layers >= 0 and force_request else 1)
        best = _greedy_fit(layers, group, high, requested_layers)
        target = best.sum()
        while high - low > _SEARCH_TOLERANCE:
            mid = (low + high) / np.float32(2)
            if mid in (low, high):
                # Above a factor of about 16 float32 cannot split the interval any further, and Go would
                # loop forever with nothing changing; stop with the result it would hold.
                break
            candidate = _greedy_fit(layers, group, mid, requested_layers)
            if candidate.sum() == target:
                high, best = mid, candidate
            else:
                low = mid
        layers = layers[: len(layers) - best.sum()]
        requested_layers -= best.sum()
        placed = GPULayersList([*best, *placed])
    return placed


def _greedy_fit(
    layers: list[int], gpus: list[DeviceInfo], capacity: np.float32, requested_layers: int
) -> GPULayersList:
    """Fill GPUs from the last one backwards with layers from the last one backwards.

    The last GPU gets the output layer; the result lists GPUs in their input order.
    """
    device = len(gpus) - 1
    placed = GPULayersList([GPULayers(gpus[device].device_id)])
    free = _scaled(gpus[device].free_memory, capacity)
    for i in range(len(layers) - 1, -1, -1):
        if requested_layers >= 0 and len(layers) - 1 - i >= requested_layers:
            break
        while layers[i] > free:
            device -= 1
            if device < 0:
                return placed
            placed.insert(0, GPULayers(gpus[device].device_id))
            free = _scaled(gpus[device].free_memory, capacity)
        placed[0].layers.insert(0, i)
        free -= layers[i]
    return placed


def _scaled(free_memory: int, capacity: np.float32) -> int:
    """Go's uint64(float32(free) * capacity): rounded to float32, multiplied in float32, truncated."""
    return int(np.float32(free_memory) * capacity)
