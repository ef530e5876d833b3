"""Context: where model code creates tensors and builds one compute graph.

Three kinds of tensor come from a context:
- graph inputs, from `ctx.input()` (or `ctx` itself): their memory is part of the graph's compute
  buffer on the CPU, and the values given at creation are written after the scheduler allocates it;
- stored tensors, from `ctx.layer(i)`: each gets its own buffer on layer i's device, counted as that
  layer's KV cache in the memory report (this is how caches are created), and lives until `close()`;
- graph nodes, from operations on tensors (see tensor.py).

`forward()` adds tensors to the graph, `compute()` runs it, `reserve()` sizes (or allocates) its
compute buffers without running it.
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import TYPE_CHECKING

import numpy as np

from ollama_engine import ggml
from ollama_engine.ggml import backend as ggml_backend
from ollama_engine.ggml import ops

from .compute_threads import run_compute
from .memory import NoMemory
from .tensor import DType, ShapeError, Tensor

if TYPE_CHECKING:
    from .model_backend import Backend


def _check_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if not 1 <= len(shape) <= ggml.MAX_DIMS or any(int(d) < 1 for d in shape):
        raise ShapeError(f"tensor shapes have 1 to 4 dimensions of at least 1, got {shape}")
    return tuple(int(d) for d in shape)


_serials = itertools.count(1)


class Context:
    """One graph under construction, plus the stored tensors created through it.

    Graph inputs keep the arrays they were given and write them at every compute (set_input() replaces
    one), so a graph built once can be computed again with new inputs; computed again right after
    itself, it keeps its compute buffers and skips the scheduler's allocation. `serial` identifies a
    context for its whole life (ggml handles of freed contexts get reused); its input()/layer() views
    share it, and share `bindings`, where a cache keeps the inputs it created in this context.
    """

    def __init__(self, backend: Backend, max_nodes: int):
        self.serial = next(_serials)
        self.backend = backend
        self.max_nodes = max_nodes
        # room for the graph's nodes, the views and reshapes between them, and the graph itself
        self.handle = ggml.new_context(3 * max_nodes, graph_nodes=max_nodes)
        self._layer: int | None = None  # set on the views returned by layer()
        self._inputs: dict[object, np.ndarray] = {}  # graph input handle -> the values to write
        self._named: dict[str, Tensor] = {}  # input_named()'s index
        self._stored: list = []  # the inputs that have memory in the allocated graph
        self.allocations = 0  # times the scheduler laid out this graph's memory: views of outputs change
        self.bindings: dict[object, object] = {}  # owner (e.g. a cache) -> the inputs it created here
        self.matmul_row_limits: dict[int, int] | None = None
        """Weight (ggml.storage_address) -> the most input rows one product may have: Tensor.matmul computes
        more in pieces of that many, so that each row takes the kernel a one-row batch takes."""
        self._forward: list[Tensor] = []
        self._graph = None
        self._built: list = []  # every graph built here: the scheduler keeps their sources until they are freed
        self._closed = False

    # ------------------------------------------------------------ where tensors go

    def input(self) -> Context:
        """Tensors created through the result are graph inputs on the CPU."""
        view = copy.copy(self)
        view._layer = None
        return view

    def layer(self, index: int) -> Context:
        """Tensors created through the result are stored on layer `index`'s device (KV cache)."""
        if not 0 <= index <= self.backend.block_count:
            raise IndexError(f"layer {index} out of 0..{self.backend.block_count}")
        view = copy.copy(self)
        view._layer = index
        return view

    # ------------------------------------------------------------ creating tensors

    def _create(self, dtype: DType, shape: tuple[int, ...]) -> Tensor:
        shape = _check_shape(shape)
        if shape[0] % ggml.block_size(dtype):
            raise ShapeError(f"{dtype.name} needs dim 0 to be a multiple of {ggml.block_size(dtype)}, got {shape}")
        if not ggml.context_has_room(self.handle):
            raise MemoryError("graph context is full: raise max_nodes")
        handle = ggml.new_tensor(self.handle, int(dtype), shape)
        if self._layer is not None:
            self.backend.allocate_tensor(self.backend.layer_device(self._layer), self._layer, handle)
            return Tensor(None, handle)  # stored tensors, like weights, belong to no graph
        ggml.mark_input(handle)
        return Tensor(self, handle)

    def empty(self, dtype: DType, *shape: int) -> Tensor:
        """Uninitialised (for graph inputs: filled by the graph, e.g. as a copy destination)."""
        return self._create(dtype, shape)

    def zeros(self, dtype: DType, *shape: int) -> Tensor:
        tensor = self._create(dtype, shape)
        if self._layer is None:
            self._inputs[tensor.handle] = np.zeros(tensor.nbytes, dtype=np.uint8)
        return tensor  # stored tensors are cleared when their buffer is allocated

    def from_numpy(self, values: np.ndarray, dtype: DType | None = None) -> Tensor:
        """A tensor holding `values` (F32/F16/I32...); the ggml shape is the numpy shape reversed."""
        values = np.asarray(values)
        dtype = dtype if dtype is not None else ggml.ggml_type_of(values.dtype)
        if dtype not in ggml.NUMPY_TYPES:
            raise ShapeError(f"from_numpy makes {dtype.name} tensors from raw blocks: use from_bytes")
        values = np.ascontiguousarray(values, dtype=ggml.NUMPY_TYPES[dtype])
        return self.from_bytes(dtype, values, *(reversed(values.shape) if values.ndim else (1,)))

    def from_bytes(self, dtype: DType, data: np.ndarray | bytes, *shape: int) -> Tensor:
        """A tensor of any type (quantized ones included) from its raw bytes."""
        if isinstance(data, bytes):
            raw = np.frombuffer(data, dtype=np.uint8)
        else:
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        tensor = self._create(dtype, shape)
        if raw.nbytes != tensor.nbytes:
            raise ShapeError(f"{raw.nbytes} bytes of data for a {dtype.name} tensor of {tensor.nbytes} bytes")
        if self._layer is None:
            self._inputs[tensor.handle] = raw
        elif self.backend.allocate:
            tensor.set(raw)
        return tensor

    def from_floats(self, values, *shape: int) -> Tensor:
        return self.from_numpy(np.asarray(values, dtype=np.float32).reshape(tuple(reversed(shape))))

    def from_ints(self, values, *shape: int) -> Tensor:
        return self.from_numpy(np.asarray(values, dtype=np.int32).reshape(tuple(reversed(shape))))

    def arange(self, start: float, stop: float, step: float = 1.0) -> Tensor:
        return self.from_numpy(np.arange(start, stop, step, dtype=np.float32))

    def set_input(self, tensor: Tensor | str, values: np.ndarray) -> None:
        """New values for a graph input (the tensor, or its name), written at the next compute.

        This is how a built graph is reused. The values must have the input's type and size.
        """
        if isinstance(tensor, str):
            named = self.input_named(tensor)
            if named is None:
                raise KeyError(f"this context has no graph input named {tensor!r}")
            tensor = named
        current = self._inputs.get(tensor.handle)
        if current is None:
            raise KeyError(f"{tensor!r} is not a graph input of this context")
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        if raw.nbytes != current.nbytes:  # the values it was created with had its size (per decoded token: no C call)
            raise ShapeError(f"{raw.nbytes} bytes of data for input {tensor!r} of {current.nbytes} bytes")
        self._inputs[tensor.handle] = raw

    def input_values(self) -> dict[str, bytes]:
        """Every graph input's name and the bytes it will be given at the next compute (unnamed ones as "")."""
        return {ggml.get_name(handle): raw.tobytes() for handle, raw in self._inputs.items()}

    def input_named(self, name: str) -> Tensor | None:
        """The graph input given this name with set_name(), or None."""
        if name not in self._named or self._named[name].handle not in self._inputs:
            self._named = {ggml.get_name(handle): Tensor(self, handle) for handle in self._inputs}
        return self._named.get(name)

    # ------------------------------------------------------------ the graph

    def forward(self, *tensors: Tensor) -> Context:
        """Add tensors (and everything they depend on) to the graph, in order."""
        self._forward.extend(tensors)
        return self

    def _build(self, outputs: tuple[Tensor, ...]):
        """The graph of everything forwarded plus outputs; built once, then reused while that set is unchanged."""
        key = (len(self._forward), *(t.handle for t in outputs))  # forward() only appends
        if self._graph is not None and self._graph[0] == key:
            return self._graph[1]
        for tensor in outputs:
            ggml.mark_output(tensor.handle)
        graph = ggml_backend.new_graph(self.handle, self.max_nodes)
        for tensor in (*self._forward, *outputs):
            if ggml_backend.graph_n_nodes(graph) >= self.max_nodes:
                raise MemoryError(f"graph has more than {self.max_nodes} nodes")
            ops.build_forward_expand(graph, tensor.handle)
        self._graph = (key, graph)
        self._built.append(graph)
        return graph

    def compute(self, *outputs: Tensor, read: Tensor | None = None) -> np.ndarray | None:
        """Run the graph; afterwards `outputs` (and forwarded tensors) can be read with numpy().

        read: a copy of this output, taken before another thread may compute on the backend (a graph's
        outputs live in the scheduler's compute buffers, which the next graph reuses).
        """
        graph = self._build(outputs if read is None else (*outputs, read))
        backend, scheduler = self.backend, self.backend.scheduler
        with backend.compute_lock:
            if backend.allocated_graph is not graph:
                backend.allocated_graph = None
                if not scheduler.alloc_graph(graph):  # from a reset scheduler and the graph as built
                    raise NoMemory(backend.memory)
                backend.allocated_graph = graph
                self.allocations += 1
                # inputs the graph never uses get no memory
                self._stored = [handle for handle in self._inputs if ggml.has_storage(handle)]
            for handle in self._stored:
                ggml.write_bytes(handle, self._inputs[handle])  # sizes were checked when the values were given
            started = time.perf_counter()
            try:
                run_compute(lambda: scheduler.compute(graph))  # on a thread that keeps no idle OpenMP pool
            finally:
                backend.last_compute = time.monotonic()
            backend.compute_seconds += time.perf_counter() - started
            return read.numpy() if read is not None else None

    def reserve(self, *outputs: Tensor) -> None:
        """Size the compute buffers this graph needs (and allocate them unless fitting)."""
        graph = self._build(outputs)
        with self.backend.compute_lock:
            self.backend.reserve(graph)

    def close(self) -> None:
        if not self._closed:
            if self._graph is not None and self.backend.allocated_graph is self._graph[1]:
                self.backend.allocated_graph = None
            if self.backend.scheduler is not None:
                for graph in self._built:
                    self.backend.scheduler.forget(graph)
            ggml.free_context(self.handle)
            self._closed = True

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
