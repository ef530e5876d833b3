"""Recurrent: per-sequence recurrent state beside a Causal cache (Ollama's kvcache.Recurrent), for hybrids.

A hybrid model (LFM2's short convolutions, Mamba-2, gated DeltaNet) has layers that keep a fixed-size
state per sequence instead of keys and values. Its attention layers use the Causal cache inside this one
(put, get and the rest are passed through); its recurrent layers read and write states here.

Every recurrent layer has one F32 tensor of rows, each row one whole state (all the layer's state kinds,
e.g. a conv state and an SSM state, side by side). The rows are a pool shared by all sequences:

    [0, S)                  slots: the live state of a sequence (S = max_sequences)
    [S, S + S * (C + K))    checkpoints: copies of a sequence's state after some position (C + K per sequence)
    ZERO = S + S * (C + K)  all zeros, never written: where a new sequence starts
    SCRATCH = ZERO + 1      written when a batch takes no checkpoint, never read

A sequence's state is a row (refcounted) and the position it has reached. A forward pass reads each
sequence's row and writes the new state to a row of its own, chosen in prepare(): the same row when the
sequence alone holds a slot, else a free slot (copy-on-write: forked sequences share one state until one
of them moves on, and a restored checkpoint is never written over). Which rows a graph reads and writes
are graph inputs, so a built graph serves every later batch of the same shape.

Checkpoints: after a batch, the state of a sequence is also written to a checkpoint row when the batch
ends its prompt (more than one token, the last of which wants logits) or `interval` positions have passed
since its last such checkpoint, from `min_position` on; each sequence keeps its newest C. A prompt batch
that ends at a multiple of the batch size is checkpointed too, but only until the next one does: the
runner's exact prompt-cache reuse (runner/exact.py) resumes at such boundaries, so the latest one lets a
chat's next turn resume at its previous prompt's last full batch.

Resume checkpoints (K per sequence beside the C): where `resume_rule` (set by the runner's exact prompt cache:
runner/exact.extension_resumes) says a later prompt extending a prompt of L inputs will resume, the batch that
ends the prompt also keeps the state after those positions, until the sequence's next prompt end replaces
them. Such a position lies inside the batch, so the model runs its recurrent op on the pieces the cuts make
(`splits`), each piece from the state the one before left, and stores the state at each cut (`keep`): ggml's
CPU kernels (ssm_conv, ssm_scan, gated_delta_net) go token by token from the state, so every row and the final
state are what one call computes, bitwise. Removing a sequence's
positions from p on (a prompt-cache hit that shares p inputs, a rollback) resumes from the checkpoint taken
after position p - 1 (`resume_position` finds the nearest one at or below a wanted position): no
recomputation from position 0, no copy (the checkpoint row is read in place). Forks share checkpoints too.

A context shift (removing positions in the middle) is refused with ShiftError: a state cannot forget some
of the tokens it has seen. The runner then clears the slot and evaluates the kept inputs again, as
Ollama's runner does when its cache cannot shift.

Each sequence of a batch is processed on its own (one segment per sequence, as the Causal cache attends),
so a sequence's results do not depend on the other sequences in its batches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ollama_engine.ml import Backend, Context, DType, ShapeError, Tensor

from .batch import Batch
from .cache import CacheConfig, CacheError, Segment, ShiftError, ShiftFn
from .causal import Causal

DEFAULT_CHECKPOINTS = 24  # Ollama's DefaultCheckpointCount, MinPos and Interval
DEFAULT_MIN_POSITION = 16
DEFAULT_INTERVAL = 1664
RESUME_CHECKPOINTS = 3  # as many as runner/exact.extension_resumes gives


class StateError(CacheError):
    """A batch does not continue a sequence from the position its recurrent state has reached."""


@dataclass
class _Sequence:
    row: int  # where the state lives: a slot, a checkpoint, or ZERO
    next: int  # the position the state has reached (-1: unknown until a checkpoint is restored)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (position, row), oldest first
    rolling: int | None = None  # the position of the checkpoint kept only until the next batch-aligned one
    held: int = 0  # with next -1: how many positions the sequence holds (its keys and values)
    resumes: set[int] = field(default_factory=set)  # checkpoints kept only until the next prompt end's


@dataclass(frozen=True)
class _Bound:
    serial: int
    layout: Hashable
    rows: np.ndarray  # (sequences, 3 + K): read, write, checkpoint and resume checkpoint rows of each sequence
    tensor: Tensor


class Recurrent:
    """Recurrent states per sequence for the layers in `state_sizes` (layer -> the sizes of its states,
    in floats), and a Causal cache for the attention layers."""

    def __init__(self, shift: ShiftFn | None, state_sizes: Mapping[int, Sequence[int]], *,
                 checkpoints: int = DEFAULT_CHECKPOINTS, interval: int = DEFAULT_INTERVAL,
                 min_position: int = DEFAULT_MIN_POSITION, resumes: int = RESUME_CHECKPOINTS,
                 **causal_options: int):
        if checkpoints < 0 or interval < 1 or min_position < 0 or resumes < 0:
            raise ValueError(f"checkpoints {checkpoints}, interval {interval}, min_position {min_position} and "
                             f"resumes {resumes} must be non-negative (interval positive)")
        if not state_sizes or any(not sizes or min(sizes) < 1 for sizes in state_sizes.values()):
            raise ValueError(f"every recurrent layer needs states of positive sizes, got {dict(state_sizes)}")
        self.causal = Causal(shift, **causal_options)
        self.state_sizes = {layer: tuple(sizes) for layer, sizes in state_sizes.items()}
        self.checkpoint_count = checkpoints
        self.interval = interval
        self.min_position = min_position
        self.resume_count = resumes
        self.resume_rule: Callable[[int, int, int, int], Sequence[int]] | None = None
        """(prompt length, first position of its last batch, that position's batch row, the batch's rows) ->
        the positions a later prompt extending it may resume at (None: keep none)."""
        self._backend: Backend | None = None

    # ------------------------------------------------------------ setup

    @property
    def config(self) -> CacheConfig:
        return self.causal.config

    def set_config(self, config: CacheConfig) -> None:
        self.causal.set_config(config)

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int,
             value_dtype: DType | None = None) -> None:
        """Size the causal cache, and allocate every recurrent layer's rows (so fit reports them per layer)."""
        self.causal.init(backend, dtype, max_sequences, capacity, max_batch, value_dtype=value_dtype)
        self._backend = backend
        self._slots = max_sequences
        self.zero = max_sequences * (1 + self.checkpoint_count + self.resume_count)
        self.scratch = self.zero + 1
        self._refs = np.zeros(self.scratch + 1, dtype=np.int64)
        self._sequences: dict[int, _Sequence] = {}
        self._storage = backend.new_context(len(self.state_sizes) + 1)
        self._states = {layer: self._storage.layer(layer).zeros(DType.F32, sum(sizes), self.scratch + 1)
                        .set_name(f"cache_r_l{layer}") for layer, sizes in self.state_sizes.items()}
        self._max_batch = max_batch
        self._layer = 0
        self._runs: list[tuple[int, int, int]] = []
        self._splits: list[tuple[int, ...]] = []
        self._rows = np.zeros((0, 3 + self.resume_count), dtype=np.int32)
        self._bound: _Bound | None = None

    def close(self) -> None:
        if self._backend is not None:
            self._storage.close()
            self._states = {}
            self._backend = None
        self.causal.close()

    def state_bytes(self, layer: int) -> int:
        """The bytes of layer's rows: its slots, checkpoints (resume checkpoints too), zero and scratch rows."""
        return self._states[layer].nbytes if layer in self._states else 0

    # ------------------------------------------------------------ a forward pass

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare(batch, reserve)
        self.bind(ctx)

    def prepare(self, batch: Batch, reserve: bool = False) -> Hashable:
        """Place the batch: cells for its keys and values, and for each sequence the rows its recurrent
        layers read and write. Returns the layout a graph depends on: the causal one and the sequences' runs
        with their splits."""
        self._require_init()
        runs = batch.runs()
        if not reserve:
            if batch.apart:
                raise StateError("recurrent layers cannot verify drafted tokens one by one (batch.apart)")
            for seq, begin, count in runs:
                expected = self._sequences[seq].next if seq in self._sequences else 0
                positions = batch.positions[begin:begin + count]
                if positions[0] != expected or not np.array_equal(positions, np.arange(expected, expected + count)):
                    raise StateError(f"sequence {seq}'s recurrent state is at position {expected}; a batch must "
                                     f"continue it with consecutive positions, got {positions[0]}..")
        layout = self.causal.prepare(batch, reserve)
        rows = np.full((len(runs), 3 + self.resume_count), self.scratch, dtype=np.int32)
        splits: list[tuple[int, ...]] = []
        for i, (seq, begin, count) in enumerate(runs):
            if reserve:  # the most pieces a batch can cut a run into: the largest graph
                rows[i, 0] = self.zero
                k = self.resume_count if count > self.resume_count else 0
                splits.append(tuple(count * (j + 1) // (k + 1) for j in range(k)))
            else:
                state = self._sequences.setdefault(seq, _Sequence(self.zero, 0))
                splits.append(self._advance(state, batch, begin, count, rows[i]))
        self._runs, self._rows, self._splits = runs, rows, splits
        return layout, self._layout()

    def _layout(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        return tuple((begin, count, cuts) for (_, begin, count), cuts in zip(self._runs, self._splits, strict=True))

    def repeat(self, ctx: Context) -> bool:
        return False  # the state rows move at every step: each batch is prepared

    def bind(self, ctx: Context) -> None:
        self.causal.bind(ctx)
        layout = self._layout()
        bound = ctx.bindings.get(self)
        if isinstance(bound, _Bound) and bound.layout == layout:
            np.copyto(bound.rows, self._rows)
        else:
            rows = self._rows.copy()
            bound = _Bound(ctx.serial, layout, rows, ctx.input().from_numpy(rows).set_name("rs_rows"))
            ctx.bindings[self] = bound
        self._bound = bound

    def spans(self) -> list[tuple[int, int]]:
        """(first row, rows) of each sequence of the prepared batch, in batch order."""
        return [(begin, count) for _, begin, count in self._runs]

    def splits(self, index: int) -> tuple[int, ...]:
        """Where the index-th sequence's rows are cut (offsets 0 < k < rows, ascending): its recurrent op runs
        on each piece in turn, from the state the piece before left, and keep() stores the state at each cut."""
        return self._splits[index]

    def state(self, ctx: Context, layer: int, index: int, kind: int = 0) -> Tensor:
        """State `kind` of layer for the index-th sequence of the batch, as it was before the batch: (size, 1)."""
        bound, states = self._require_bound(ctx), self._layer_states(layer)
        row = states.rows(self._row_index(bound, index, 0))
        offset, size = self._kind(layer, kind)
        return row if size == row.ne[0] else row.view(offset * 4, (size, 1))

    def update(self, ctx: Context, layer: int, index: int, values: Sequence[Tensor]) -> None:
        """Store layer's new states (one tensor per kind, any shape of the kind's size) for the index-th
        sequence: in its own row, and in a checkpoint row where prepare() planned one."""
        self._store(ctx, layer, index, values, (1, 2))

    def keep(self, ctx: Context, layer: int, index: int, cut: int, values: Sequence[Tensor]) -> None:
        """Store layer's states after the index-th sequence's first splits(index)[cut] rows (as update())."""
        if not 0 <= cut < len(self._splits[index]):
            raise IndexError(f"cut {cut} of sequence {index}'s {len(self._splits[index])}")
        self._store(ctx, layer, index, values, (3 + cut,))

    def _store(self, ctx: Context, layer: int, index: int, values: Sequence[Tensor], columns: Sequence[int]) -> None:
        bound, states = self._require_bound(ctx), self._layer_states(layer)
        sizes = self.state_sizes[layer]
        if len(values) != len(sizes) or any(v.element_count() != s for v, s in zip(values, sizes, strict=True)):
            raise ShapeError(f"layer {layer}'s states are {sizes} floats, got {[v.shape for v in values]}")
        flat = [v.contiguous().reshape(v.element_count(), 1) if v.dtype == DType.F32 else
                v.cast(DType.F32).reshape(v.element_count(), 1) for v in values]
        row = flat[0]
        for more in flat[1:]:
            row = row.concat(more, 0)
        target = Tensor(ctx, states.handle)
        for column in columns:
            ctx.forward(target.set_rows(row, self._row_index(bound, index, column)))

    # ------------------------------------------------------------ attention layers: the causal cache

    def set_layer(self, layer: int) -> None:
        self._layer = layer
        self.causal.set_layer(layer)

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self.causal.put(ctx, key, value)

    def get(self, ctx: Context) -> list[Segment]:
        return self.causal.get(ctx)

    def rotations(self, ctx: Context, k_dim: int, v_dim: int) -> tuple[Tensor | None, Tensor | None]:
        return self.causal.rotations(ctx, k_dim, v_dim)

    # ------------------------------------------------------------ sequences

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Let destination continue source's first `length` positions: its state (shared until one of them
        writes) where source is exactly there, else its checkpoint after position length - 1, else nothing
        until a checkpoint below is restored; and source's checkpoints below length."""
        self._require_init()
        self.causal.copy_prefix(source, destination, length)
        if source == destination:
            return
        src = self._sequences.get(source, _Sequence(self.zero, 0))
        self._release(destination)
        dst = _Sequence(self.zero, 0 if length == 0 else -1, held=length)
        dst.checkpoints = [(p, r) for p, r in src.checkpoints if p < length]
        dst.rolling = src.rolling if src.rolling is not None and src.rolling < length else None
        dst.resumes = {p for p in src.resumes if p < length}
        for _, r in dst.checkpoints:
            self._refs[r] += 1
        if length > 0:
            row = src.row if src.next == length else next((r for p, r in src.checkpoints if p == length - 1), None)
            if row is not None:
                dst.row, dst.next = row, length
                self._hold(row)
        self._sequences[destination] = dst

    def can_resume(self, seq: int, position: int) -> bool:
        self._require_init()
        if not self.causal.can_resume(seq, position):
            return False
        if position == 0:
            return True
        state = self._sequences.get(seq)
        return state is not None and (position == state.next or any(p == position - 1 for p, _ in state.checkpoints))

    def resume_position(self, seq: int, position: int) -> int:
        """The largest position at or below `position` the sequence can continue from (0 at worst): where its
        state is, or just after one of its checkpoints."""
        self._require_init()
        state = self._sequences.get(seq)
        if state is None:
            return 0
        candidates = [p + 1 for p, _ in state.checkpoints] + [state.next]
        return max((c for c in candidates if 0 < c <= position and self.can_resume(seq, c)), default=0)

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Drop positions from `begin` to the end: the state goes back to the checkpoint after begin - 1
        (ShiftError if there is none). Dropping positions in the middle is refused with ShiftError."""
        self._require_init()
        state = self._sequences.get(seq)
        if state is None or 0 <= state.next <= begin:  # nothing the state has seen goes
            self.causal.remove(seq, begin, end)
            return
        if end is not None and begin < end < (state.next if state.next >= 0 else state.held):
            raise ShiftError("recurrent state cannot be shifted")
        if begin == 0:
            self.causal.remove(seq, begin, end)
            self._release(seq)
            return
        row = next((r for p, r in state.checkpoints if p == begin - 1), None)
        if row is None:
            raise ShiftError(f"no recurrent checkpoint of sequence {seq} at position {begin - 1}")
        self.causal.remove(seq, begin, end)
        self._hold(row)
        self._unhold(state.row)
        state.row, state.next = row, begin
        for _, r in [c for c in state.checkpoints if c[0] >= begin]:
            self._unhold(r)
        state.checkpoints = [c for c in state.checkpoints if c[0] < begin]
        if state.rolling is not None and state.rolling >= begin:
            state.rolling = None
        state.resumes = {p for p in state.resumes if p < begin}

    def checkpoints(self, seq: int) -> list[int]:
        """The positions after which the sequence has a checkpoint, oldest first."""
        state = self._sequences.get(seq)
        return [p for p, _ in state.checkpoints] if state is not None else []

    def position(self, seq: int) -> int:
        """The position the sequence's state has reached (-1: unknown until a checkpoint is restored)."""
        state = self._sequences.get(seq)
        return state.next if state is not None else 0

    def slot(self, seq: int) -> int:
        """The row the sequence's state lives in (shared rows are how forks share a state)."""
        state = self._sequences.get(seq)
        return state.row if state is not None else self.zero

    # ------------------------------------------------------------ internals

    def _advance(self, state: _Sequence, batch: Batch, begin: int, count: int, rows: np.ndarray) -> tuple[int, ...]:
        """Fill `rows` (read, write, checkpoint, resume checkpoints) for one sequence's run of the batch, move its
        bookkeeping past the run, and return where the run is cut for its resume checkpoints."""
        read = state.row
        write = read if read < self._slots and self._refs[read] == 1 else self._take(0, self._slots)
        if write != read:
            self._refs[write] = 1
            self._unhold(read)
        first, last = state.next, state.next + count - 1
        rows[:3] = (read, write, self.scratch)
        prompt_end = count > 1 and begin + count - 1 in batch.outputs
        aligned = count > 1 and (last + 1) % self._max_batch == 0
        kept = [p for p, _ in state.checkpoints if p != state.rolling and p not in state.resumes]
        due = not kept or last - kept[-1] >= self.interval
        cuts = self._plan_resumes(state, rows, first, last + 1, begin, len(batch)) if prompt_end else ()
        if self.checkpoint_count and last >= self.min_position and (prompt_end or aligned or due):
            if aligned and state.rolling is not None:  # superseded by this one
                self._drop(state, state.rolling)
            regular = [p for p, _ in state.checkpoints if p not in state.resumes]
            if len(regular) == self.checkpoint_count:
                self._drop(state, regular[0])
            rows[2] = self._checkpoint(state, last)
            state.rolling = None if prompt_end or due else last
        state.row, state.next = write, state.next + count
        return cuts

    def _plan_resumes(self, state: _Sequence, rows: np.ndarray, first: int, length: int, row: int,
                      batch_rows: int) -> tuple[int, ...]:
        """At the end of a prompt of `length` inputs whose last batch holds positions first.. in rows row.. of
        batch_rows: replace the sequence's resume checkpoints by those resume_rule wants inside this batch; the
        cuts (offsets in the run)."""
        wanted = self.resume_rule(length, first, row, batch_rows) if self.resume_rule else ()
        wanted = sorted(p for p in wanted if first < p < length)
        wanted = wanted[-self.resume_count:] if self.resume_count else []
        if not wanted:
            return ()
        for position in sorted(state.resumes):
            self._drop(state, position)
        for k, position in enumerate(wanted):
            rows[3 + k] = self._checkpoint(state, position - 1)
            state.resumes.add(position - 1)
        return tuple(p - first for p in wanted)

    def _checkpoint(self, state: _Sequence, position: int) -> int:
        """A free checkpoint row for the sequence's state after `position` (the newest it has)."""
        row = self._take(self._slots, self.zero)
        self._refs[row] = 1
        state.checkpoints.append((position, row))
        return row

    def _drop(self, state: _Sequence, position: int) -> None:
        """Forget the sequence's checkpoint after `position`."""
        row = next(r for p, r in state.checkpoints if p == position)
        state.checkpoints.remove((position, row))
        self._unhold(row)
        state.resumes.discard(position)
        if state.rolling == position:
            state.rolling = None

    def _take(self, low: int, high: int) -> int:
        """A free row in [low, high); there always is one (each sequence holds at most one slot, C checkpoints
        and K resume checkpoints)."""
        free = np.flatnonzero(self._refs[low:high] == 0)
        if not len(free):
            raise RuntimeError(f"no free recurrent state row in {low}..{high}: the bookkeeping is broken")
        return low + int(free[0])

    def _hold(self, row: int) -> None:
        if row < self.zero:
            self._refs[row] += 1

    def _unhold(self, row: int) -> None:
        if row < self.zero:
            self._refs[row] -= 1

    def _release(self, seq: int) -> None:
        state = self._sequences.pop(seq, None)
        if state is not None:
            self._unhold(state.row)
            for _, row in state.checkpoints:
                self._unhold(row)

    def _kind(self, layer: int, kind: int) -> tuple[int, int]:
        sizes = self.state_sizes[layer]
        if not 0 <= kind < len(sizes):
            raise ShapeError(f"layer {layer} has {len(sizes)} recurrent states, not {kind + 1}")
        return sum(sizes[:kind]), sizes[kind]

    def _row_index(self, bound: _Bound, index: int, column: int) -> Tensor:
        if not 0 <= index < len(bound.rows):
            raise IndexError(f"sequence {index} of a batch of {len(bound.rows)}")
        return bound.tensor.view((index * bound.rows.shape[1] + column) * 4, (1,))

    def _layer_states(self, layer: int) -> Tensor:
        if layer not in self._states:
            raise ShapeError(f"layer {layer} has no recurrent state (recurrent layers: {sorted(self._states)})")
        return self._states[layer]

    def _require_init(self) -> None:
        if self._backend is None:
            raise RuntimeError("the cache is not initialised (call init() first)")

    def _require_bound(self, ctx: Context) -> _Bound:
        self._require_init()
        if self._bound is None or self._bound.serial != ctx.serial:
            raise RuntimeError("the batch is not bound to this context: call start_forward() (or bind()) with it")
        return self._bound
