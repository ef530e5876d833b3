"""Graphs: build a model's forward graph once and reuse it while batches keep the same shape.

A graph's topology depends only on the batch's shape: the cache layout (batch size and the cells it
attends to, which changes only every `padding` cells) and the number of rows that want logits. Decode
steps almost always repeat the previous step's shape, so instead of building every node again in
Python, a reused graph gets the new batch written into its inputs (tokens, positions, output rows, and
the cache's cell indices and mask), and the scheduler keeps its compute buffers. The last few shapes'
graphs are kept (KEPT_GRAPHS): a request's prompt, of a shape of its own, does not cost the next decode
step a new build of the graph the previous request decoded with (2.6 ms on stories260K, 5-7 on a 1B).

Use `graphs.compute(batch)` for one batch at a time. The runner's pipeline splits it up: `acquire` (on
the thread that forms batches) places the batch in the cache and returns a graph, built if needed;
`graph.bind(batch)`, `graph.run()` and `release(graph)` follow on the compute thread, which from then on
computes every graph in place (ml/compute_threads.py). A decode step that repeats the last one's shape, one
position on, can skip the placing and binding: `repeat(graph, batch)`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.ml import Context, Tensor, compute_here

from .alone import sequence_rows

if TYPE_CHECKING:
    from .base import Model

BATCH_INPUTS = ("tokens", "positions", "outputs")
"""The graph inputs a reusable model names after the batch arrays they hold."""

KEPT_GRAPHS = 4
"""Reusable graphs kept, the least recently used retired first. A graph holds only its nodes' metadata (the
compute buffers are the scheduler's, shared): a context of 3 * Backend.max_graph_nodes tensors at most."""


def stale_inputs(graph: Graph, batch: Batch) -> list[str]:
    """The names of `graph`'s inputs that bind(batch) left unlike those of a graph built for `batch`.

    A reused graph rewrites only the cache's inputs, BATCH_INPUTS and Model.batch_inputs(); an input that
    forward() computes from the batch some other way would keep the values of the batch it was built for.
    This detects that, whatever the model: it builds a second graph for the batch (so it is for tests, not
    per token) and compares every input by name. Call it after graph.bind(batch), before the next acquire.
    """
    fresh = Graph(graph.model, None, batch)
    try:
        expected = fresh.ctx.input_values()
    finally:
        fresh.ctx.close()
    if "" in expected:
        return [""]  # an unnamed input cannot be matched, so it cannot be shown to be refreshed
    actual = graph.ctx.input_values()
    return sorted(name for name, values in expected.items() if actual.get(name) != values)


class Graph:
    """One built forward graph: its context, its logits tensor (None if no row wants logits)."""

    def __init__(self, model: Model, key: Hashable | None, batch: Batch):
        self.model = model
        self.key = key
        self.ctx: Context = model.backend.new_context()
        self.users = 0
        self.retired = False
        self._view: tuple[int, np.ndarray] | None = None  # (ctx.allocations, logits) while they stay put
        if batch.apart:  # rows verified as decode steps: each weight's product takes their kernel
            self.ctx.matmul_row_limits = model.graphs.verify_row_limits
        try:
            if model.cache is not None:
                model.cache.bind(self.ctx)
            self.logits: Tensor | None = model.forward(self.ctx, batch)
        except BaseException:
            self.ctx.close()
            raise

    def bind(self, batch: Batch) -> None:
        """Write `batch` (the one the graph was acquired with) into the graph's inputs.

        Call it while the cache still holds this batch as its prepared one (before the next acquire):
        the cache's cell indices and mask are copied here.
        """
        if self.key is None:  # built for this batch, never reused
            return
        if self.model.cache is not None:
            self.model.cache.bind(self.ctx)
        for name in BATCH_INPUTS:
            values = getattr(batch, name)
            if values is not None and len(values):
                self.ctx.set_input(name, values)
        for name, values in self.model.batch_inputs(batch).items():
            self.ctx.set_input(name, values)

    def run(self, copy: bool = True) -> np.ndarray | None:
        """Compute the bound batch: its logits (outputs, vocab), or None if no row wants logits.

        copy: the caller's to keep, copied before another thread can compute on the backend (the runner's
        batch builder computes cache shifts on its own thread: a copy taken after the compute returned
        could already hold the shift's values). Else a view of the graph's output where that is in host
        memory, valid until the backend computes again: for a caller that computes on one thread.

        The calling thread computes in place from now on (ml/compute_threads.py): a serving loop runs its
        forward graphs on one thread, and its other computes (cache shifts) must not leave a second pool.
        """
        compute_here()
        if self.logits is None:
            self.ctx.compute()
            return None
        if copy:
            return self.ctx.compute(read=self.logits).reshape(self.logits.ne[1], -1)
        self.ctx.compute(self.logits)
        if self._view is not None and self._view[0] == self.ctx.allocations:
            return self._view[1]  # a view of host memory that has not moved
        logits = self.logits.numpy(copy=False)
        rows = logits.reshape(self.logits.ne[1], -1)
        self._view = None if logits.flags.owndata else (self.ctx.allocations, rows)  # owned: a copy from a GPU
        return rows


class Graphs:
    """The model's most recently used forward graphs, reused for later batches of their shapes."""

    def __init__(self, model: Model):
        self.model = model
        self._kept: dict[Hashable, Graph] = {}  # by key, the least recently used first
        self._lock = threading.Lock()
        self.verify_row_limits: dict[int, int] | None = None
        """For graphs of batches whose rows are verified as decode steps (`Batch.apart`): the most rows each
        weight's product may take at once (Context.matmul_row_limits; set by the runner, runner/speculate.py)."""

    def acquire(self, batch: Batch) -> Graph:
        """Place the batch in the model's cache and return the graph to compute it with."""
        model = self.model
        layout = model.cache.prepare(batch) if model.cache is not None else None
        # a batch with images has inputs of its own (the embeddings, the image rows' both-ways masks): built for it
        reusable = model.reuse_graphs and layout is not None and not batch.embeddings
        # the output rows per sequence too: a mixture's router splits them so (models/alone.py)
        key = (layout, sequence_rows(batch.sequences[batch.outputs])) if reusable else None
        with self._lock:
            kept = self._kept.pop(key, None) if key is not None else None
            if kept is not None:
                self._kept[key] = kept  # now the most recently used
                kept.users += 1
                return kept
        graph = Graph(model, key, batch)
        with self._lock:
            graph.users += 1
            if key is None:
                graph.retired = True  # built for this batch alone: closed once released
                return graph
            if (other := self._kept.pop(key, None)) is not None:  # built meanwhile on another thread
                self._retire(other)
            self._kept[key] = graph
            while len(self._kept) > KEPT_GRAPHS:
                self._retire(self._kept.pop(next(iter(self._kept))))
        return graph

    def repeat(self, graph: Graph, batch: Batch) -> bool:
        """Acquire `graph` again for `batch`, the one it computed last, each row now one position on (decode steps),
        where the cache places the rows in place (Cache.repeat): the graph's inputs, the batch's arrays and the
        cache's, then hold the next step but its tokens, which the caller writes into batch.tokens (a graph input),
        and no bind is needed. False, with nothing changed: acquire the next batch."""
        model = self.model
        if graph.key is None or graph.retired or model.cache is None or model.batch_inputs(batch):
            return False  # batch_inputs: computed from the positions by bind()
        with self._lock:
            if graph.retired or not model.cache.repeat(graph.ctx):
                return False
            graph.users += 1
        return True

    def release(self, graph: Graph) -> None:
        with self._lock:
            graph.users -= 1
            if graph.retired and graph.users == 0:
                graph.ctx.close()

    def compute(self, batch: Batch, copy: bool = True) -> np.ndarray | None:
        """One batch through the model: logits (len(batch.outputs), vocab), or None if it asks for none.

        The logits are the caller's to keep (a copy), or with copy=False possibly a view that is valid
        until the model's backend computes again: for a caller that samples from them at once.
        """
        graph = self.acquire(batch)
        try:
            graph.bind(batch)
            return graph.run(copy)
        finally:
            self.release(graph)

    def close(self) -> None:
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
            for graph in kept:
                self._retire(graph)

    def _retire(self, graph: Graph) -> None:
        graph.retired = True
        if graph.users == 0:
            graph.ctx.close()
