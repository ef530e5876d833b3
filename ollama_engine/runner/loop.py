"""The batch loop: form a batch from every active sequence, compute it, sample, stream (Ollama's runner).

Two worker threads keep the event loop free. The builder thread forms batch N+1 and builds its graph
while the compute thread computes batch N (ggml releases the GIL). Batch N+1 may hold a placeholder
input for the token each sequence is about to sample from batch N: the placeholder is filled by the
sampler, and batch N+1 reads its token ids only when its own compute starts, after batch N is done
(one compute thread runs batches in order). The builder waits until batch N has started computing, so
the sequences have moved their inputs into the slots, and batch N's cache cells and mask are in its
graph, before the next batch is formed. Batches of the same shape share one graph (models.Graphs).

Where ggml's threads fill every CPU (a model on the CPU alone, a thread per core), the builder computes each
batch itself instead (Runner.inline): there the overlap bought nothing, its Python and the hand-off between two
threads ran on a core one of ggml's threads needed (stories260K on 2 cores: 0.587 -> 0.532 ms a token one
thread). The builder is then the thread that computes, so the forward passes others ask for (submit_compute)
are queued to it and run between batches.

Batch formation: one token budget (batch_size) shared by all sequences, visited round-robin from the
sequence that last missed out; a same-batch group is never split (it may stretch the budget); a prompt
too long for one batch continues in the next. A sequence's inputs go in the chunks they would form
alone (its next batch_size inputs, or all that are left): one that does not fit waits for the next
batch, so a sequence computes the same batches whatever its company (see kvcache.causal). A sequence
whose slot is full is shifted (or ended with DoneReason.LENGTH if the request forbids shifting).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as PySequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ollama_engine import envconfig
from ollama_engine.kvcache import Batch
from ollama_engine.ml import compute_here
from ollama_engine.models import Graph
from ollama_engine.runner.allocate import LoadedModel
from ollama_engine.runner.draft import ModelDrafter
from ollama_engine.runner.images import ImageData, ImageStats, batch_embeddings, prompt_inputs
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.positions import rope_positions, text_position
from ollama_engine.runner.prompt_cache import TO_END, ReprocessInputsError
from ollama_engine.runner.sequence import DoneReason, Piece, Sequence, SequenceOptions, capped_num_predict, fit_prompt
from ollama_engine.runner.speculate import (
    DEFAULT_DRAFT,
    MAX_DRAFT,
    Drafter,
    NgramIndex,
    Speculator,
    StepCost,
    draft_all,
    matmul_row_limits,
    verify_rows,
)
from ollama_engine.sample import GrammarError, GrammarVocab, NonFiniteLogitsError, calculate_logprobs

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class BatchState:
    """One formed batch on its way through the pipeline."""

    seqs: list[Sequence | None]
    """The sequences as they were when the batch was formed; results for any since replaced are dropped."""
    inputs: list[Input] = field(default_factory=list)
    batch: Batch | None = None
    graph: Graph | None = None
    drafts: dict[int, list[int]] = field(default_factory=dict)
    """Per sequence index, the drafted tokens it verifies in this batch (after its sampled token)."""
    rows: dict[int, range] = field(default_factory=dict)
    """Per sequence index, its rows in the batch (a sequence's rows are consecutive)."""
    bound: bool = False
    """The graph's inputs hold the batch already (Runner._repeat): no bind."""
    compute_started: threading.Event = field(default_factory=threading.Event)


class Runner:
    """Serves completions from a committed model; start() launches the threads, close() stops them."""

    def __init__(self, loaded: LoadedModel, on_fatal: Callable[[BaseException], None], inline: bool | None = None,
                 stream_interval: float | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.model.tokenizer
        self.cache = loaded.input_cache
        self.batch_size = loaded.batch_size
        self.on_fatal = on_fatal
        self.cond = threading.Condition()
        self.seqs: list[Sequence | None] = [None] * loaded.parallel
        self.next_seq = 0
        self.hold_output: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Wraps a step's sampling: the server may hold the sinks' items and hand them over at once."""
        self.closing = False
        self.in_flight = 0
        """Batches formed and not yet sampled (under cond)."""
        self.spec_rows = verify_rows(self.model, self.batch_size)
        """Most rows of a batch holding drafts (0: no exact speculation for this model; runner/speculate.py)."""
        self.model.graphs.verify_row_limits = matmul_row_limits(self.model) if self.spec_rows > 1 else None
        self.step_cost = StepCost()
        self.stream_interval = envconfig.stream_interval() if stream_interval is None else stream_interval
        """A sequence's tokens sampled within this many seconds of its last line go out together in the next line
        (README, OLLAMA_ENGINE_STREAM_INTERVAL): one write and one wake-up of the reader for several tokens where
        decoding is faster than the interval; 0 sends each token as it comes."""
        self.lines_out = 0
        """Lines handed to the sinks so far: a step that sent one sends every other sequence's ready text with it."""
        inline = loaded.model.backend.fills_cpus() if inline is None else inline  # None: chosen by the CPUs
        self._compute = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._queued: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()
        """Inline: the computes submit_compute was asked for, run by the builder between batches (under cond)."""
        self._builder = threading.Thread(target=self._run, name="batch-builder", daemon=True)

    @property
    def inline(self) -> bool:
        """The builder computes every batch itself, with no compute thread (see the module's docstring)."""
        return self._compute is None

    @property
    def num_ctx(self) -> int:
        return self.cache.num_ctx

    def start(self) -> None:
        self._builder.start()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self._builder.join()
        if self._compute is not None:
            self._compute.shutdown(wait=True)
        with self.cond:
            queued, self._queued = self._queued, collections.deque()
        for _, future in queued:
            future.set_exception(RuntimeError("the runner closed before the compute ran"))

    def submit_compute(self, work: Callable[[], T]) -> Future[T]:
        """`work` on the thread that computes the batches, after the batches queued before it. A pooled forward
        pass (an embedding) runs there, so the runner's graphs keep one OpenMP pool and a request starts no thread
        (ml/compute_threads.py)."""

        def in_place() -> T:
            compute_here()  # as after the thread's first batch: an embedding runner computes no batch
            return work()

        if self._compute is not None:
            return self._compute.submit(in_place)
        future: Future[T] = Future()
        with self.cond:
            if self.closing:
                raise RuntimeError("the runner is closing")
            self._queued.append((in_place, future))
            self.cond.notify()
        return future

    def _run_queued(self) -> None:
        """Inline: the queued computes, in order, on this (the builder's) thread."""
        while True:
            with self.cond:
                if not self._queued:
                    return
                work, future = self._queued.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as err:  # the caller's to handle, as a compute thread's future would hold it
                    future.set_exception(err)

    # ------------------------------------------------------------ sequences

    def new_sequence(self, prompt: str, options: SequenceOptions, grammar: str = "",
                     images: PySequence[ImageData] = ()) -> Sequence:
        """Tokenize and fit the prompt to one slot's context (raises InputTooLongError), its [img-N] tags the
        images' embeddings (raises ImageError); compile the grammar (GBNF or `%llguidance` Lark, raises
        GrammarError)."""
        matcher = GrammarVocab.of(self.tokenizer).matcher(grammar) if grammar else None
        stats = ImageStats()
        inputs = prompt_inputs(prompt, images, self.tokenizer, self.loaded.images, stats, self.batch_size)
        inputs, num_keep = fit_prompt(inputs, self.num_ctx, options.num_keep, options.truncate)
        options.num_predict = capped_num_predict(options.num_predict, self.num_ctx)
        seq = Sequence(inputs=inputs, options=options, num_keep=num_keep, num_prompt_inputs=len(inputs),
                       grammar=matcher, images=stats)
        # the penalties' window starts with the prompt, as llama-server's sampler does
        options.sampler.start((inp.token for inp in inputs if inp.multimodal is None), self.num_ctx)
        drafter = self._drafter(inputs, options) if self.spec_rows > 1 else None
        if drafter is not None:
            max_draft = min(options.draft_num_predict or DEFAULT_DRAFT, MAX_DRAFT)
            seq.spec = Speculator(drafter, max(max_draft, 1))
        return seq

    def _drafter(self, inputs: list[Input], options: SequenceOptions) -> Drafter | None:
        """The loaded draft model for a text prompt (it has no vision tower); else n-grams where the request asks."""
        tokens = [inp.token for inp in inputs]
        if self.loaded.draft is not None and all(inp.multimodal is None for inp in inputs):
            return ModelDrafter(self.loaded.draft, tokens)
        return NgramIndex(tokens) if options.spec_ngram else None

    def add(self, seq: Sequence, sink: Callable[[Piece | None], None]) -> None:
        """Give the sequence a free place and the cache slot that best matches its prompt."""
        with self.cond:
            index = next((i for i, s in enumerate(self.seqs) if s is None), None)
            if index is None:
                raise RuntimeError("could not find an available sequence")
            try:
                seq.slot, seq.inputs = self.cache.load_slot(seq.inputs, cache_prompt=True)
            except Exception as err:
                raise RuntimeError(f"Failed to load cache: {err}") from err
            seq.sink = sink
            if seq.spec is not None:
                seq.spec.drafter.bind(seq.slot.id)
            self.seqs[index] = seq
            self.cond.notify()

    def _remove(self, index: int, reason: DoneReason) -> None:
        seq = self.seqs[index]
        assert seq is not None and seq.slot is not None
        seq.output.seal()
        self._flush(seq)
        self.lines_out += 1  # the last line
        if seq.spec is not None and seq.spec.drafted:
            log.info("speculation: %d of %d drafted tokens accepted (%.0f%%) in %d steps, %d tokens generated",
                     seq.spec.accepted, seq.spec.drafted, 100 * seq.spec.acceptance, seq.spec.steps,
                     seq.num_predicted)
        seq.done_reason = reason
        seq.slot.in_use = False
        self.seqs[index] = None
        seq.sink(None)

    def _flush(self, seq: Sequence, now: float = 0.0) -> bool:
        """Send the ready text; False if the client has gone."""
        text, logprobs = seq.output.take()
        if not text:
            return True
        if seq.quit.is_set():
            return False
        seq.sink(Piece(text, logprobs))
        seq.sent_at = now
        self.lines_out += 1
        return True

    def _send_held(self, now: float) -> None:
        """The text the stream interval holds back, sent before a step that may be long (it computes a prompt's
        rows), so that no token waits for more than the interval and a decode step (under cond)."""
        for seq in self.seqs:
            if seq is not None and seq.output.ready:
                self._flush(seq, now)  # a client gone is noticed when the next batch is formed

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        previous: BatchState | None = None
        try:
            while True:
                if previous is not None:
                    previous.compute_started.wait()
                self._run_queued()
                current = self._repeat(previous) or self._form_batch()
                if current is None:
                    return
                with self.cond:
                    self.in_flight += 1
                if self._compute is None:
                    self._compute_batch(current)  # its failure ends the loop, as _check reports a compute thread's
                else:
                    self._compute.submit(self._compute_batch, current).add_done_callback(self._check)
                previous = current
        except BaseException as err:
            self.on_fatal(err)

    def _repeat(self, previous: BatchState | None) -> BatchState | None:
        """The next batch formed in place, where it repeats `previous` one position on: inline (nothing computes
        meanwhile), every active sequence decoded a row of `previous` and has only the token it sampled to add
        (no drafts, images or context shift), and the cache can place the rows where they are
        (models.Graphs.repeat). What _form_batch would form, without forming, placing or binding it anew: on a
        model whose compute is negligible that was most of a step's Python. None: form it."""
        batch = previous.batch if previous is not None and self.inline else None
        if batch is None or previous.graph is None or previous.drafts or len(previous.rows) != len(batch) \
                or len(batch.outputs) != len(batch) or batch.embeddings or batch.rope_positions is not None:
            return None
        with self.cond:
            if self.closing or self._queued or sum(seq is not None for seq in self.seqs) != len(previous.rows):
                return None
            for index, rows in previous.rows.items():
                seq = self.seqs[index]
                if (seq is None or seq is not previous.seqs[index] or len(seq.inputs) != 1 or seq.spec is not None
                        or seq.inputs[0].multimodal is not None or seq.quit.is_set()
                        or len(seq.slot.inputs) != batch.positions[rows.start] + 1
                        or len(seq.slot.inputs) + 1 > self.num_ctx):
                    return None
            if not self.model.graphs.repeat(previous.graph, batch):
                return None
            state = BatchState(seqs=list(self.seqs), batch=batch, graph=previous.graph, rows=previous.rows, bound=True)
            for index in previous.rows:  # in row order
                seq = self.seqs[index]
                state.inputs.append(seq.inputs[0])
                seq.pending_inputs.append(seq.inputs[0])
                seq.inputs = []
            return state

    def _awaiting_drafts(self) -> bool:
        """Whether a speculating sequence's next inputs come from the batch being computed. The next batch then
        waits for them: formed now, it would leave that sequence out, and from then on the two would alternate
        batches instead of sharing them (on one compute thread nothing is lost: the next batch could not start
        before this one ends)."""
        return self.in_flight > 0 and any(
            s is not None and s.spec is not None and s.spec.waiting and not s.inputs and not s.quit.is_set()
            for s in self.seqs)

    def _check(self, future) -> None:
        if future.exception() is not None:
            self.on_fatal(future.exception())

    def _form_batch(self) -> BatchState | None:
        with self.cond:
            # a speculating sequence has no inputs until its last batch is sampled
            while not self.closing and not self._queued and (self._awaiting_drafts() or not any(
                    s is not None and (s.inputs or s.quit.is_set()) for s in self.seqs)):
                self.cond.wait()
            if self.closing:
                return None
            state = BatchState(seqs=list(self.seqs))
            positions: list[int] = []
            sequences: list[int] = []
            outputs: list[int] = []
            resume: int | None = None
            apart: set[int] = set()
            row_cap = self.batch_size  # lowered to spec_rows once the batch holds drafts
            multimodal_rope = self.model.position_components > 1
            rope: list[np.ndarray] = []  # each sequence's rows' position components, where the model has several
            count = len(self.seqs)
            for k in range(count):
                index = (self.next_seq + k) % count
                seq = state.seqs[index]
                if seq is None:
                    continue
                if seq.quit.is_set():
                    self._remove(index, DoneReason.CONNECTION_CLOSED)
                    state.seqs[index] = None
                    continue
                slot = seq.slot
                assert slot is not None
                if not self.cache.enabled:  # no KV cache: the whole history goes into every batch
                    seq.inputs, slot.inputs = slot.inputs + seq.inputs, []
                drafts = self._fit_drafts(seq, len(state.inputs))
                length = len(seq.inputs) if drafts else self._chunk_length(seq)
                if state.inputs and len(state.inputs) + length > row_cap:
                    if resume is None:
                        resume = index  # its whole chunk goes first next time
                    continue
                if drafts:
                    row_cap = self.spec_rows
                    apart.add(slot.id)
                    state.drafts[index] = drafts
                limit = self.batch_size
                cap = self.cache.chunk_limit(len(slot.inputs) + len(seq.pending_inputs))
                first_row = len(state.inputs)
                group_end = -1  # the last input of a same-batch group begun in this batch: never cut before it
                image_end = -1  # the last input of an image's run: the chunk ends there
                for i, inp in enumerate(seq.inputs):
                    needed = 1 + inp.same_batch
                    limit = max(limit, needed)  # a group larger than a batch gets a batch of its own
                    if i > group_end and (len(state.inputs) + needed > limit or (i > 0 and (
                            (i + needed > cap and not drafts) or inp.multimodal is not None))):
                        if not seq.pending_inputs and resume is None:
                            resume = index  # start there next time, so it does not starve
                        break
                    if len(slot.inputs) + len(seq.pending_inputs) + needed > self.num_ctx:
                        if seq.pending_inputs:
                            break  # shift once this batch is done
                        if not seq.options.shift:
                            self._remove(index, DoneReason.LENGTH)
                            state.seqs[index] = None
                            break
                        try:
                            self.cache.shift_slot(slot, seq.num_keep)
                            if seq.spec is not None:
                                seq.spec.stopped = True
                        except ReprocessInputsError as err:
                            seq.inputs = err.inputs + seq.inputs  # i == 0 here: nothing batched yet
                            state.seqs[index] = None
                            break
                    group_end = max(group_end, i + inp.same_batch)
                    if inp.multimodal is not None:
                        image_end = i + inp.same_batch
                    state.inputs.append(inp)
                    positions.append(len(slot.inputs) + len(seq.pending_inputs))
                    sequences.append(slot.id)
                    if i == 0 or not drafts:
                        seq.batch_row = len(outputs)
                    if i + 1 == len(seq.inputs) or drafts:  # a verified row: its logits too
                        outputs.append(len(state.inputs) - 1)
                    seq.pending_inputs.append(inp)
                    if i == image_end:
                        break  # an image is decoded alone, as llama.cpp's mtmd decodes it: its rows see no later text
                seq.inputs = seq.inputs[len(seq.pending_inputs):]
                added = len(state.inputs) - first_row
                state.rows[index] = range(first_row, first_row + added)
                if multimodal_rope and added:  # from the text position after the sequence's earlier inputs
                    start = text_position(slot.inputs, seq.pending_inputs[: len(seq.pending_inputs) - added])
                    rope.append(rope_positions(start, state.inputs[first_row:]))
            for seq in state.seqs:
                if seq is not None:
                    seq.mark_started()
            if resume is not None:
                self.next_seq = resume
            if not state.inputs:
                state.compute_started.set()
                return state
            tokens = np.zeros(len(state.inputs), dtype=np.int32)  # filled in when the batch computes
            state.batch = Batch(positions=positions, sequences=sequences, outputs=outputs, tokens=tokens,
                                apart=frozenset(apart), embeddings=batch_embeddings(state.inputs),
                                rope_positions=np.concatenate(rope, axis=1) if rope else None)
            state.graph = self.model.graphs.acquire(state.batch)
            return state

    def _chunk_length(self, seq: Sequence) -> int:
        """How many of seq's inputs an empty batch would take: a sequence's inputs always go in such chunks.

        Cutting a prompt where other sequences leave room would give its tokens other batch shapes than
        when it runs alone, and ggml's results depend (slightly) on the shapes.
        """
        if len(seq.inputs) == 1:
            return 1  # a decode step's token (the loop below takes one input in every case)
        taken, limit = 0, self.batch_size
        assert seq.slot is not None
        cap = self.cache.chunk_limit(len(seq.slot.inputs) + len(seq.pending_inputs))
        group_end = image_end = -1
        for inp in seq.inputs:
            needed = 1 + inp.same_batch
            limit = max(limit, needed)
            if taken > group_end and (taken + needed > limit or (taken > 0 and (
                    taken + needed > cap or inp.multimodal is not None))):
                break
            group_end = max(group_end, taken + inp.same_batch)
            if inp.multimodal is not None:
                image_end = taken + inp.same_batch
            taken += 1
            if taken - 1 == image_end:
                break
        return taken

    def _compute_batch(self, state: BatchState) -> None:
        try:
            self._compute_and_sample(state)
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify()

    def _compute_and_sample(self, state: BatchState) -> None:
        if state.graph is None:
            return
        try:
            placeholders = self._advance(state)
            if not state.bound:
                state.graph.bind(state.batch)
            if len(state.batch.outputs) < len(state.batch) and self.stream_interval:  # a prompt's rows
                with self.cond:
                    self._send_held(time.monotonic())
            state.compute_started.set()
            fresh = state.graph.ctx.allocations == 0  # its first run lays out (and may grow) the compute buffers
            started = time.monotonic()
            logits = state.graph.run()  # a copy: the batch builder may compute a cache shift while we sample
            if not fresh and len(state.batch.outputs) == len(state.batch) <= self.spec_rows:  # decode rows only
                self.step_cost.record(len(state.batch), time.monotonic() - started)
            now = time.monotonic()
            with self.cond, self.hold_output():
                lines_out = self.lines_out
                waiting: dict[int, tuple[int, int]] = {}
                for index, (placeholder, row) in placeholders.items():
                    seq = self.seqs[index]
                    if seq is not None and seq is state.seqs[index]:
                        wait = self._step(index, seq, placeholder, logits, row, state.drafts.get(index, []), now)
                        if wait is not None:
                            waiting[index] = wait
                self._queue_drafts(waiting)
                if self.lines_out != lines_out:  # the reader wakes for this step's lines: the others' go with them,
                    self._send_held(now)  # and the streams' intervals then run in step (one wake-up for all)
                self.cond.notify()  # a speculating sequence may have its next inputs now
                sampling = time.monotonic() - now
                for index in placeholders:
                    seq = self.seqs[index]
                    if seq is not None:
                        seq.sampling_duration += sampling
        finally:
            state.compute_started.set()
            self.model.graphs.release(state.graph)

    def _advance(self, state: BatchState) -> dict[int, tuple[Input | None, int]]:
        """Fill in the batch's token ids, record its inputs in the slots, queue a placeholder per sampler.

        Returns, per sequence index, the placeholder and the sequence's (first) row in this batch's logits
        (read now: forming the next batch overwrites it). A speculating sequence gets no placeholder (None):
        its next inputs, the token and new drafts, come from sampling this batch.
        """
        placeholders: dict[int, tuple[Input | None, int]] = {}
        with self.cond:
            state.batch.tokens[:] = [inp.token for inp in state.inputs]
            for index, seq in enumerate(self.seqs):
                if seq is None or seq is not state.seqs[index]:
                    continue
                assert seq.slot is not None
                if self.cache.exact and seq.pending_inputs:
                    self.cache.record_rows(seq.slot, len(seq.slot.inputs), state.rows[index], len(state.batch))
                    if index in state.drafts:  # generated, never a cold run's: not reused as a prompt
                        del seq.slot.kernels[len(seq.slot.inputs):]
                seq.slot.inputs.extend(seq.pending_inputs)
                seq.pending_inputs = []
                if seq.inputs:  # still evaluating the prompt
                    if not self.cache.enabled:
                        raise RuntimeError("caching disabled but unable to fit entire input in a batch")
                    continue
                if seq.spec is not None and (seq.spec.want or index in state.drafts):
                    seq.spec.waiting = True
                    placeholders[index] = (None, seq.batch_row)
                    continue
                placeholder = Input()
                placeholders[index] = (placeholder, seq.batch_row)
                seq.inputs = [placeholder]
        return placeholders

    # ------------------------------------------------------------ speculation (runner/speculate.py)

    def _fit_drafts(self, seq: Sequence, rows: int) -> list[int]:
        """The drafts seq's next inputs carry, cut so that the batch (`rows` so far) stays within spec_rows."""
        if seq.spec is None or seq.num_predicted == 0 or len(seq.inputs) < 2:
            return []  # nothing drafted (a prompt's groups are images)
        keep = max(min(len(seq.inputs), self.spec_rows - rows), 1)
        del seq.inputs[keep:]
        seq.inputs[0].same_batch = keep - 1
        return [inp.token for inp in seq.inputs[1:]]

    def _step(self, index: int, seq: Sequence, placeholder: Input | None, logits: np.ndarray, row: int,
              drafts: list[int], now: float) -> tuple[int, int] | None:
        """Sample the sequence's rows in order, keeping each draft the sampler picks itself; roll back the rest.

        Returns (sampled token, tokens to draft after it) for a sequence whose next inputs wait for this step."""
        slot, spec = seq.slot, seq.spec
        assert slot is not None
        if not drafts and not seq.options.shift and len(slot.inputs) >= self.num_ctx:
            # the token sampled here would have no cell: dropped, as when forming the next batch (which ends the
            # sequence there) comes first; so the same tokens come out whichever thread gets there first
            self._remove(index, DoneReason.LENGTH)
            return None
        if drafts:
            base = len(slot.inputs) - len(drafts)  # slot.inputs ends with the sampled token and the drafts
            slot.inputs[base - 1].same_batch = 0  # computed: a shift may drop these inputs one by one
            verified = slot.inputs[base:]
            del slot.inputs[base:]
        accepted = 0
        token = self._sample(index, seq, placeholder if not drafts else None, logits[row], now)
        while token is not None and accepted < len(drafts) and token == drafts[accepted]:
            slot.inputs.append(verified[accepted])
            accepted += 1
            token = self._sample(index, seq, None, logits[row + accepted], now)
        if drafts:
            spec.record(len(drafts), accepted)
            if accepted < len(drafts):
                self.cache.kv_cache.remove(slot.id, base + accepted, TO_END)
        if token is None or spec is None:
            return None
        limit = min(self.spec_rows - 1, self.num_ctx - len(slot.inputs) - 1)
        if seq.options.num_predict > 0:
            limit = min(limit, seq.options.num_predict - seq.num_predicted - 1)
        k = spec.plan(limit, self.step_cost, draft=spec.waiting)
        if not spec.waiting:
            return None
        spec.waiting = False
        return token, k

    def _queue_drafts(self, waiting: dict[int, tuple[int, int]]) -> None:
        """The next inputs of the sequences that waited for this step: the sampled token and its drafts, drafted
        together (a draft model's sequences in one batch)."""
        if not waiting:
            return
        asking = [index for index, (_, k) in waiting.items() if k > 0]
        specs = {index: self.seqs[index].spec for index in waiting}
        drafts = dict(zip(asking, draft_all([(specs[i].drafter, waiting[i][1]) for i in asking]), strict=True))
        for index, (token, _) in waiting.items():
            proposed = drafts.get(index, [])
            if index in drafts:
                specs[index].received(proposed)
            proposed = self._checked(self.seqs[index], proposed)
            first = Input(token=token, same_batch=len(proposed))
            self.seqs[index].inputs = [first] + [Input(token=t) for t in proposed]

    def _checked(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """Drafts up to the first end-of-generation token or the first one the grammar rejects."""
        for i, token in enumerate(drafts):
            if self.tokenizer.is_eog(token):
                drafts = drafts[:i]
                break
        if seq.grammar is not None and drafts:
            drafts = drafts[:seq.grammar.valid_prefix(drafts)]
        return drafts

    def _sample(self, index: int, seq: Sequence, placeholder: Input | None, logits: np.ndarray,
                now: float) -> int | None:
        """Sample, emit and check one token; it, or None once the sequence has ended."""
        seq.last_updated_at = now
        seq.num_predicted += 1
        if seq.num_predicted == 1:
            seq.processing_duration = now - (seq.started_at or now)
            seq.started_at = now

        grammar = seq.grammar
        try:
            token = grammar.sample(seq.options.sampler, logits) if grammar else seq.options.sampler.sample(logits)
            if placeholder is not None:
                placeholder.token = token  # the next batch may already hold this input
            if self.tokenizer.is_eog(token):
                self._remove(index, DoneReason.STOP)
                return None
            if grammar is not None:
                grammar.accept(token)
            seq.options.sampler.accept(token)
        except (GrammarError, NonFiniteLogitsError) as err:  # ends this sequence only
            seq.error = str(err)
            self._remove(index, DoneReason.STOP)
            return None
        if seq.spec is not None:
            seq.spec.drafter.append(token)
        piece = self.tokenizer.token_piece(token)
        logprobs = []
        if seq.options.logprobs:
            logprobs.append(calculate_logprobs(logits, token, seq.options.top_logprobs, self._token_text))
        seq.output.add(piece, logprobs)

        complete = grammar is not None and grammar.finished  # nothing may follow but end-of-generation
        if not complete and 0 < seq.options.num_predict <= seq.num_predicted:
            self._remove(index, DoneReason.LENGTH)
            return None
        cut = seq.output.cut_at_stop()
        if cut is not None:
            # forget the cut tokens, so a later prompt that continues the text does not match them
            slot = seq.slot
            assert slot is not None
            keep = len(slot.inputs) + 1 - cut.pieces_removed
            if cut.token_truncated:
                keep -= 1
            del slot.inputs[max(keep, 0):]
            self._remove(index, DoneReason.STOP)
            return None
        if complete:
            self._remove(index, DoneReason.STOP)
            return None
        if seq.output.must_hold():
            return token
        seq.output.seal()
        if now - seq.sent_at < self.stream_interval:
            return token
        if not self._flush(seq, now):
            self._remove(index, DoneReason.CONNECTION_CLOSED)
            return None
        return token

    def _token_text(self, token: int) -> str:
        return self.tokenizer.token_piece(token).decode("utf-8", errors="replace")
