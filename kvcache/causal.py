"""Causal: the self-attention cache (Ollama's kvcache.Causal), full, sliding-window or chunked.

Every sequence owns a region of the cells, as in llama.cpp's per-sequence KV streams: sequence s
stores its positions in cells [s * region, (s + 1) * region), first free cell first, and each
sequence of a batch attends to its own region only (a Segment of the batch). So a sequence's
attention reads the same cells, in the same order, over the same padded length, whatever other
sequences share its batches: its logits do not depend on other users' traffic (ggml's kernels
round differently for other shapes, and 8-bit activation quantization turns that rounding into
visible drift). Sharing a prefix between sequences copies the cells (copy_prefix).

The bookkeeping is two arrays over the cells: the position each cell holds and whether it is in use.
A batch is written with set_rows at the cell indices `prepare` chose, and each segment's mask hides
every cell a token must not see. Everything done per step is vectorised numpy over one region.

A sliding-window or chunked cache is a ring, as llama.cpp's (its default, swa_full off): a region of
memory + batch cells, not the whole context, so Gemma 3 at 32k tokens keeps 1 024 cells per sliding
layer instead of 32 768. Each sequence has a head; a batch takes the cells from the head on that are
free or hold a position the next token no longer needs, so position p lives in cell p mod region
whatever the batch sizes were (llama.cpp's find_slot places them the same way). A cache hit that drops
the tail puts the head after the last position kept, so the sequence continues in the cells a cold run
uses and computes the same numbers; after a context shift the head goes to cell 0, as llama.cpp's
seq_add puts it (so the ring first reuses the cells before the ones the shift freed).

Variants (all keyword arguments of the constructor):
- window_size: sliding-window attention, a token sees itself and the `window_size` positions before;
- memory_size: how many positions before the next token a sliding-window cache keeps, so that a sequence
  can be resumed a little way back (default: the window, as llama.cpp's find_slot reuses a cell; the ring
  has room for the window and the token, llama.cpp's n_swa, plus a batch);
- chunk_size: chunked attention, a token sees only earlier tokens of its own chunk (memory: a chunk);
- value_in_key: multi-head latent attention (DeepSeek-V2/V3), as llama.cpp's MLA cache: only keys are
  stored, and a key's first `value_in_key` features are its value (the compressed latent, the rest
  its roped part), so no value tensor exists and V is read as a view of K. put() takes the value
  only to check its shape: it must be what the key starts with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ollama_engine.ml import Backend, Context, DType, ShapeError, Tensor, hadamard_matrix

from .batch import Batch
from .cache import (
    CACHE_TYPES,
    QUANTIZED_TYPES,
    CacheConfig,
    CacheFullError,
    Segment,
    ShiftError,
    ShiftFn,
    backend_cache_config,
)

Layout = tuple[tuple[int, int, int, bool, int], ...]
"""Per segment (rows, first history cell, history length, rows apart, cells between the rows' histories): what a
graph built for a batch depends on."""


FLASH_SPLIT_HISTORY = 512  # ggml's CPU flash attention splits a lone row's history this long between threads

_MASK_VALUES = {t: np.array([-np.inf, 0], dtype=t) for t in (np.float16, np.float32)}  # indexed by visibility


class _Span(NamedTuple):
    """One sequence's rows of the prepared batch and the history cells they attend to (a tuple: made per step)."""

    begin: int  # first batch row
    count: int
    start: int  # first history cell
    length: int
    apart: bool = False  # each row attends as a one-row batch (Segment.apart)
    stride: int = 0  # apart: row r's history starts stride * r cells after start (0: one sequence's rows)


@dataclass(frozen=True)
class _Bound:
    """The inputs bind() created in one context: the arrays it writes at every compute, and their tensors."""

    serial: int  # of the context
    layout: Layout
    locs: np.ndarray
    masks: tuple[np.ndarray, ...]
    locs_tensor: Tensor
    mask_tensors: tuple[Tensor, ...]


def _together(spans: list[_Span]) -> list[_Span]:
    """One-row spans of a sequence's rows apart, as one span where every row has the same history (the usual
    case: the history's length changes at multiples of the padding), so that attention computes them together;
    else as they are."""
    first = spans[0]
    if len(spans) > 1 and all(span.start == first.start and span.length == first.length for span in spans):
        return [_Span(first.begin, len(spans), first.start, first.length, apart=True)]
    return spans


def _stacked(spans: list[_Span], shorter_than: float = math.inf) -> list[_Span]:
    """Runs of one-row spans of different sequences (decode steps) whose histories lie alike in their regions (the
    same length, at a regular distance), as one span apart: attention computes them in one set of products, each row
    in a slice of its own as a one-row batch computes it, so each sequence gets what it gets alone, instead of one
    set per sequence (llama.cpp's KV streams do the same; 4 streams of stories260K: 356 graph nodes -> 186)."""
    out: list[_Span] = []
    for span in spans:
        last = out[-1] if out else None
        if (last is not None and span.count == 1 and not span.apart and span.length == last.length < shorter_than
                and span.begin == last.begin + last.count and (last.stride or (last.count == 1 and not last.apart))):
            stride = span.start - last.start - last.stride * (last.count - 1)  # from the last row's history
            if stride > 0 and (last.count == 1 or stride == last.stride):
                out[-1] = _Span(last.begin, last.count + 1, last.start, last.length, apart=True, stride=stride)
                continue
        out.append(span)
    return out


class Causal:
    """A causal self-attention cache shared by all layers of a model (one key/value tensor per layer)."""

    def __init__(
        self,
        shift: ShiftFn | None = None,
        *,
        window_size: int | None = None,
        memory_size: int | None = None,
        chunk_size: int | None = None,
        value_in_key: int | None = None,
    ):
        for name, value in (("window_size", window_size), ("memory_size", memory_size), ("chunk_size", chunk_size),
                            ("value_in_key", value_in_key)):
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
        self._value_in_key = value_in_key
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

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int,
             value_dtype: DType | None = None) -> None:
        if self._backend is not None:
            raise RuntimeError("the cache is already initialised")
        value_dtype = dtype if value_dtype is None else value_dtype
        for t in (dtype, value_dtype):
            if t not in CACHE_TYPES.values():
                raise ValueError(f"unsupported kv cache type {t.name}: choose one of {', '.join(CACHE_TYPES)}")
        if min(max_sequences, capacity, max_batch) < 1:
            raise ValueError(f"cache sizes must be positive: {max_sequences=}, {capacity=}, {max_batch=}")
        if self._config is None:
            self._config = backend_cache_config(backend)
        if self._value_in_key is not None and self._config.permuted_v:  # V is a view of K, never transposed
            self._config = dataclasses.replace(self._config, permuted_v=False)
        if self._value_in_key is not None:
            value_dtype = dtype  # MLA: the value is part of the key
        # A quantized V cannot be stored transposed, which the attention without flash attention wants;
        # quantized keys work either way (as llama.cpp: only a quantized V needs flash attention).
        if value_dtype in QUANTIZED_TYPES and (self._config.permuted_v or
                                               (self._value_in_key is not None and not backend.flash_attention)):
            raise ValueError(f"a {value_dtype.name} V cache needs flash attention (it cannot store V transposed)")

        # `None` is unlimited memory: every position of the sequence is kept. A ring needs its memory plus
        # the batch being added (llama.cpp: n_swa + n_ubatch); one at least the capacity is no ring.
        memory = self._memory_request
        if memory is None and self._window is not None:
            memory = self._window + 1  # llama.cpp's n_swa: the window and the token itself
        elif memory is None and self._chunk is not None:
            memory = self._chunk
        if memory is not None and memory + max_batch >= capacity:
            memory = None
        self._memory = memory
        # what a ring keeps before the next token: the memory asked for, else what the window reaches (llama.cpp
        # reuses a cell once its sequence's next position minus the cell's is n_swa: one less than it sizes for)
        self._kept = self._memory_request or (self._window if self._window is not None else memory)
        cells = capacity if memory is None else memory + max_batch
        padding = self._config.padding
        self._region = math.ceil(cells / padding) * padding
        self._sequences = max_sequences
        self._cells = max_sequences * self._region
        self._backend = backend
        self._dtype = dtype
        self._value_dtype = value_dtype
        self._mask_dtype = np.float16 if self._config.mask_dtype == DType.F16 else np.float32
        self._max_batch = max_batch
        self._pos = np.zeros(self._cells, dtype=np.int64)
        self._used = np.zeros(self._cells, dtype=bool)
        self._heads = np.zeros(max_sequences, dtype=np.int64)  # a ring's next cell, per sequence
        self._storage = backend.new_context(2 * (backend.block_count + 1))
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor | None] = {}
        self._layer = 0
        self._batch: Batch | None = None
        self._bound: _Bound | None = None  # the inputs of the context bound last
        self._repeatable = False  # repeat() may place the prepared batch again (see there)

    def close(self) -> None:
        if self._backend is not None:
            self._storage.close()
            self._keys, self._values = {}, {}
            self._backend = None

    @property
    def cells(self) -> int:
        return self._cells

    @property
    def region(self) -> int:
        """Cells per sequence."""
        return self._region

    # ------------------------------------------------------------ a forward pass

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare(batch, reserve)
        self.bind(ctx)

    def prepare(self, batch: Batch, reserve: bool = False) -> Layout:
        """Choose the batch's cells (evicting what slid out of the window) and compute its masks.

        Each sequence's rows must be consecutive in the batch. With reserve the bookkeeping is left
        alone and every sequence's whole region is its history: the worst case a graph is sized for.
        """
        self._require_init()
        n = len(batch)
        if n == 0:
            raise ValueError("cannot start a forward pass with an empty batch")
        runs = self._runs(batch)
        self._batch = None  # until the batch has its cells
        region = self._region
        if reserve:
            locs = np.arange(n, dtype=np.int32) % self._cells
            spans = [_Span(begin, count, seq * region, region) for seq, begin, count in runs]
        else:
            locs = np.empty(n, dtype=np.int32)
            spans = []
            try:
                for seq, begin, count in runs:
                    if seq in batch.apart:
                        rows = [self._place(batch, seq, begin + i, 1, locs) for i in range(count)]
                        # ggml's fused kernel computes each of fewer than 64 query rows alone anyway
                        spans += rows if self._backend.flash_attention else _together(rows)
                    else:
                        spans.append(self._place(batch, seq, begin, count, locs))
            except CacheFullError:
                for span in spans:  # give back the cells of the sequences placed before
                    self._used[locs[span.begin : span.begin + span.count]] = False
                raise
        if not reserve and len(spans) > 1 and (shorter_than := self._stack_limit()):
            spans = _stacked(spans, shorter_than)
        self._batch, self._reserve, self._except = batch, reserve, None
        self._locs, self._spans = locs, spans
        self._layout = tuple(span[1:] for span in spans)  # _Span without its first row
        self._repeatable = not reserve
        self._masks = self._build_masks()
        return self._layout

    def _stack_limit(self) -> float:
        """The histories whose decode rows stack (0: none). With flash attention, ggml's CPU kernel splits a lone
        query row's history of 512 cells or more between its threads (ops.cpp, use_split_kv_path), where a stacked
        row's is summed by one thread: only shorter histories stack, and only where the CPU computes attention
        (a GPU's fused kernels are chosen by other shapes)."""
        if not self._backend.flash_attention:
            return math.inf
        return FLASH_SPLIT_HISTORY if self._backend.cpu_only else 0

    @property
    def layout(self) -> Layout:
        self._require_batch()
        return self._layout

    def bind(self, ctx: Context) -> None:
        """Create the batch's cell-index and mask inputs in ctx, or refill them if ctx already has them."""
        self._require_batch()
        bound = ctx.bindings.get(self)
        if isinstance(bound, _Bound) and bound.layout == self.layout:
            # The context keeps the arrays it was given and writes them at every compute.
            np.copyto(bound.locs, self._locs)
            for target, mask in zip(bound.masks, self._masks, strict=True):
                np.copyto(target, mask)
        else:
            inputs = ctx.input()
            masks = tuple(self._masks)
            bound = _Bound(
                ctx.serial, self.layout, self._locs, masks,
                inputs.from_numpy(self._locs).set_name("kv_cells"),
                tuple(inputs.from_numpy(mask).set_name(f"kq_mask-{i}") for i, mask in enumerate(masks)),
            )
            ctx.bindings[self] = bound
        self._bound = bound

    def repeat(self, ctx: Context) -> bool:
        """Place the prepared batch again, each row one position on: its positions, cell indices and masks changed
        in place, here and in ctx's inputs (ctx: the context bound last). For decode steps (one row per sequence),
        in the cells and with the layout prepare() would give them, so a graph computes the next step with nothing
        built or bound anew but its tokens (models.Graphs.repeat). False, with nothing changed, where prepare() must
        place it: a sliding window or chunks (cells leave the masks), the cache changed since (a removal, a copy, a
        shift), a sequence with several rows, a history growing past its padded length, a full region."""
        bound = self._bound
        if (not self._repeatable or self._window is not None or self._chunk is not None or self._memory is not None
                or bound is None or bound.serial != ctx.serial or bound.layout != self._layout):
            return False
        sequences = self._batch.sequences
        placed = []  # (span, row in it, cell, first cell of its history)
        for k, span in enumerate(self._spans):
            if span.count > 1 and not span.stride:
                return False
            for i in range(span.count):
                cells = self._cells_of(int(sequences[span.begin + i]))
                cell = cells.start + int(self._used[cells].argmin())
                first = span.start + span.stride * i
                if self._used[cell] or not first <= cell < first + span.length:
                    return False
                placed.append((k, i, cell, first))
        positions = self._batch.positions
        for k, i, cell, first in placed:
            row = self._spans[k].begin + i
            positions[row] += 1
            self._pos[cell] = positions[row]
            self._used[cell] = True
            self._locs[row] = bound.locs[row] = cell
            self._masks[k][i, cell - first] = bound.masks[k][i, cell - first] = 0  # now seen
        return True

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
        self._repeatable = False
        self._masks = self._build_masks()
        for target, mask in zip(self._bound.masks, self._masks, strict=True):
            np.copyto(target, mask)

    def set_layer(self, layer: int) -> None:
        self._layer = layer

    def rotations(self, ctx: Context, k_dim: int, v_dim: int) -> tuple[Tensor | None, Tensor | None]:
        """Walsh-Hadamard matrices for queries and keys, and for values, when the cache is quantized.

        As llama.cpp does, keys (with the queries, so their dot products stay the same) and values are
        rotated before they are quantized into the cache, and the attention output is rotated back: a
        rotation spreads a head's few large values over all its dimensions, so a 32-wide block no
        longer rounds away the small values beside a large one. Keys use the largest power of two that
        divides their size, values 64 (llama.cpp's choices); None where that half of the cache is not
        quantized or its size is not a multiple of 64.
        """
        self._require_init()
        if self._value_in_key is not None:  # llama.cpp rotates no MLA cache
            return None, None
        k_size = k_dim & -k_dim if k_dim % 64 == 0 and self._dtype in QUANTIZED_TYPES else None
        v_size = 64 if v_dim % 64 == 0 and self._value_dtype in QUANTIZED_TYPES else None
        return (self._hadamard(ctx, k_size) if k_size else None, self._hadamard(ctx, v_size) if v_size else None)

    def _hadamard(self, ctx: Context, n: int) -> Tensor:
        """The (n, n) rotation as an input of ctx, created once per context."""
        key = (self, "hadamard", n)
        if key not in ctx.bindings:
            ctx.bindings[key] = ctx.input().from_numpy(hadamard_matrix(n)).set_name(f"hadamard-{n}")
        return ctx.bindings[key]

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self._require_bound(ctx)
        n = len(self._batch)
        if key.ne[2] != n or value.ne[2] != n or key.ne[3] != 1 or value.ne[3] != 1:
            raise ShapeError(f"put: key {key.shape} and value {value.shape} for a batch of {n}")
        keys, values = self._layer_tensors(key, value)
        k_width, v_width = key.ne[0] * key.ne[1], value.ne[0] * value.ne[1]
        # As llama.cpp writes its cache: the rows a view of the key and the cache's 2-D form already in the graph,
        # so that the key's ROPE, the VIEW and the SET_ROWS are adjacent nodes, which ggml-cuda fuses into one
        # kernel (a RESHAPE between, or the cache's reshape visited last, as SET_ROWS's third source, prevents it)
        key = key.packed()
        target = Tensor(ctx, keys.handle).reshape(k_width, self._cells)
        ctx.forward(target)
        ctx.forward(target.set_rows(key.view(0, (k_width, n), (key.strides[2],)), self._bound.locs_tensor))
        if values is None:
            return  # the value is the key's first features, stored with it
        if self.config.permuted_v:
            # one-element rows: cell index fastest, so each (dim, head) is a contiguous run of cells
            rows = value.reshape(v_width, 1, n).permute(2, 0, 1, 3)
            target = Tensor(ctx, values.handle).reshape(1, self._cells, v_width)
        else:
            rows = value.reshape(v_width, n)
            target = Tensor(ctx, values.handle).reshape(v_width, self._cells)
        ctx.forward(target.set_rows(rows, self._bound.locs_tensor))

    def get(self, ctx: Context) -> list[Segment]:
        self._require_bound(ctx)
        if self._layer not in self._keys:
            raise RuntimeError(f"get() before put() for layer {self._layer}")
        keys, values = self._keys[self._layer], self._values[self._layer]
        segments = []
        for span, mask in zip(self._spans, self._bound.mask_tensors, strict=True):
            key, value = self._cell_views(ctx, keys, values, span.start, span.length, span.count if span.stride else 1,
                                          span.stride)
            segments.append(Segment(span.begin, span.count, key, value, mask, span.apart))
        return segments

    # ------------------------------------------------------------ sequences

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Give destination a copy of source's cells for positions below length, in the same cells of its region.

        The same relative cells keep the destination's attention identical to the source's.
        """
        self._require_init()
        self._repeatable = False
        src, dst = self._cells_of(source), self._cells_of(destination)
        if source == destination:
            self._used[src] &= self._pos[src] < length
            self._heads[source] = self._after_last(source)
            return
        copied = self._used[src] & (self._pos[src] < length)
        self._used[dst] = copied
        self._pos[dst] = np.where(copied, self._pos[src], 0)
        self._heads[destination] = self._after_last(destination)
        if not copied.any() or not self._keys:
            return
        span = len(copied) - int(copied[::-1].argmax())  # up to the last copied cell
        with self._backend.new_context() as ctx:
            for layer, keys in self._keys.items():
                key, value = self._cell_views(ctx, keys, self._values[layer], src.start, span)
                key_to, value_to = self._cell_views(ctx, keys, self._values[layer], dst.start, span)
                ctx.forward(key.copy_to(key_to))
                if self._values[layer] is not None:
                    ctx.forward(value.copy_to(value_to))
            ctx.compute()

    def can_resume(self, seq: int, position: int) -> bool:
        self._require_init()
        if self._window is None and self._chunk is None:
            return True
        cells = self._cells_of(seq)
        used = self._used[cells]
        if not used.any():
            return False
        stored = self._pos[cells][used]
        return self._first_needed(position) >= stored.min() and position <= stored.max() + 1

    def _first_needed(self, position: int) -> int:
        """The earliest position a token at `position` attends to."""
        if self._window is not None:
            return max(0, position - self._window)
        return position - position % self._chunk if self._chunk is not None else 0

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        self._require_init()
        self._repeatable = False
        if begin < 0 or (end is not None and end < begin):
            raise ValueError(f"cannot remove positions [{begin}, {end}) of sequence {seq}")
        if not 0 <= seq < self._sequences:
            return
        cells = self._cells_of(seq)
        used, pos = self._used[cells], self._pos[cells]  # views: changing them changes the bookkeeping
        removed = used & (pos >= begin)
        if end is not None:
            removed &= pos < end
        # Positions at or after a finite end move down by end - begin; checked before anything changes.
        moved = used & (pos >= end) if end is not None and end > begin else np.zeros_like(used)
        if moved.any() and self._shift_fn is None:
            raise ShiftError("model does not support operation")
        used[removed] = False
        if moved.any():
            pos[moved] += begin - end
            kept = np.flatnonzero(used)  # the unmoved keys are turned by 0: see _shift_keys
            self._shift_keys(cells.start + kept, np.where(moved[kept], begin - end, 0).astype(np.int32))
            # llama.cpp's seq_add (after its seq_rm) starts the next search at cell 0 when no position went
            # below 0: a ring then reuses the out-of-window cells at its start before the cells freed here.
            # The same cells in the same order keep the attention's sums, and so the logits, bitwise.
            self._heads[seq] = 0
        else:
            self._heads[seq] = self._after_last(seq)

    def _after_last(self, seq: int) -> int:
        """The cell after the one holding the sequence's last position (0 when it holds none)."""
        cells = self._cells_of(seq)
        used = self._used[cells]
        if not used.any():
            return 0
        return (int(np.where(used, self._pos[cells], -1).argmax()) + 1) % self._region

    def _shift_keys(self, cells: np.ndarray, offsets: np.ndarray) -> None:
        """Re-rotate the keys of these (sorted) cells, each by its offset, at most max_batch cells per graph.

        A shift turns every key its sequence keeps, those that did not move by 0, as llama.cpp's shift graph
        does (it ropes every cell, k_shift 0 where none moved) and Ollama's Causal.shift over a sequence's
        range: with YaRN a rotation by 0 still multiplies by the magnitude ggml's RoPE applies (attention
        factor times 1 + 0.1 ln(factor)), so the kept keys get llama.cpp's scale too (without it a tiny
        laguna's logprobs after a shift were 0.29 from llama.cpp's). llama.cpp also scales the keys of every
        other sequence (its graph covers all streams); ours are left alone, so a shift stays its sequence's.
        """
        assert self._shift_fn is not None
        i = 0
        while i < len(cells):
            start = int(cells[i])
            j = int(np.searchsorted(cells, start + self._max_batch))
            stop = int(cells[j - 1]) + 1
            deltas = np.zeros(stop - start, dtype=np.int32)
            deltas[cells[i:j] - start] = offsets[i:j]
            with self._backend.new_context() as ctx:
                delta_tensor = ctx.input().from_numpy(deltas)
                for layer, keys in self._keys.items():
                    view = Tensor(ctx, keys.handle).view(
                        keys.strides[2] * start, (keys.ne[0], keys.ne[1], stop - start))
                    if self._dtype in QUANTIZED_TYPES:  # dequantize, undo the rotation, RoPE, redo, quantize
                        rotation, _ = self.rotations(ctx, keys.ne[0], 0)
                        plain = view.cast(DType.F32)
                        plain = plain.hadamard(rotation) if rotation is not None else plain
                        shifted = self._shift_fn(ctx, layer, plain, delta_tensor)
                        shifted = shifted.hadamard(rotation) if rotation is not None else shifted
                    else:
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

    def _cells_of(self, seq: int) -> slice:
        if not 0 <= seq < self._sequences:
            raise ValueError(f"sequence {seq} outside the cache's {self._sequences} sequences")
        return slice(seq * self._region, (seq + 1) * self._region)

    def _runs(self, batch: Batch) -> list[tuple[int, int, int]]:
        """(sequence, first row, rows) for each sequence of the batch, whose rows must be consecutive."""
        runs = batch.runs()
        if len(runs) > 1 and len({seq for seq, _, _ in runs}) != len(runs):
            raise ValueError(f"a batch must hold each sequence's tokens together, got sequences "
                             f"{batch.sequences.tolist()}")
        for seq, _, _ in runs:
            self._cells_of(seq)  # validates the id
        return runs

    def _place(self, batch: Batch, seq: int, begin: int, count: int, locs: np.ndarray) -> _Span:
        """Store one sequence's rows in cells of its region; the history they attend to."""
        cells = self._cells_of(seq)
        used, pos = self._used[cells], self._pos[cells]  # views of the region
        positions = batch.positions[begin : begin + count]
        first = int(positions[0]) if count == 1 else int(positions.min())
        if self._memory is not None:
            offsets = self._ring_cells(seq, used, pos, first, count)
        elif count == 1:  # a decode step: one pass over the region, scalar stores
            offset = int(used.argmin())
            if used[offset]:
                raise CacheFullError(f"could not find a kv cache slot (cache: {self._region} batch: 1)")
            offsets = None
        else:
            offsets = np.flatnonzero(~used)[:count].astype(np.int32)
            if len(offsets) < count:
                raise CacheFullError(f"could not find a kv cache slot (cache: {self._region} batch: {count})")
        if offsets is None:
            pos[offset] = first
            used[offset] = True
            locs[begin] = offset + cells.start
        else:
            pos[offsets] = positions
            used[offsets] = True
            locs[begin : begin + count] = offsets + cells.start
        visible = used if self._window is None else used & (pos >= first - self._window)
        low = int(visible.argmax())  # argmax, not flatnonzero(): cheaper with cold caches
        high = len(visible) - int(visible[::-1].argmax())
        padding = self.config.padding
        start = low // padding * padding
        stop = math.ceil(high / padding) * padding  # the region is a multiple of the padding
        return _Span(begin, count, cells.start + start, stop - start)

    def _ring_cells(self, seq: int, used: np.ndarray, pos: np.ndarray, first: int, count: int) -> np.ndarray:
        """The cells of a ring from the sequence's head on that are free or hold a position out of memory.

        As llama.cpp's find_slot; overwriting a position drops every earlier one of the sequence too
        (its apply_ubatch), so what a sequence keeps is always a run of positions.
        """
        last = int(pos.max(where=used, initial=-1))
        stale = min(first, last + 1) - self._kept  # positions below this are out of every row's memory
        head = int(self._heads[seq])
        if count == 1 and (not used[head] or pos[head] < stale):  # a decode step in steady state
            offsets = np.array([head], dtype=np.int32)
        else:
            order = np.roll(np.arange(self._region, dtype=np.int32), -head)
            offsets = order[(~used | (pos < stale))[order]][:count]
            if len(offsets) < count:
                raise CacheFullError(f"could not find a kv cache slot (cache: {self._region} batch: {count})")
        overwritten = used[offsets]
        if overwritten.any():
            used &= pos > pos[offsets][overwritten].max()  # in place: drops the bookkeeping of older positions
        self._heads[seq] = (int(offsets[-1]) + 1) % self._region
        return offsets

    def _build_masks(self) -> list[np.ndarray]:
        """Per segment, (rows, history) of 0 where a token may attend to a cell and -inf where not."""
        dtype = self._mask_dtype
        batch = self._batch
        masks = []
        for span in self._spans:
            if self._reserve:
                masks.append(np.zeros((span.count, span.length), dtype=dtype))  # only sized, never read
                continue
            if span.stride:  # each row its own sequence's history
                history = (span.start + span.stride * np.arange(span.count)[:, None]) + np.arange(span.length)
            else:
                history = slice(span.start, span.start + span.length)
            cell_pos = self._pos[history]
            # one row (a decode step): its position and flag as scalars, cheaper than broadcasting
            single = span.count == 1 and not span.stride
            rows = span.begin if single else np.s_[span.begin : span.begin + span.count, None]
            positions = batch.positions[rows]
            causal = cell_pos <= positions
            if self._except is not None:
                causal |= self._except[rows]
            used = self._used[history]
            visible = causal & used
            if self._repeatable and not np.array_equal(visible, used):
                self._repeatable = False  # a used cell it does not see (a later position): repeat() would show it
            if self._chunk is not None:
                visible &= cell_pos >= positions - positions % self._chunk
            if self._window is not None:
                visible &= cell_pos >= positions - self._window
            mask = _MASK_VALUES[dtype][visible.view(np.uint8)]  # cheaper than np.where per decoded token
            masks.append(mask.reshape(span.count, span.length))
        return masks

    def _cell_views(
        self, ctx: Context, keys: Tensor, values: Tensor | None, start: int, length: int, rows: int = 1,
        stride: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """Views of `length` cells from `start` of one layer's stored keys and values; with a stride, `rows` such
        runs `stride` cells apart along a fourth dimension (a stacked span's rows' histories)."""
        def cells(tensor: Tensor, dim: int, shape: tuple[int, ...]) -> Tensor:
            step = tensor.strides[dim]
            strides = tuple(tensor.strides[1:3])
            if stride:
                return tensor.view(step * start, (*shape, rows), (*strides, step * stride))
            return tensor.view(step * start, shape, strides)

        key = cells(Tensor(ctx, keys.handle), 2, (keys.ne[0], keys.ne[1], length))
        if values is None:  # MLA: the value is each key's first features
            return key, key.view(0, (self._value_in_key, keys.ne[1], length, *((rows,) if stride else ())))
        if self.config.permuted_v:
            return key, cells(Tensor(ctx, values.handle), 0, (length, values.ne[1], values.ne[2]))
        return key, cells(Tensor(ctx, values.handle), 2, (values.ne[0], values.ne[1], length))

    def _layer_tensors(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor | None]:
        """The layer's stored key and value (None: MLA's value is in the key), allocated (on the layer's
        device) at its first put()."""
        layer = self._layer
        if self._value_in_key is not None:
            if value.ne[0] != self._value_in_key or value.ne[1] != key.ne[1] or key.ne[0] <= self._value_in_key:
                raise ShapeError(f"put: value {value.shape} is not the first {self._value_in_key} features of "
                                 f"key {key.shape}")
        if layer not in self._keys:
            storage = self._storage.layer(layer)
            k_dim, k_heads, v_dim, v_heads = key.ne[0], key.ne[1], value.ne[0], value.ne[1]
            self._keys[layer] = storage.zeros(self._dtype, k_dim, k_heads, self._cells).set_name(f"cache_k_l{layer}")
            if self._value_in_key is not None:
                self._values[layer] = None
            else:
                if self.config.permuted_v:
                    values = storage.zeros(self._value_dtype, self._cells, v_dim, v_heads)
                else:
                    values = storage.zeros(self._value_dtype, v_dim, v_heads, self._cells)
                self._values[layer] = values.set_name(f"cache_v_l{layer}")
        keys, values = self._keys[layer], self._values[layer]
        if values is None:
            v_shape = (self._value_in_key, keys.ne[1])
        else:
            v_shape = values.ne[1:3] if self.config.permuted_v else values.ne[0:2]
        if keys.ne[0:2] != key.ne[0:2] or v_shape != value.ne[0:2]:
            raise ShapeError(f"put: key {key.shape} / value {value.shape} differ from layer {layer}'s earlier ones")
        return keys, values
