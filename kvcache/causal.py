"""Causal: the self-attention cache (Ollama's kvcache.Causal), full, sliding-window or chunked.

The bookkeeping is two arrays over the cells: the position each cell holds, and which sequences use
it (several, after copy_prefix). Cells need not be contiguous: a batch is written with set_rows at the
cell indices `prepare` chose, and the mask hides every cell a token must not see, stale ones included.
Everything done per step is vectorised numpy over the cells, because it runs for every decoded token.

Variants (all keyword arguments of the constructor):
- window_size: sliding-window attention, a token sees itself and the `window_size` positions before;
- memory_size: how many positions per sequence a sliding-window cache keeps (default: the window),
  so that a sequence can be resumed a little way back;
- chunk_size: chunked attention, a token sees only earlier tokens of its own chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ollama_engine.ml import Backend, Context, DType, ShapeError, Tensor

from .batch import Batch
from .cache import (
    CACHE_TYPES,
    QUANTIZED_TYPES,
    CacheConfig,
    CacheFullError,
    ShiftError,
    ShiftFn,
    backend_cache_config,
)

Layout = tuple[int, int, int]
"""(batch size, first history cell, history length): what a graph built for a batch depends on."""


_MASK_VALUES = {t: np.array([-np.inf, 0], dtype=t) for t in (np.float16, np.float32)}  # indexed by visibility


@dataclass(frozen=True)
class _Bound:
    """The inputs bind() created in one context: the arrays it writes at every compute, and their tensors."""

    serial: int  # of the context
    layout: Layout
    locs: np.ndarray
    mask: np.ndarray
    locs_tensor: Tensor
    mask_tensor: Tensor


class Causal:
    """A causal self-attention cache shared by all layers of a model (one key/value tensor per layer)."""

    def __init__(
        self,
        shift: ShiftFn | None = None,
        *,
        window_size: int | None = None,
        memory_size: int | None = None,
        chunk_size: int | None = None,
    ):
        for name, value in (("window_size", window_size), ("memory_size", memory_size), ("chunk_size", chunk_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if memory_size is not None and (window_size is None or memory_size < window_size):
            raise ValueError(
                f"sliding window memory ({memory_size}) must be at least as large as the window ({window_size})"
            )
        self._shift_fn = shift
        self._window = window_size  # None: unlimited
        self._memory_request = memory_size
        self._chunk = chunk_size
        self._config: CacheConfig | None = None
        self._backend: Backend | None = None

    # ------------------------------------------------------------ setup

    @property
    def config(self) -> CacheConfig:
        if self._config is None:
            raise RuntimeError("the cache has no configuration before init()")
        return self._config

    def set_config(self, config: CacheConfig) -> None:
        if self._config is not None:
            raise RuntimeError("the cache configuration cannot be changed once set")
        self._config = config

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int) -> None:
        if self._backend is not None:
            raise RuntimeError("the cache is already initialised")
        if dtype not in CACHE_TYPES.values():
            raise ValueError(f"unsupported kv cache type {dtype.name}: choose one of {', '.join(CACHE_TYPES)}")
        if min(max_sequences, capacity, max_batch) < 1:
            raise ValueError(f"cache sizes must be positive: {max_sequences=}, {capacity=}, {max_batch=}")
        if self._config is None:
            self._config = backend_cache_config(backend)
        if dtype in QUANTIZED_TYPES and self._config.permuted_v:
            raise ValueError(f"a {dtype.name} kv cache needs flash attention (it cannot store V transposed)")

        # `None` is unlimited memory: every position of every sequence is kept.
        memory = self._memory_request if self._memory_request is not None else self._window
        if memory is not None and max_sequences > 1:
            memory = max(memory, self._window + 1)  # room for a stop token that the next turn drops
        if memory is not None and memory >= capacity:
            memory = None
        self._memory = memory

        cells = max_sequences * capacity if memory is None else max_sequences * memory + max_batch
        padding = self._config.padding
        self._cells = math.ceil(cells / padding) * padding
        self._backend = backend
        self._dtype = dtype
        self._mask_dtype = np.float16 if self._config.mask_dtype == DType.F16 else np.float32
        self._max_batch = max_batch
        self._pos = np.zeros(self._cells, dtype=np.int64)
        self._member = np.zeros((max_sequences, self._cells), dtype=bool)  # [sequence, cell]
        self._storage = backend.new_context(2 * (backend.block_count + 1))
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}
        self._layer = 0
        self._batch: Batch | None = None
        self._bound: _Bound | None = None  # the inputs of the context bound last

    def close(self) -> None:
        if self._backend is not None:
            self._storage.close()
            self._keys, self._values = {}, {}
            self._backend = None

    @property
    def cells(self) -> int:
        return self._cells

    # ------------------------------------------------------------ a forward pass

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare(batch, reserve)
        self.bind(ctx)

    def prepare(self, batch: Batch, reserve: bool = False) -> Layout:
        """Choose the batch's cells (evicting what slid out of the window) and compute its mask.

        With reserve the bookkeeping is left alone and the whole cache is the history: the worst case
        a graph must be sized for.
        """
        self._require_init()
        n = len(batch)
        if n == 0:
            raise ValueError("cannot start a forward pass with an empty batch")
        if n > self._cells:
            raise CacheFullError(f"could not find a kv cache slot (cache: {self._cells} batch: {n})")
        self._sequences = list(dict.fromkeys(batch.sequences.tolist()))  # unique, cheaper than np.unique when small
        self._ensure_sequences(max(self._sequences) + 1)
        self._batch = None  # until the batch has its cells
        if reserve:
            locs = np.arange(n, dtype=np.int32)
            start, stop = 0, self._cells
        else:
            low, high = self._history_range(batch)
            locs = self._find_locs(n)
            first, last = int(locs[0]), int(locs[-1])
            if n == 1:  # a decode step: scalar stores cost a fraction of fancy indexing
                self._pos[first] = batch.positions[0]
                self._member[self._sequences[0], first] = True
            else:
                self._pos[locs] = batch.positions
                self._member[batch.sequences, locs] = True  # the cells were free: no other sequence uses them
            padding = self.config.padding
            start = min(low, first) // padding * padding
            stop = math.ceil(max(high, last + 1) / padding) * padding
        self._batch, self._reserve, self._except = batch, reserve, None
        self._locs, self._start, self._stop = locs, start, stop
        self._mask = self._build_mask()
        return self.layout

    @property
    def layout(self) -> Layout:
        self._require_batch()
        return (len(self._batch), self._start, self._stop - self._start)

    def bind(self, ctx: Context) -> None:
        """Create the batch's cell-index and mask inputs in ctx, or refill them if ctx already has them."""
        self._require_batch()
        bound = ctx.bindings.get(self)
        if isinstance(bound, _Bound) and bound.layout == self.layout:
            # The context keeps the arrays it was given and writes them at every compute.
            np.copyto(bound.locs, self._locs)
            np.copyto(bound.mask, self._mask)
        else:
            inputs = ctx.input()
            bound = _Bound(ctx.serial, self.layout, self._locs, self._mask,
                           inputs.from_numpy(self._locs).set_name("kv_cells"),
                           inputs.from_numpy(self._mask).set_name("kq_mask"))
            ctx.bindings[self] = bound
        self._bound = bound

    def set_causal(self, ctx: Context, except_indices: Sequence[int] = ()) -> None:
        """Let the listed batch entries see the whole batch (e.g. image tokens); reset by every prepare."""
        self._require_bound(ctx)
        flags = None  # None: no exceptions, as every prepare() leaves it
        if len(except_indices):
            flags = np.zeros(len(self._batch), dtype=bool)
            flags[list(except_indices)] = True
        unchanged = (self._except is None if flags is None
                     else self._except is not None and np.array_equal(flags, self._except))
        if unchanged:
            return
        self._except = flags
        self._mask = self._build_mask()
        np.copyto(self._bound.mask, self._mask)

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self._require_bound(ctx)
        n = len(self._batch)
        if key.ne[2] != n or value.ne[2] != n or key.ne[3] != 1 or value.ne[3] != 1:
            raise ShapeError(f"put: key {key.shape} and value {value.shape} for a batch of {n}")
        keys, values = self._layer_tensors(key, value)
        k_width, v_width = key.ne[0] * key.ne[1], value.ne[0] * value.ne[1]
        ctx.forward(Tensor(ctx, keys.handle).reshape(k_width, self._cells).set_rows(
            key.reshape(k_width, n), self._bound.locs_tensor))
        if self.config.permuted_v:
            # one-element rows: cell index fastest, so each (dim, head) is a contiguous run of cells
            rows = value.reshape(v_width, 1, n).permute(2, 0, 1, 3)
            target = Tensor(ctx, values.handle).reshape(1, self._cells, v_width)
        else:
            rows = value.reshape(v_width, n)
            target = Tensor(ctx, values.handle).reshape(v_width, self._cells)
        ctx.forward(target.set_rows(rows, self._bound.locs_tensor))

    def get(self, ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        self._require_bound(ctx)
        if self._layer not in self._keys:
            raise RuntimeError(f"get() before put() for layer {self._layer}")
        keys, values = self._keys[self._layer], self._values[self._layer]
        length = self._stop - self._start
        key = Tensor(ctx, keys.handle).view(keys.strides[2] * self._start, (keys.ne[0], keys.ne[1], length))
        if self.config.permuted_v:
            value = Tensor(ctx, values.handle).view(
                values.strides[0] * self._start, (length, values.ne[1], values.ne[2]))
        else:
            value = Tensor(ctx, values.handle).view(
                values.strides[2] * self._start, (values.ne[0], values.ne[1], length))
        return key, value, self._bound.mask_tensor

    # ------------------------------------------------------------ sequences

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        self._require_init()
        self._ensure_sequences(max(source, destination) + 1)
        self._member[destination] = self._member[source] & (self._pos < length)

    def can_resume(self, seq: int, position: int) -> bool:
        self._require_init()
        if self._memory is None:
            return True
        if seq >= len(self._member) or not self._member[seq].any():
            return False
        stored = self._pos[self._member[seq]]
        return max(0, position - self._window) >= stored.min() and position <= stored.max() + 1

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        self._require_init()
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"cannot remove positions [{begin}, {end}) of sequence {seq}")
        if seq >= len(self._member):
            return
        cells = self._member[seq].copy()
        removed = cells & (self._pos >= begin)
        if end is not None:
            removed &= self._pos < end
        # Positions at or after a finite end move down by end - begin; checked before anything changes.
        moved = cells & (self._pos >= end) if end is not None and end > begin else np.zeros_like(cells)
        if moved.any():
            if (self._member[:, moved].sum(axis=0) > 1).any():
                raise ShiftError("shifting cells shared by multiple sequences not supported")
            if self._shift_fn is None:
                raise ShiftError("model does not support operation")
        self._member[seq, removed] = False
        if moved.any():
            self._pos[moved] += begin - end
            self._shift_keys(moved, begin - end)

    def _shift_keys(self, moved: np.ndarray, offset: int) -> None:
        """Re-rotate the moved cells' keys by `offset`, at most max_batch cells per graph."""
        assert self._shift_fn is not None
        cells = np.flatnonzero(moved)
        i = 0
        while i < len(cells):
            start = int(cells[i])
            j = int(np.searchsorted(cells, start + self._max_batch))
            stop = int(cells[j - 1]) + 1
            deltas = np.where(moved[start:stop], offset, 0).astype(np.int32)
            with self._backend.new_context() as ctx:
                delta_tensor = ctx.input().from_numpy(deltas)
                for layer, keys in self._keys.items():
                    view = Tensor(ctx, keys.handle).view(
                        keys.strides[2] * start, (keys.ne[0], keys.ne[1], stop - start))
                    shifted = self._shift_fn(ctx, layer, view, delta_tensor)
                    ctx.forward(shifted.copy_to(view))
                ctx.compute()
            i = j

    # ------------------------------------------------------------ internals

    def _require_init(self) -> None:
        if self._backend is None:
            raise RuntimeError("the cache is not initialised (call init() first)")

    def _require_batch(self) -> None:
        self._require_init()
        if self._batch is None:
            raise RuntimeError("no batch: call start_forward() (or prepare()) first")

    def _require_bound(self, ctx: Context) -> None:
        self._require_batch()
        if self._bound is None or ctx.serial != self._bound.serial or self._bound.layout != self.layout:
            raise RuntimeError("the batch is not bound to this context: call start_forward() (or bind()) with it")

    def _ensure_sequences(self, count: int) -> None:
        """Sequence ids index the membership rows; add rows for a sequence id not seen before."""
        extra = count - len(self._member)
        if extra > 0:
            self._member = np.concatenate([self._member, np.zeros((extra, self._cells), dtype=bool)])

    def _history_range(self, batch: Batch) -> tuple[int, int]:
        """The cells [low, high) the batch's sequences may attend to; evicts cells beyond the memory."""
        low, high = self._cells, 0

        def include(cells: np.ndarray) -> None:
            nonlocal low, high
            first = int(cells.argmax())  # argmax, not any() or flatnonzero(): cheaper with cold caches
            if cells[first]:
                low, high = min(low, first), max(high, len(cells) - int(cells[::-1].argmax()))

        batch_sequences = self._sequences
        if self._memory is None:
            for seq in batch_sequences:
                include(self._member[seq])
            return low, high

        # The lowest position each sequence still needs: the batch's first token for the sequences in
        # it, the position after the last stored one for the others.
        lowest = {int(s): int(batch.positions[batch.sequences == s].min()) for s in batch_sequences}
        for seq in np.flatnonzero(self._member.any(axis=1)).tolist():
            in_batch = seq in lowest
            cells = self._member[seq]
            first = lowest[seq] if in_batch else int(self._pos[cells].max()) + 1
            cells &= self._pos >= first - self._memory  # in place: evicts from the bookkeeping
            if in_batch:
                include(cells & (self._pos >= first - self._window))
        return low, high

    def _find_locs(self, n: int) -> np.ndarray:
        """The first n free cells."""
        used = self._member.any(axis=0) if len(self._member) > 1 else self._member[0]
        if n == 1:  # every decode step: one pass over the cells, not three
            cell = int(used.argmin())
            if not used[cell]:
                return np.array([cell], dtype=np.int32)
        else:
            free = np.flatnonzero(~used)
            if free.size >= n:
                return free[:n].astype(np.int32)
        raise CacheFullError(f"could not find a kv cache slot (cache: {self._cells} batch: {n})")

    def _build_mask(self) -> np.ndarray:
        """(batch, history) of 0 where a token may attend to a cell and -inf where not."""
        dtype = self._mask_dtype
        batch = self._batch
        if self._reserve:
            return np.zeros((len(batch), self._stop - self._start), dtype=dtype)  # only sized, never read
        cell_pos = self._pos[self._start : self._stop]
        positions = batch.positions[:, None]
        causal = cell_pos <= positions
        if self._except is not None:
            causal |= self._except[:, None]
        sequences = self._sequences
        if len(sequences) == 1:  # one row of memberships, broadcast over the batch: no gathered copy
            visible = causal & self._member[sequences[0], self._start : self._stop]
        else:
            visible = causal & self._member[batch.sequences, self._start : self._stop]
        if self._chunk is not None:
            visible &= cell_pos >= positions - positions % self._chunk
        if self._window is not None:
            visible &= cell_pos >= positions - self._window
        return _MASK_VALUES[dtype][visible.view(np.uint8)]  # cheaper than np.where per decoded token

    def _layer_tensors(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's stored key and value, allocated (on the layer's device) at its first put()."""
        layer = self._layer
        if layer not in self._keys:
            storage = self._storage.layer(layer)
            k_dim, k_heads, v_dim, v_heads = key.ne[0], key.ne[1], value.ne[0], value.ne[1]
            self._keys[layer] = storage.zeros(self._dtype, k_dim, k_heads, self._cells).set_name(f"cache_k_l{layer}")
            if self.config.permuted_v:
                values = storage.zeros(self._dtype, self._cells, v_dim, v_heads)
            else:
                values = storage.zeros(self._dtype, v_dim, v_heads, self._cells)
            self._values[layer] = values.set_name(f"cache_v_l{layer}")
        keys, values = self._keys[layer], self._values[layer]
        v_shape = values.ne[1:3] if self.config.permuted_v else values.ne[0:2]
        if keys.ne[0:2] != key.ne[0:2] or v_shape != value.ne[0:2]:
            raise ShapeError(f"put: key {key.shape} / value {value.shape} differ from layer {layer}'s earlier ones")
        return keys, values
