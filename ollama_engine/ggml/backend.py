"""Devices, buffers and the backend scheduler: the parts of ggml-backend.h the engine uses."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import NULL, ffi, lib

_log = logging.getLogger(__name__)

DEVICE_TYPES = {
    lib.GGML_BACKEND_DEVICE_TYPE_CPU: "CPU",
    lib.GGML_BACKEND_DEVICE_TYPE_GPU: "GPU",
    lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "IGPU",
    lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "ACCEL",
}


def _string(pointer) -> str:
    return ffi.string(pointer).decode() if pointer != NULL else ""


@dataclass(frozen=True)
class DeviceProps:
    """One ggml device as the registry describes it. `handle` is the ggml_backend_dev_t."""

    handle: object
    index: int
    name: str
    description: str
    type: str
    library: str
    device_id: str
    free: int
    total: int


def devices() -> list[DeviceProps]:
    """Every device of every registered backend (the CPU backend is always among them)."""
    found = []
    for index in range(lib.ggml_backend_dev_count()):
        found.append(device_props(lib.ggml_backend_dev_get(index), index))
    return found


def device_props(dev, index: int) -> DeviceProps:
    props = ffi.new("struct ggml_backend_dev_props *")
    lib.ggml_backend_dev_get_props(dev, props)
    reg = lib.ggml_backend_dev_backend_reg(dev)
    return DeviceProps(
        handle=dev,
        index=index,
        name=_string(props.name),
        description=_string(props.description),
        type=DEVICE_TYPES.get(props.type, "UNKNOWN"),
        library=_string(lib.ggml_backend_reg_name(reg)) if reg != NULL else "",
        device_id=_string(props.device_id),
        free=props.memory_free,
        total=props.memory_total,
    )


def device_memory(dev) -> tuple[int, int]:
    """(free, total) bytes, asked anew."""
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    lib.ggml_backend_dev_memory(dev, free, total)
    return free[0], total[0]


def init_backend(dev):
    backend = lib.ggml_backend_dev_init(dev, NULL)
    if backend == NULL:
        raise RuntimeError(f"failed to initialize ggml backend device {_string(lib.ggml_backend_dev_name(dev))}")
    return backend


def free_backend(backend) -> None:
    lib.ggml_backend_free(backend)


def set_threads(cpu_backend, n_threads: int) -> None:
    lib.ggml_backend_cpu_set_n_threads(cpu_backend, n_threads)


# ---------------------------------------------------------------- buffer types and buffers


def default_buffer_type(dev):
    return lib.ggml_backend_dev_buffer_type(dev)


def extra_buffer_types(dev) -> list:
    """The device's extra weight buffer types (the CPU's repacked layouts for faster matmul kernels)."""
    reg = lib.ggml_backend_dev_backend_reg(dev)
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if address == NULL:
        return []
    listing = ffi.cast("ggml_backend_buffer_type_t * (*)(ggml_backend_dev_t)", address)(dev)
    found = []
    while listing != NULL and listing[len(found)] != NULL:
        found.append(listing[len(found)])
    return found


def buffer_type_name(buft) -> str:
    return _string(lib.ggml_backend_buft_name(buft))


def supports_matmul_weight(dev, buft, ggml_type: int, shape: tuple[int, ...], experts: bool = False) -> bool:
    """Whether the device can multiply by a weight of this type and shape stored in a buffer of `buft`.

    Asked the way the scheduler will meet it: a mul_mat of the weight, placed in a zero-sized buffer
    of that type, by a batch of F32 rows; for stacked experts (3-D, `experts`) a mul_mat_id, and for
    other 3-D weights (deepseek2's per-head attn_k_b) a batched mul_mat, as llama.cpp asks.
    """
    ctx = lib.ggml_init({"mem_size": 5 * lib.ggml_tensor_overhead(), "mem_buffer": NULL, "no_alloc": True})
    buffer = lib.ggml_backend_buft_alloc_buffer(buft, 0)
    try:
        probe = lib.ggml_new_tensor(ctx, ggml_type, len(shape), ffi.new("int64_t[]", shape))
        probe.buffer = buffer
        if len(shape) == 3 and experts:
            rows = lib.ggml_new_tensor_3d(ctx, lib.GGML_TYPE_F32, shape[0], 1, 512)
            ids = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_I32, 1, 512)
            return bool(lib.ggml_backend_dev_supports_op(dev, lib.ggml_mul_mat_id(ctx, probe, rows, ids)))
        rows = lib.ggml_new_tensor_3d(ctx, lib.GGML_TYPE_F32, shape[0], 512, shape[2] if len(shape) == 3 else 1)
        return bool(lib.ggml_backend_dev_supports_op(dev, lib.ggml_mul_mat(ctx, probe, rows)))
    finally:
        lib.ggml_backend_buffer_free(buffer)
        lib.ggml_free(ctx)


def supports_flash_attention(dev, head_dim: int = 128, kv_type: int = lib.GGML_TYPE_F16) -> bool:
    """Whether the device runs ggml's fused attention on an F16 cache of this head size (llama.cpp's auto check)."""
    ctx = lib.ggml_init({"mem_size": 6 * lib.ggml_tensor_overhead(), "mem_buffer": NULL, "no_alloc": True})
    try:
        query = lib.ggml_new_tensor_4d(ctx, lib.GGML_TYPE_F32, head_dim, 1, 1, 1)
        key = lib.ggml_new_tensor_4d(ctx, kv_type, head_dim, 256, 1, 1)
        value = lib.ggml_new_tensor_4d(ctx, kv_type, head_dim, 256, 1, 1)
        mask = lib.ggml_new_tensor_4d(ctx, lib.GGML_TYPE_F16, 256, 1, 1, 1)
        node = lib.ggml_flash_attn_ext(ctx, query, key, value, mask, 1.0, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(node, lib.GGML_PREC_F32)
        return bool(lib.ggml_backend_dev_supports_op(dev, node))
    finally:
        lib.ggml_free(ctx)


def alignment(buft) -> int:
    return lib.ggml_backend_buft_get_alignment(buft)


def padded_alloc_size(buft, tensor) -> int:
    """What allocating this tensor in a buffer of this type takes, padded as ggml-alloc pads it."""
    size = lib.ggml_backend_buft_get_alloc_size(buft, tensor)
    align = alignment(buft)
    return (size + align - 1) // align * align


def alloc_context_tensors(ctx, buft):
    """Allocate every tensor of a context in buffers of this type; None when the device is out of memory."""
    buffer = lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    return None if buffer == NULL else buffer


def alloc_buffer(buft, size: int):
    buffer = lib.ggml_backend_buft_alloc_buffer(buft, size)
    return None if buffer == NULL else buffer


def host_buffer_type(dev):
    """The device's buffer type in pinned host memory (CUDA_Host, Vulkan_Host), or None where it has none."""
    buft = lib.ggml_backend_dev_host_buffer_type(dev)
    return None if buft == NULL else buft


def dummy_buffer(buft):
    """A zero-sized buffer of the type: tensors that point at it are 'allocated' for the scheduler."""
    return lib.ggml_backend_buft_alloc_buffer(buft, 0)


def place_tensor(buffer, tensor, offset: int = 0) -> None:
    status = lib.ggml_backend_tensor_alloc(buffer, tensor, ffi.cast("void *", buffer_base(buffer) + offset))
    if status != lib.GGML_STATUS_SUCCESS:
        raise RuntimeError(f"ggml_backend_tensor_alloc failed with status {status}")


class MappedFile:
    """Part of a file mapped into memory as a CPU weight buffer: ggml reads the weights in the page cache.

    Private and writable (copy-on-write), so that nothing written by mistake reaches the file; the pages
    ggml only reads stay the page cache's, shared with other processes mapping the same file, and are
    read from disk on first touch (readahead is asked for at once, as llama.cpp's prefetch does).
    """

    def __init__(self, fd: int, offset: int, size: int):
        self.offset = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        length = offset + size - self.offset
        if os.fstat(fd).st_size < offset + size:  # a page past the end would be a SIGBUS when read
            raise OSError(f"model file ends at byte {os.fstat(fd).st_size}, inside a tensor's data")
        self._map = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=self.offset)
        if hasattr(mmap, "MADV_WILLNEED"):
            self._map.madvise(mmap.MADV_WILLNEED)
        self._pin = ffi.from_buffer(self._map)
        self.address = int(ffi.cast("uintptr_t", self._pin))
        self.buffer = lib.ggml_backend_cpu_buffer_from_ptr(self._pin, length)
        if self.buffer == NULL:
            self.close()
            raise MemoryError("ggml could not make a buffer of a mapped file")
        mark_weights(self.buffer)  # the scheduler runs ops where their weights are, or offloads big batches

    def place(self, tensor, file_offset: int) -> None:
        """Point a tensor at its bytes in the file (its data offset in the GGUF)."""
        place_tensor(self.buffer, tensor, file_offset - self.offset)

    def close(self) -> None:
        """Free the ggml buffer (which does not own the memory), then unmap."""
        if self.buffer is not None and self.buffer != NULL:
            lib.ggml_backend_buffer_free(self.buffer)
        self.buffer = None
        if self._pin is not None:
            ffi.release(self._pin)
            self._pin = None
        self._map.close()


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux
MADV_COLLAPSE = 25  # Linux 6.1
COLLAPSE_STEP = HUGE_PAGE  # what one madvise(MADV_COLLAPSE) moves: a graph compute waits for at most one


def cpu_cache_line_buffer_type():
    """The CPU buffer type for compute buffers: ggml's, but with every tensor on a 64-byte cache line.

    ggml's CPU buffer type aligns to 32 bytes. Threads of one op write neighbouring chunks of its output,
    and where a chunk boundary falls inside a cache line the line bounces between cores: the attention
    scores' matmul, written in 64-byte tiles, ran 20-40% slower on 2 threads. Compiled by build_ggml.py.
    """
    return lib.cpu_cache_line_buffer_type()


def in_host_memory(buffer) -> bool:
    """Whether the buffer's bytes are in the process's memory: host buffers, and every CPU buffer type.

    ggml's "is host" means more: that the bytes are in ggml's plain layout, which the CPU's repacked
    buffer types (CPU_REPACK) are not, though they are as much in host memory.
    """
    if lib.ggml_backend_buffer_is_host(buffer):
        return True
    device = lib.ggml_backend_buft_get_device(lib.ggml_backend_buffer_get_type(buffer))
    return device != NULL and lib.ggml_backend_dev_type(device) == lib.GGML_BACKEND_DEVICE_TYPE_CPU


def buffer_base(buffer) -> int:
    """The buffer's address: for the memory report and to find its pages in /proc/self/smaps."""
    return int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_base(buffer)))


def _huge_page_span(buffer) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside a buffer in host memory, as (start, stop); None when there are none."""
    if not sys.platform.startswith("linux") or not in_host_memory(buffer):
        return None
    base = buffer_base(buffer)
    start = -(-base // HUGE_PAGE) * HUGE_PAGE
    stop = (base + lib.ggml_backend_buffer_get_size(buffer)) // HUGE_PAGE * HUGE_PAGE
    return (start, stop) if stop > start else None


def advise_huge_pages(buffer) -> bool:
    """Ask Linux to back a buffer in host memory with 2 MiB pages (the pages written after the advice).

    Weights are streamed through once per token; with 4 KiB pages that costs a TLB miss every 4 KiB,
    and decoding measured 4-11% faster on huge pages. A no-op (False) off Linux, for device memory,
    or where transparent huge pages are disabled.
    """
    span = _huge_page_span(buffer)
    if span is None:
        return False
    return _libc().madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1] - span[0]), MADV_HUGEPAGE) == 0


def huge_page_steps(buffer) -> list[tuple[int, int]]:
    """The buffer's whole 2 MiB pages as (address, size) pieces of COLLAPSE_STEP, for collapse_huge_pages."""
    span = _huge_page_span(buffer)
    if span is None:
        return []
    return [(start, min(COLLAPSE_STEP, span[1] - start)) for start in range(span[0], span[1], COLLAPSE_STEP)]


def collapse_huge_pages(address: int, size: int) -> bool:
    """Move written pages onto 2 MiB pages (MADV_COLLAPSE; the GIL is released meanwhile).

    Faulting a fresh buffer in on huge pages costs the load up to 4 ms of compaction per page (1.8 s of
    system time for a 1B model); collapsing once loaded moves that cost off the time to ready. True when
    the caller may go on: done, or a page busy for a moment (EAGAIN, left on 4 KiB pages); False where
    the kernel cannot (before 6.1: EINVAL) or has no huge page to give (ENOMEM).
    """
    if _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), MADV_COLLAPSE) == 0:
        return True
    error = ctypes.get_errno()
    _log.debug("MADV_COLLAPSE failed: %s", os.strerror(error))
    return error == errno.EAGAIN


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).

    Reading a model's metadata and building its tokenizer leave tens of MiB of freed heap (Python
    objects, the tokenizer's construction) that glibc keeps resident; memory allocated afterwards does
    not reuse it, so it would count in the peak RSS for the life of the process.
    """
    trim = getattr(_libc(), "malloc_trim", None) if sys.platform.startswith("linux") else None
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mark_weights(buffer) -> None:
    lib.ggml_backend_buffer_set_usage(buffer, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)


def clear_buffer(buffer, value: int = 0) -> None:
    lib.ggml_backend_buffer_clear(buffer, value)


def buffer_size(buffer) -> int:
    return lib.ggml_backend_buffer_get_size(buffer)


def free_buffer(buffer) -> None:
    lib.ggml_backend_buffer_free(buffer)


# ---------------------------------------------------------------- scheduler


class EvalCallback:
    """A ggml scheduler eval callback: wants(node) picks nodes, seen(node) gets each one once it is computed.

    ggml asks about every node before computing it; a node `wants` accepts ends a piece of the graph, which
    is computed at once and handed to `seen`; the other nodes run together as usual, so asking for few
    nodes costs little. `address` is the C function pointer, for another library's scheduler (llama.cpp's
    cb_eval), so that both engines are observed by the same code. An exception is logged: raising into
    ggml is not possible, and stopping would silently skip the rest of the graph.
    """

    def __init__(self, wants: Callable[[object], bool], seen: Callable[[object], None], what: str = "eval callback"):
        def on_error(exception: type[BaseException], value: BaseException, trace) -> bool:
            _log.error("%s failed: %r", what, value)
            return True

        @ffi.callback("ggml_backend_sched_eval_callback", onerror=on_error)
        def on_node(node, ask, user_data) -> bool:
            if ask:
                return bool(wants(node))
            seen(node)
            return True

        self.callback = on_node
        self.address = int(ffi.cast("uintptr_t", on_node))


class NodeTimer(EvalCallback):
    """Asks for every node and calls record(node, seconds) after each one.

    Every node then is its own graph compute: the seconds include that overhead, the same for every op.
    """

    def __init__(self, record: Callable[[object, float], None]):
        started = [0.0]

        def wants(node) -> bool:
            started[0] = time.perf_counter()
            return True

        def seen(node) -> None:
            record(node, time.perf_counter() - started[0])

        super().__init__(wants, seen, "node timer")


class TensorCapture(EvalCallback):
    """Hands take(name, values) the float32 values of every node whose name `wanted` accepts, as computed.

    wanted(name) sees the name of every node the scheduler computes. Values are copied out of the node's
    buffer (host or device) while they are valid: later nodes may reuse that memory. Views and permuted
    nodes are read through their strides, so `values` always has the node's logical shape (numpy order,
    the ggml shape reversed). Nodes of other than float types (F32, F16, BF16) are skipped.
    """

    def __init__(self, wanted: Callable[[str], bool], take: Callable[[str, np.ndarray], None]):
        def wants(node) -> bool:
            return wanted(_string(node.name))

        def seen(node) -> None:
            values = float_values(node)
            if values is not None:
                take(_string(node.name), values)

        super().__init__(wants, seen, "tensor capture")


def float_values(t) -> np.ndarray | None:
    """A computed float tensor's values as a new float32 array of its logical shape; None for other types."""
    dtype = _FLOAT_TYPES.get(t.type)
    source = t.view_src if t.view_src != NULL else t
    if dtype is None or source.buffer == NULL or t.data == NULL:  # ggml would abort reading it
        return None
    ne = tuple(t.ne[0:4])
    if 0 in ne:
        return np.zeros(tuple(reversed(ne)), dtype=np.float32)
    span = np.empty(lib.ggml_nbytes(t), dtype=np.uint8)  # contiguous or not: every byte the strides reach
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(span), 0, span.nbytes)
    strided = np.lib.stride_tricks.as_strided(
        span.view(dtype), shape=tuple(reversed(ne)), strides=tuple(reversed(list(t.nb[0:4]))), writeable=False
    )
    if dtype == np.uint16:  # bfloat16: the high half of a float32
        return (strided.astype(np.uint32) << 16).view(np.float32)
    return strided.astype(np.float32)


_FLOAT_TYPES = {lib.GGML_TYPE_F32: np.dtype(np.float32), lib.GGML_TYPE_F16: np.dtype(np.float16),
                lib.GGML_TYPE_BF16: np.dtype(np.uint16)}


class Scheduler:
    """ggml_backend_sched over a list of backends (the CPU last), with their buffer types."""

    def __init__(self, backends: list, buffer_types: list, graph_size: int, op_offload: bool = True):
        self.backends = ffi.new("ggml_backend_t[]", backends)
        self.buffer_types = ffi.new("ggml_backend_buffer_type_t[]", buffer_types)
        self.n_backends = len(backends)
        self.graph_size = graph_size
        self.handle = lib.ggml_backend_sched_new(
            self.backends, self.buffer_types, self.n_backends, graph_size, False, op_offload
        )
        if self.handle == NULL:
            raise RuntimeError("ggml_backend_sched_new failed")
        self._sources: dict[int, tuple] = {}  # graph address -> its nodes' sources as built, its unallocated tensors

    def _as_built(self, graph) -> None:
        """The graph as built, before ggml splits it (build_ggml.GRAPH_SOURCES): the sources its nodes were built
        with (a split points them at the copies of the last split), no memory for the tensors the scheduler
        allocates (an earlier allocation's may lie where the compute buffers were before another graph grew them),
        and the scheduler reset, as a first split finds it."""
        key = int(ffi.cast("uintptr_t", graph))
        saved = self._sources.get(key)
        if saved is None:
            sources = ffi.new("struct ggml_tensor *[]", lib.graph_source_slots(graph))
            lib.graph_save_sources(graph, sources)
            count = lib.graph_unallocated(graph, NULL)
            unallocated = ffi.new("struct ggml_tensor *[]", max(count, 1))
            lib.graph_unallocated(graph, unallocated)
            self._sources[key] = (sources, unallocated, count)
        else:
            sources, unallocated, count = saved
            lib.graph_restore_sources(graph, sources)
            lib.graph_forget_allocation(unallocated, count)
        lib.ggml_backend_sched_reset(self.handle)

    def forget(self, graph) -> None:
        """The graph is freed: its address may hold another graph next."""
        self._sources.pop(int(ffi.cast("uintptr_t", graph)), None)

    def reserve_size(self, graph) -> list[int]:
        """Compute-buffer bytes per backend that this graph needs; allocates nothing."""
        sizes = ffi.new("size_t[]", self.n_backends)
        self._as_built(graph)
        lib.ggml_backend_sched_reserve_size(self.handle, graph, sizes)
        return list(sizes)

    def reserve(self, graph) -> bool:
        """Grow the compute buffers so this graph fits; False when a device is out of memory."""
        self._as_built(graph)
        return bool(lib.ggml_backend_sched_reserve(self.handle, graph))

    def buffer_sizes(self) -> list[int]:
        return [lib.ggml_backend_sched_get_buffer_size(self.handle, self.backends[i]) for i in range(self.n_backends)]

    def alloc_graph(self, graph) -> bool:
        self._as_built(graph)
        return bool(lib.ggml_backend_sched_alloc_graph(self.handle, graph))

    def compute(self, graph) -> None:
        status = lib.ggml_backend_sched_graph_compute(self.handle, graph)
        if status != lib.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"error computing ggml graph (status {status})")

    def reset(self) -> None:
        lib.ggml_backend_sched_reset(self.handle)

    def splits(self) -> tuple[int, int]:
        """The last graph's splits (runs of nodes on one backend) and the tensor copies between them."""
        return lib.ggml_backend_sched_get_n_splits(self.handle), lib.ggml_backend_sched_get_n_copies(self.handle)

    def set_eval_callback(self, callback: EvalCallback | None) -> None:
        """Hand computed nodes to `callback` (a NodeTimer, a TensorCapture); None: whole graphs again."""
        self._eval_callback = callback  # the callback lives as long as ggml may call it
        lib.ggml_backend_sched_set_eval_callback(self.handle, NULL if callback is None else callback.callback, NULL)

    def free(self) -> None:
        if self.handle != NULL:
            lib.ggml_backend_sched_free(self.handle)
            self.handle = NULL


def new_graph(ctx, size: int):
    return lib.ggml_new_graph_custom(ctx, size, False)


def graph_n_nodes(graph) -> int:
    return lib.ggml_graph_n_nodes(graph)
