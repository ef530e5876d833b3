"""Backend: a model's weights placed on devices, the scheduler that computes its graphs, and the
memory report of everything it allocates.

Placement follows the request's GPULayers exactly: a layer listed for a GPU the process can see goes
there, every other layer and every tensor that belongs to no layer stays on the CPU. Token embeddings
are always on the CPU; the output layer (index block_count) goes where `GPULayers` puts block_count.

With `allocate=False` (the runner's `fit`) nothing is allocated: every size is computed and recorded,
tensors point at empty placeholder buffers so the scheduler still knows their devices, and graph sizes
come from ggml_backend_sched_reserve_size. With `allocate=True` (`alloc`/`commit`) the same sizes are
recorded and then really allocated, so both report identical numbers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ollama_engine import envconfig, ggml
from ollama_engine.fs import GGUFFile
from ollama_engine.ggml import GGMLType
from ollama_engine.ggml import backend as ggml_backend
from ollama_engine.ggml.backend import TensorCapture

from .device import Device, cpu_device, default_threads, gpu_devices
from .memory import BackendMemory, DeviceID, DeviceMemory, GPULayers, NoMemory
from .tensor import Tensor

log = logging.getLogger(__name__)

LOAD_CHUNK = 4 << 20
HUGE_PAGE_MODES = ("collapse", "fault", "off")
COLLAPSE_IDLE = 0.05  # seconds without a graph compute before weights are moved onto huge pages


def huge_page_mode() -> str:
    """How CPU weights get onto 2 MiB pages (OLLAMA_ENGINE_HUGE_PAGES): "collapse" (the default) moves them
    there in a background thread once loaded, "fault" advises the buffers before loading (the load pays
    for compaction: 0.7 s of a 1B model's time to ready here), "off" keeps 4 KiB pages.
    """
    mode = envconfig.huge_pages()
    return mode if mode in HUGE_PAGE_MODES else "collapse"


@dataclass(frozen=True)
class TensorGroups:
    """Which of a file's tensors belong to no repeating layer, by the dot-separated parts of their names. The
    model declares them (models.base.Model.tensor_groups); the Backend only applies them. A tensor in no group
    goes with the layer its name numbers (blk.3.*), or, numbering none, is an input weight on the CPU."""

    outputs: frozenset[str] = frozenset()  # a name with one of these parts: the output layer's (block_count)
    per_layer: frozenset[str] = frozenset()  # a name with one of these parts: copied into every layer, blk.<i>.<name>
    by_row: frozenset[str] = frozenset()  # whole names placed with a layer but only read by row (get_rows):
    # never in a repacked layout, which get_rows cannot read
    tied: tuple[tuple[str, str], ...] = ()  # (source, copy): the copy made from the source where the file lacks it

    def extended(self, *, outputs: Iterable[str] = (), per_layer: Iterable[str] = (),
                 by_row: Iterable[str] = ()) -> TensorGroups:
        """These groups with more names: how an architecture adds its own tensors to its base's."""
        return TensorGroups(self.outputs | frozenset(outputs), self.per_layer | frozenset(per_layer),
                            self.by_row | frozenset(by_row), self.tied)


@dataclass(frozen=True)
class Placement:
    """Where one model tensor lives: its name in the model, layer index (None = input) and device."""

    name: str
    layer: int | None
    device: Device


class Backend:
    """The weights of one GGUF on the devices a GPULayers list chooses, and a scheduler over them.

    With no model it is a bare compute backend (no weights, block_count 0): handy for tests and tools.
    tensor_groups says which tensors belong to no layer (the model's declaration; none by default).
    unused_tensors names the file's tensors the model never reads (a vision tower beside a text model):
    they take no memory and are left out of the memory report, as llama.cpp skips them.
    """

    def __init__(
        self,
        model: GGUFFile | None,
        gpu_layers: Iterable[GPULayers] = (),
        *,
        allocate: bool = True,
        num_threads: int | None = None,
        flash_attention: bool = False,
        memory_limits: dict[str, int] | None = None,
        repack_weights: bool = True,
        unused_tensors: Callable[[str], bool] | None = None,
        use_mmap: bool = False,
        tensor_groups: TensorGroups | None = None,
        op_offload: bool = True,
    ):
        self.model = model
        # ggml sends a big batch's work on weights left in host memory to a GPU (copying the weights there)
        # when the GPU's backend asks for it (CUDA: 32 rows or more); llama.cpp's --no-op-offload turns it off
        self.op_offload = op_offload
        self.tensor_groups = tensor_groups or TensorGroups()
        self.unused_tensors = unused_tensors or (lambda name: False)  # neither allocated, counted nor read
        self.repack_weights = repack_weights
        self.allocate = allocate
        self.use_mmap = use_mmap and allocate and model is not None
        self.mapping_requested = use_mmap  # fit chooses buffer types as alloc, which maps
        self.flash_attention = flash_attention
        self.block_count = model.config.get_uint("block_count", 0) if model is not None else 0
        self.memory_limits = dict(memory_limits or {})
        self.cpu = cpu_device()
        self.gpus = gpu_devices()
        self.gpu_layers = list(gpu_layers)
        self.memory = BackendMemory(
            cpu=self._empty_report(self.cpu), gpus=[self._empty_report(gpu) for gpu in self.gpus]
        )
        self._device_memory = {self.cpu.handle: self.memory.cpu}
        self._device_memory.update({g.handle: m for g, m in zip(self.gpus, self.memory.gpus, strict=True)})
        self.layer_devices = [self._assign(layer) for layer in range(self.block_count + 1)]
        self.cpu_weights_type = self._cpu_weights_type()
        self._buffers: list = []
        self._placeholders: dict[tuple, object] = {}  # (device, buffer type, weights?) -> a zero-sized buffer
        self._weight_contexts: list = []
        self._weight_buffers: list = []
        self._mappings: list[ggml_backend.MappedFile] = []
        self._mapped: dict[str, int] = {}  # weights that are the mapped file's bytes -> their size in the report
        self.huge_pages = huge_page_mode()
        self._collapser: threading.Thread | None = None
        self._stop_collapse = threading.Event()
        self.weights: dict[str, Tensor] = {}
        self._load_targets: dict[str, list[Tensor]] = {}
        self._repacked: set[str] = set()  # weights in a repacked layout: written whole, never read back
        self._backends: list = []
        self.scheduler: ggml_backend.Scheduler | None = None
        self.compute_lock = threading.Lock()
        self.allocated_graph = None  # the graph the scheduler's compute buffers are laid out for
        self._reserving: dict[DeviceID, int] | None = None  # what reserve() records inside reserving()
        self.compute_seconds = 0.0  # time spent inside ggml's graph compute, for profiling
        self.last_compute = 0.0  # time.monotonic() when the last graph compute ended
        if allocate:
            ggml_backend.release_free_heap()
        try:
            self._create_weights()
            self._create_scheduler(num_threads or default_threads())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ placement

    def _empty_report(self, device: Device) -> DeviceMemory:
        return DeviceMemory(
            device_id=device.device_id, name=device.name,
            weights=[0] * (self.block_count + 1), cache=[0] * (self.block_count + 1),
        )

    def _assign(self, layer: int) -> Device:
        for entry in self.gpu_layers:
            if layer in entry.layers:
                for gpu in self.gpus:
                    if gpu.matches(entry.device_id):
                        return gpu
        return self.cpu

    def _cpu_weights_type(self):
        """Where the CPU's weights are kept beside a GPU: its pinned host memory, or the mapped file where the
        load maps it (llama.cpp's choice, and Ollama's), in ggml's plain layout either way.

        A batch of 32 rows or more on weights in host memory is sent to the GPU with them (op offload), which
        needs them in host memory of the plain layout: repacked, ggml computes such a batch on the CPU (a
        partially offloaded 8B's 512-token prompt: ~100 tokens/s there against ~1600 on an H200). Pinned,
        they cross to the GPU at its DMA speed. None (no GPU used, op offload off, or a GPU without pinned
        memory: RPC): the CPU's own buffer types, repacked where ggml has a faster layout."""
        return self._pinned_host_type() if self.op_offload else None

    def _pinned_host_type(self):
        """The pinned host memory type of the first GPU that holds layers (CUDA_Host); None without one."""
        gpu = next((device for device in self.layer_devices if device is not self.cpu), None)
        return ggml_backend.host_buffer_type(gpu.handle) if gpu is not None else None

    def layer_device(self, layer: int) -> Device:
        """Device of a repeating layer, or of the output layer for index block_count."""
        return self.layer_devices[layer]

    def placements(self, name: str) -> list[Placement]:
        """Every tensor a file tensor becomes (tied output weights and per-layer RoPE factors are copied)."""
        groups = self.tensor_groups
        copies = [copy for source, copy in groups.tied if source == name and copy not in self.model.tensors]
        return [placement for one in (name, *copies) for placement in self._placements(one, groups)]

    def _placements(self, name: str, groups: TensorGroups) -> list[Placement]:
        parts = name.split(".")
        output = self.block_count
        if groups.per_layer.intersection(parts):
            return [Placement(f"blk.{i}.{name}", i, self.layer_device(i)) for i in range(self.block_count)]
        if groups.outputs.intersection(parts):
            return [Placement(name, output, self.layer_device(output))]
        number = re.search(r"\d+", name)
        if number is None:
            return [Placement(name, None, self.cpu)]
        layer = int(number.group())
        if layer >= self.block_count:
            raise ValueError(f"{self.model.path}: tensor {name} names layer {layer} of {self.block_count}")
        return [Placement(name, layer, self.layer_device(layer))]

    # ------------------------------------------------------------ memory accounting

    def _report(self, device: Device) -> DeviceMemory:
        return self._device_memory[device.handle]

    def _record(self, device: Device, layer: int | None, size: int, kind: str) -> None:
        if layer is None:
            self.memory.input_weights += size
        else:
            getattr(self._report(device), kind)[layer] += size

    def _allocated_on(self, device: Device) -> int:
        report = self._report(device)
        total = report.size()
        return total + (self.memory.input_weights if device is self.cpu else 0)

    def _within_limit(self, device: Device) -> bool:
        limit = self.memory_limits.get(device.name)
        return limit is None or self._allocated_on(device) <= limit

    def placeholder_buffer(self, device: Device, buft=None, weights: bool = False):
        """A zero-sized buffer on the device: tensors that point at it count as allocated (fit mode).

        Weights get one of their own buffer type, marked as weights, as alloc's: the scheduler places ops by
        both (an op runs where its weights are; a big batch on weights in host memory goes to a GPU), so
        fit's graph sizes are alloc's."""
        buft = buft if buft is not None else device.buffer_type
        key = (id(device.handle), buft, weights)  # cffi pointers hash and compare by address
        if key not in self._placeholders:
            buffer = ggml_backend.dummy_buffer(buft)
            if weights:
                ggml_backend.mark_weights(buffer)
            self._placeholders[key] = buffer
            self._buffers.append((device, buffer))
        return self._placeholders[key]

    def allocate_tensor(self, device: Device, layer: int | None, handle) -> None:
        """Give one tensor its own buffer on the device, recorded as KV cache of `layer` first."""
        size = ggml_backend.padded_alloc_size(device.buffer_type, handle)
        self._record(device, layer, size, "cache")
        if not self.allocate:
            ggml.set_buffer(handle, self.placeholder_buffer(device))
            return
        buffer = ggml_backend.alloc_buffer(device.buffer_type, size) if self._within_limit(device) else None
        if buffer is None:
            raise NoMemory(self.memory)
        self._buffers.append((device, buffer))
        ggml_backend.place_tensor(buffer, handle)
        ggml_backend.clear_buffer(buffer, 0)

    # ------------------------------------------------------------ weights

    def _weight_buffer_type(self, placement: Placement, info, extra: list):
        """The buffer type a weight is stored in: the device's default; on the CPU a repacked layout, or beside a
        GPU the plain layout in its pinned memory or the mapped file (_cpu_weights_type).

        Repacked layouts (ggml's CPU_REPACK, e.g. Q4_0 in interleaved blocks on AVX2) have faster matmul
        kernels (for stacked experts' mul_mat_id too); llama.cpp uses them by default. Input tensors (token
        embeddings) are read by row, not multiplied, so they keep the plain layout, as do the model's by_row
        tensors (ggml's get_rows cannot read a repacked tensor).
        """
        device = placement.device
        if device is self.cpu and self.cpu_weights_type is not None:  # beside a GPU: mapped, or pinned
            return device.buffer_type if self.mapping_requested else self.cpu_weights_type
        by_row = info.name in self.tensor_groups.by_row
        if device is self.cpu and placement.layer is not None and len(info.shape) in (2, 3) and not by_row:
            for buft in extra:
                if ggml_backend.supports_matmul_weight(device.handle, buft, int(info.ggml_type), tuple(info.shape),
                                                       experts="_exps." in info.name):
                    return buft
        return device.buffer_type

    def _create_weights(self) -> None:
        extra = ggml_backend.extra_buffer_types(self.cpu.handle) if self.repack_weights else []
        groups: dict[tuple, list] = {}  # (device, buffer type) -> [(placement, info)]
        shared: dict[str, str] = {}  # a placement -> the placement whose tensor it uses
        for info in self.model.tensors.values() if self.model is not None else ():
            if self.unused_tensors(info.name):
                continue
            first: dict[tuple, str] = {}
            for placement in self.placements(info.name):
                buft = self._weight_buffer_type(placement, info, extra)
                key = (placement.device, buft)
                if key in first:  # the same bytes on the same device (a tied output weight not repacked)
                    shared[placement.name] = first[key]
                    continue
                first[key] = placement.name
                groups.setdefault((placement.device, buft), []).append((placement, info))
        allocations = []
        for (device, buft), entries in groups.items():
            ctx = ggml.new_context(len(entries))
            self._weight_contexts.append(ctx)
            handles, infos = [], []
            for placement, info in entries:
                handle = ggml.new_tensor(ctx, int(info.ggml_type), tuple(info.shape))
                ggml.set_name(handle, placement.name)
                tensor = Tensor(None, handle)
                self.weights[placement.name] = tensor
                self._load_targets.setdefault(info.name, []).append(tensor)
                if buft in extra:
                    self._repacked.add(placement.name)
                handles.append(handle)
                infos.append(info)
                self._record(device, placement.layer, ggml_backend.padded_alloc_size(buft, handle), "weights")
            allocations.append((device, buft, ctx, handles, infos))
        for name, owner in shared.items():
            self.weights[name] = self.weights[owner]
        # every weight is sized before anything is allocated, so a failure reports all of them
        for device, buft, ctx, handles, infos in allocations:
            if not self.allocate:
                buffer = self.placeholder_buffer(device, buft, weights=True)
                for handle in handles:
                    ggml.set_buffer(handle, buffer)
                continue
            if not self._within_limit(device):
                raise NoMemory(self.memory)
            if self.use_mmap and device is self.cpu and buft == device.buffer_type:
                handles = self._map_weights(list(zip(handles, infos, strict=True)), buft)
                if not handles:
                    continue
            buffer = ggml_backend.alloc_context_tensors(ctx, buft)
            if buffer is None:
                raise NoMemory(self.memory)
            ggml_backend.mark_weights(buffer)
            if self.huge_pages == "fault":
                ggml_backend.advise_huge_pages(buffer)
            self._buffers.append((device, buffer))
            self._weight_buffers.append(buffer)
            log.debug("weights allocated", extra={
                "device": device.name, "buffer_type": ggml_backend.buffer_type_name(buft),
                "tensors": len(handles), "bytes": ggml_backend.buffer_size(buffer)})

    def _map_weights(self, entries: list[tuple[object, object]], buft) -> list:
        """Point the weights whose file bytes are ggml's at the mapped file (llama.cpp's mmap) and return
        the handles of the rest (converted at load), to be allocated. Nothing is read until a graph reads it."""
        mappable = [(handle, info) for handle, info in entries if info.conversion is None]
        if not mappable:
            return [handle for handle, _ in entries]
        start = min(info.offset for _, info in mappable)
        stop = max(info.offset + info.n_bytes for _, info in mappable)
        fd = os.open(self.model.path, os.O_RDONLY)
        try:
            mapping = ggml_backend.MappedFile(fd, start, stop - start)
        finally:
            os.close(fd)
        self._mappings.append(mapping)
        for handle, info in mappable:
            mapping.place(handle, info.offset)
            self._mapped[ggml.get_name(handle)] = ggml_backend.padded_alloc_size(buft, handle)
        return [handle for handle, info in entries if info.conversion is not None]

    def repacked_weights(self) -> set[str]:
        """The weights stored in a repacked layout (written whole at load; their bytes are not the file's)."""
        return set(self._repacked)

    def get(self, name: str) -> Tensor | None:
        return self.weights.get(name)

    # ------------------------------------------------------------ scheduler

    def _create_scheduler(self, num_threads: int) -> None:
        used = {id(d.handle) for d in self.layer_devices}
        self.compute_devices = [gpu for gpu in self.gpus if id(gpu.handle) in used] + [self.cpu]
        for device in self.compute_devices:
            backend = ggml_backend.init_backend(device.handle)
            self._backends.append(backend)
        ggml_backend.set_threads(self._backends[-1], num_threads)
        self.num_threads = num_threads
        self.max_graph_nodes = max(1024, 32 * len(self.weights))
        compute_buffer_types = [d.buffer_type for d in self.compute_devices[:-1]]
        compute_buffer_types.append(self._cpu_compute_buffer_type())
        self.scheduler = ggml_backend.Scheduler(self._backends, compute_buffer_types, self.max_graph_nodes,
                                                op_offload=self.op_offload)

    @property
    def cpu_only(self) -> bool:
        """Every graph computes on the CPU (no GPU holds a layer)."""
        return self.compute_devices == [self.cpu]

    def fills_cpus(self) -> bool:
        """Whether every graph computes on the CPU alone with a thread on each CPU this process may use: then
        any other thread that runs during a compute takes a core from one of ggml's (whose barriers wait for it)."""
        return self.cpu_only and self.num_threads >= default_threads()

    def _cpu_compute_buffer_type(self):
        """Beside a GPU, the first GPU's pinned host memory, as llama.cpp's: the activations that cross between
        the CPU's split and the GPU's (the token embeddings each step) are copied by DMA, asynchronously, not
        staged through pageable memory. Otherwise ggml's CPU type with every tensor on a cache line (ggml's
        own aligns to 32 bytes)."""
        return self._pinned_host_type() or ggml_backend.cpu_cache_line_buffer_type()

    def reserve(self, graph) -> None:
        """Make room for this graph's compute buffers (fit: only measure); Graph keeps the maximum."""
        assert self.scheduler is not None
        self.allocated_graph = None
        sizes = self.scheduler.reserve_size(graph)
        for device, size in zip(self.compute_devices, sizes, strict=True):
            report = self._report(device)
            report.graph = max(report.graph, size)
            if self._reserving is not None:
                self._reserving[report.device_id] = max(self._reserving.get(report.device_id, 0), size)
        if self.allocate:
            over = not all(self._within_limit(d) for d in self.compute_devices)
            if over or not self.scheduler.reserve(graph):
                raise NoMemory(self.memory)

    @contextlib.contextmanager
    def reserving(self) -> Iterator[dict[DeviceID, int]]:
        """What the graphs reserved inside the block need per device, the largest of them: a vision tower's image
        graph shares the text model's compute buffers, and its own size is reported beside them."""
        self._reserving = needs = {}
        try:
            yield needs
        finally:
            self._reserving = None

    @contextlib.contextmanager
    def time_ops(self) -> Iterator[dict[str, float]]:
        """Seconds per kind of node (ggml.node_kind) over every graph computed inside the block.

        Meanwhile nodes run one at a time, which is slower as a whole but compares op with op
        (bench/profile_ops.py sets ours beside llama.cpp's).
        """
        times: dict[str, float] = collections.defaultdict(float)

        def record(node, seconds: float) -> None:
            times[ggml.node_kind(node)] += seconds

        with self.eval_callback(ggml_backend.NodeTimer(record)):
            yield times

    @contextlib.contextmanager
    def eval_callback(self, callback: ggml_backend.EvalCallback) -> Iterator[None]:
        """Graphs computed inside the block hand their nodes to `callback` (e.g. a TensorCapture)."""
        assert self.scheduler is not None
        self.scheduler.set_eval_callback(callback)
        try:
            yield
        finally:
            self.scheduler.set_eval_callback(None)

    def allocated(self) -> dict[str, int]:
        """Bytes really allocated per device name (buffers and compute buffers), to check the report against."""
        totals = {device.name: 0 for device in (self.cpu, *self.gpus)}
        for device, buffer in self._buffers:
            totals[device.name] += ggml_backend.buffer_size(buffer)
        totals[self.cpu.name] += sum(self._mapped.values())  # the mapped file's bytes that are weights
        if self.scheduler is not None:
            for device, size in zip(self.compute_devices, self.scheduler.buffer_sizes(), strict=True):
                totals[device.name] += size
        return totals

    def new_context(self, max_nodes: int | None = None):
        from .context import Context

        return Context(self, max_nodes or self.max_graph_nodes)

    # ------------------------------------------------------------ loading

    def load(self, progress: Callable[[float], None] | None = None, workers: int | None = None) -> None:
        """Read every tensor's bytes from the file into its buffer(s), reporting progress from 0 to 1.

        The file is read (pread, which releases the GIL), not mapped: the pages of a mapped file count in
        the process's resident set while it is mapped, which put the whole file on top of the weights in
        the peak RSS. A tensor in host memory in ggml's plain layout is read in place; one that is
        repacked is converted whole, so it is read whole; others (device memory) go through a chunk
        of the thread's own.
        """
        if not self.allocate or self.model is None:
            raise RuntimeError("cannot load model without memory allocation")
        infos = [info for info in self.model.tensors.values() if info.name in self._load_targets]
        total = sum(info.n_bytes for info in infos) or 1
        done = 0
        lock = threading.Lock()
        chunks = threading.local()

        def advance(size: int) -> None:
            nonlocal done
            with lock:
                done += size
                if progress is not None:
                    progress(min(done / total, 1.0))

        def load_one(fd: int, info) -> None:
            targets = self._load_targets[info.name]
            mapped = [target for target in targets if target.name in self._mapped]
            if mapped:  # already the file's bytes; other placements (a repacked copy) are written from them
                source = ggml.host_bytes(mapped[0].handle)
                for target in targets:
                    if target.name not in self._mapped:
                        ggml.write_bytes(target.handle, source)
                advance(info.n_bytes)
                return
            if info.conversion is not None:
                load_converted(fd, info, targets)
                return
            direct = ggml.host_bytes(targets[0].handle)
            if direct is not None:  # plain layout in host memory: read in place, no copy
                read_at(fd, info.offset, direct)
                for target in targets[1:]:
                    ggml.write_bytes(target.handle, direct)
                advance(info.n_bytes)
                return
            if any(target.name in self._repacked for target in targets):
                # np.empty, not bytearray(), which zeroes its bytes holding the GIL: /health timed out behind 141 MiB
                data = read_at(fd, info.offset, memoryview(np.empty(info.n_bytes, np.uint8)))
                for target in targets:
                    ggml.write_bytes(target.handle, data)
                advance(info.n_bytes)
                return
            if not hasattr(chunks, "buffer"):
                chunks.buffer = memoryview(np.empty(LOAD_CHUNK, np.uint8))
            for start in range(0, info.n_bytes, LOAD_CHUNK):
                size = min(LOAD_CHUNK, info.n_bytes - start)
                chunk = read_at(fd, info.offset + start, chunks.buffer[:size])
                for target in targets:
                    ggml.write_bytes(target.handle, chunk, start)
                advance(size)

        def load_converted(fd: int, info, targets: list[Tensor]) -> None:
            """A tensor whose file bytes are not ggml's (TensorInfo.conversion), converted a chunk of whole
            blocks at a time; a repacked one is gathered and written whole (ggml repacks in one piece)."""
            conversion = info.conversion
            step = LOAD_CHUNK // conversion.file_block * conversion.file_block
            whole = np.empty(info.ggml_bytes, np.uint8) if any(t.name in self._repacked for t in targets) else None
            for start in range(0, info.n_bytes, step):
                size = min(step, info.n_bytes - start)
                raw = np.asarray(read_at(fd, info.offset + start, memoryview(np.empty(size, np.uint8))))
                data, at = conversion.convert(raw), conversion.ggml_bytes(start)
                if whole is not None:
                    whole[at : at + data.size] = data
                else:
                    for target in targets:
                        ggml.write_bytes(target.handle, data, at)
                advance(size)
            if whole is not None:
                for target in targets:
                    ggml.write_bytes(target.handle, whole)

        fd = os.open(self.model.path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 2)) as pool:
                for future in [pool.submit(load_one, fd, info) for info in infos]:
                    future.result()
        finally:
            os.close(fd)
        if self.huge_pages == "collapse" and self._collapser is None:
            self._collapser = threading.Thread(target=self._collapse_huge_pages, name="huge-pages", daemon=True)
            self._collapser.start()
        if progress is not None:
            progress(1.0)
        log.info("model loaded", extra={"tensors": len(infos), "bytes": total})

    def _collapse_huge_pages(self) -> None:
        """Move the loaded weights onto 2 MiB pages (decoding is 4-11% faster there), off the time to ready.

        A step at a time, only while no graph has been computed for COLLAPSE_IDLE seconds, under the
        compute lock: a request meanwhile runs on 4 KiB pages and waits for one step at most (collapsing
        beside a compute slowed a 1B model's first token from 2.5 s to 14 s on a busy 2-core machine).
        Advised first: where the kernel cannot collapse, khugepaged does it, slowly.
        """
        for buffer in self._weight_buffers:
            ggml_backend.advise_huge_pages(buffer)
        steps = [step for buffer in self._weight_buffers for step in ggml_backend.huge_page_steps(buffer)]
        for address, size in steps:
            while True:
                if self._stop_collapse.is_set():
                    return
                with self.compute_lock:
                    if time.monotonic() - self.last_compute >= COLLAPSE_IDLE:
                        moved = ggml_backend.collapse_huge_pages(address, size)
                        break
                self._stop_collapse.wait(COLLAPSE_IDLE)
            if not moved:
                return
        log.debug("weights on huge pages", extra={"steps": len(steps)})

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        self._stop_collapse.set()
        if self._collapser is not None:
            self._collapser.join()
            self._collapser = None
        if self.scheduler is not None:
            self.scheduler.free()
            self.scheduler = None
        for backend in self._backends:
            ggml_backend.free_backend(backend)
        self._backends = []
        for _, buffer in self._buffers:
            ggml_backend.free_buffer(buffer)
        self._buffers = []
        for mapping in self._mappings:
            mapping.close()
        self._mappings = []
        self._mapped = {}
        self._weight_buffers = []
        self._placeholders = {}
        for ctx in self._weight_contexts:
            ggml.free_context(ctx)
        self._weight_contexts = []
        self.weights = {}

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_at(fd: int, offset: int, into: memoryview) -> memoryview:
    """Fill `into` with the file's bytes from `offset`; a file that ends sooner is an error."""
    filled = 0
    while filled < len(into):
        n = os.preadv(fd, [into[filled:]], offset + filled)
        if n == 0:
            raise OSError(f"model file ends at byte {offset + filled}, inside a tensor's data")
        filled += n
    return into


__all__ = ["Backend", "GGMLType", "Placement", "TensorCapture", "TensorGroups"]
