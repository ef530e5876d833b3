"""Only one long-lived thread computes graphs: a cache shift or prefix copy on another thread leaves no OpenMP pool.

Issue 33 found a single stream of stories260K decoding ~5x slower once four streams had decoded together.
The cause was not the KV cache (each sequence attends to its own region, checked below) but threads: ggml's
CPU backend runs a graph on an OpenMP pool owned by the calling thread, and once the runner's batch builder
had computed a context shift, its pool stayed beside the compute thread's; with more managed threads than
CPUs libgomp stops spinning between graphs, so every decode step woke its workers from sleep (3x-5x per step
on the same graph). ml/compute_threads.py runs such side computes on a thread that ends with them.

What is asserted is the mechanism, not a timing: the OS threads that Python did not start (the pools'
workers) do not grow when a long-lived thread other than the compute thread computes. Linux only (/proc).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ollama_engine.kvcache import Batch
from ollama_engine.runner.allocate import LoadedModel, LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import DoneReason, Piece, SequenceOptions
from ollama_engine.sample import Sampler

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")

THREADS = 2  # a graph computed with one thread starts no OpenMP pool


def native_threads() -> int:
    """OS threads of this process that Python did not start: OpenMP's workers (and any library's own)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def steady(seconds: float = 5.0) -> int:
    """native_threads() once it has not changed for 0.3 s (a pool's workers leave shortly after their thread,
    a new pool's start with its first compute), or its value after `seconds`."""
    deadline = time.monotonic() + seconds
    count, since = native_threads(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.3:
        time.sleep(0.02)
        if (now := native_threads()) != count:
            count, since = now, time.monotonic()
    return count


class LongLived:
    """A thread that runs the functions it is given and stays alive until closed, as the runner's threads do."""

    def __init__(self, name: str):
        self._work: list[Callable[[], object]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], object]) -> object:
        done, box = threading.Event(), {}

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as err:
                box["error"] = err
            done.set()

        with self._ready:
            self._work.append(job)
            self._ready.notify()
        assert done.wait(60), "the thread did not run its work"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._work and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                job = self._work.pop(0)
            job()


@pytest.fixture
def loaded(stories_path) -> LoadedModel:
    loaded = open_model(str(stories_path), LoadParams(parallel=4, batch_size=64, kv_size=512, num_threads=THREADS,
                                             multi_user_cache=True),
                        allocate=True)
    loaded.model.backend.load()
    yield loaded
    loaded.close()


def decode(loaded: LoadedModel, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
    """Feed tokens one step at a time to a sequence; the last step's logits."""
    logits = None
    for i, token in enumerate(tokens):
        batch = Batch(tokens=[token], positions=[start + i], sequences=[seq], outputs=[0])
        logits = loaded.model.graphs.compute(batch)
    return logits[0]


def test_a_cache_shift_and_copy_on_another_long_lived_thread_leave_no_pool(loaded):
    """The compute thread keeps its pool; the builder's copy and shift are done and leave none behind."""
    prompt = [1, 403, 407, 261, 378, 395, 289, 307]
    base = steady()
    compute, builder = LongLived("compute"), LongLived("builder")
    try:
        compute.run(lambda: decode(loaded, 0, prompt))
        with_pool = steady()
        if with_pool == base:
            pytest.skip("ggml's CPU backend left no worker threads: not built with OpenMP")
        assert with_pool == base + THREADS - 1

        cache = loaded.model.cache
        builder.run(lambda: cache.copy_prefix(0, 1, len(prompt)))  # a prompt cache hit in another slot
        builder.run(lambda: cache.remove(2, 0, None))
        builder.run(lambda: cache.copy_prefix(0, 2, len(prompt)))
        builder.run(lambda: cache.remove(2, 1, 3))  # a context shift: positions 3.. move down by 2
        assert steady() == with_pool, "the builder's computes left an OpenMP pool beside the compute thread's"

        # the side computes did their work: the copy continues exactly as the original, the shifted sequence
        # exactly as the same copy and shift done on the compute thread itself
        following = [420, 299]
        original = compute.run(lambda: decode(loaded, 0, following, len(prompt)))
        copied = compute.run(lambda: decode(loaded, 1, following, len(prompt)))
        np.testing.assert_array_equal(copied, original)
        shifted = compute.run(lambda: decode(loaded, 2, following, len(prompt) - 2))
        compute.run(lambda: cache.copy_prefix(0, 3, len(prompt)))
        compute.run(lambda: cache.remove(3, 1, 3))
        in_place = compute.run(lambda: decode(loaded, 3, following, len(prompt) - 2))
        np.testing.assert_array_equal(shifted, in_place)
        assert not np.array_equal(shifted, original)
    finally:
        compute.close()
        builder.close()


def test_side_compute_errors_reach_the_caller(loaded):
    """A compute run on a thread of its own raises on the calling thread, and the backend computes again after."""
    builder = LongLived("builder")
    try:
        with pytest.raises(ValueError, match="sequence 9"):
            builder.run(lambda: loaded.model.cache.copy_prefix(0, 9, 4))
        builder.run(lambda: loaded.model.cache.remove(0, 0, None))
        assert np.isfinite(builder.run(lambda: decode(loaded, 0, [1, 403]))).all()
    finally:
        builder.close()


def run_streams(runner: Runner, prompts: list[str], num_predict: int) -> list[int]:
    """Greedy completions of the prompts, concurrently; tokens each generated."""
    seqs, dones = [], []
    for prompt in prompts:
        seq = runner.new_sequence(prompt, SequenceOptions(sampler=Sampler(temperature=0), num_predict=num_predict))
        done = threading.Event()

        def sink(piece: Piece | None, done: threading.Event = done) -> None:
            if piece is None:
                done.set()

        runner.add(seq, sink)
        seqs.append(seq)
        dones.append(done)
    for done in dones:
        assert done.wait(120), "a stream did not finish"
    return [seq.num_predicted for seq in seqs]


def test_one_stream_after_four_shifted_streams(loaded):
    """Issue 33's sequence: 1 stream, 4 streams whose context shifts, 1 stream. The later stream's graphs attend
    to its own region as the first's did, and the runner keeps one pool: its compute thread's (the shifts ran on the
    batch builder, the prefix copy on the thread that added the sequence).

    The sequences are added from a thread of their own, as the runner's HTTP handlers add them from its event loop,
    which never computes a forward graph: this test's main thread may have (an earlier test's Graph.run on it
    makes it a computing thread for good), and would then copy the prefix in place, with a pool of its own."""
    cache = loaded.model.cache
    region, num_ctx = cache.region, loaded.input_cache.num_ctx
    layouts: list[tuple] = []
    prepare = cache.prepare

    def recording(batch: Batch, reserve: bool = False):
        layout = prepare(batch, reserve)
        layouts.append((batch.sequences[0], layout))
        return layout

    cache.prepare = recording
    copies: list[tuple[int, int, int]] = []
    copy_prefix = cache.copy_prefix

    def copying(source: int, destination: int, length: int) -> None:
        copies.append((source, destination, length))
        copy_prefix(source, destination, length)

    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    handlers = LongLived("handlers")

    def streams(prompts: list[str], num_predict: int) -> list[int]:
        return handlers.run(lambda: run_streams(runner, prompts, num_predict))

    try:
        words = "the little dog ran to the old tree and saw a big red ball"
        assert streams([f"Story 1: {words}"], 40) == [40]
        first = [entry for entry in layouts if len(entry[1]) == 1]
        one_pool = steady()
        layouts.clear()
        shifted = streams([f"Story {i}: {words}" for i in range(2, 6)], num_ctx + 20)
        assert shifted == [num_ctx + 20] * 4  # each went past its context: shifted on the batch builder
        layouts.clear()
        assert streams([f"Story 6: {words}"], 40) == [40]
        # multi-user cache: a prompt continuing the newest slot's prompt gets its prefix copied into the oldest
        # slot, by runner.add on the thread that adds it, as the runner's HTTP handlers do on theirs
        cache.copy_prefix = copying
        assert streams([f"Story 6: {words} and then"], 40) == [40]
        later = [entry for entry in layouts if len(entry[1]) == 1]
        assert copies, "the last prompt's prefix was not copied from another slot"
        assert steady() == one_pool, "a shift or copy left an OpenMP pool beside the compute thread's"
    finally:
        handlers.close()
        runner.close()
        cache.prepare, cache.copy_prefix = prepare, copy_prefix
    assert not errors
    # the KV view: the slot's own cells, no longer than the first stream's (both later streams)
    for seq, ((_, start, length, _, _),) in later:
        assert seq * region <= start and start + length <= (seq + 1) * region
    # (how many one-row steps each stream took depends on where exact reuse resumed its prompt: CPU-dependent)
    decode_lengths = {layout[0][2] for _, layout in first if layout[0][0] == 1}
    for slot in {seq for seq, _ in later}:
        assert {layout[0][2] for seq, layout in later if seq == slot and layout[0][0] == 1} <= decode_lengths


@pytest.mark.parametrize("builder_late", [False, True])
def test_a_full_slot_ends_alike_whichever_thread_comes_first(loaded, builder_late, monkeypatch):
    """A sequence that may not shift ends when its slot is full, and the token sampled meanwhile is dropped
    (Ollama's pipeline). Forming the next batch usually ends it before that token is sampled; when the batch
    builder comes late (a busy machine) the sampler must drop the token itself: the same count either way."""
    if builder_late:
        form = Runner._form_batch

        def late(self):
            time.sleep(0.02)  # the compute thread samples first
            return form(self)

        monkeypatch.setattr(Runner, "_form_batch", late)
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    try:
        seq = runner.new_sequence("Once upon a time there was a little girl",
                                  SequenceOptions(sampler=Sampler(temperature=1.0, seed=3), num_predict=1000,
                                                  shift=False))
        done = threading.Event()
        runner.add(seq, lambda piece: done.set() if piece is None else None)
        assert done.wait(120)
    finally:
        runner.close()
    assert not errors
    assert seq.done_reason == DoneReason.LENGTH
    assert seq.num_predicted == runner.num_ctx - seq.num_prompt_inputs


def test_one_thread_or_two_compute_the_same_streams(stories_path):
    """The builder computing its batches itself (Runner.inline, chosen where ggml's threads fill the CPUs) gives the
    streams the compute thread gives them, token for token; a compute asked for from another thread (an
    embedding's) then runs on the builder, between batches, and one asked of a closed runner is refused."""
    words = "the little dog ran to the old tree and saw a big red ball"
    texts, asked_on = {}, {}
    for inline in (False, True):
        loaded = open_model(str(stories_path), LoadParams(parallel=2, batch_size=64, kv_size=512, num_threads=THREADS),
                            allocate=True)
        loaded.model.backend.load()
        errors: list[BaseException] = []
        runner = Runner(loaded, errors.append, inline=inline)
        runner.start()
        try:
            pieces: dict[int, list[str]] = {0: [], 1: []}
            dones = []
            for i in (0, 1):
                seq = runner.new_sequence(f"Story {i}: {words}", SequenceOptions(sampler=Sampler(temperature=0),
                                                                                 num_predict=30))
                done = threading.Event()

                def sink(piece: Piece | None, mine: list[str] = pieces[i], done: threading.Event = done) -> None:
                    if piece is None:
                        done.set()
                    else:
                        mine.append(piece.text)

                runner.add(seq, sink)
                dones.append(done)
            asked = runner.submit_compute(lambda: threading.current_thread().name)
            assert all(done.wait(60) for done in dones)
            asked_on[inline] = asked.result(60)
        finally:
            runner.close()
            loaded.close()
        if inline:
            with pytest.raises(RuntimeError, match="closing"):
                runner.submit_compute(lambda: None)
        assert not errors
        texts[inline] = ["".join(p) for p in pieces.values()]
    assert texts[True] == texts[False] and all(texts[True])
    assert asked_on == {True: "batch-builder", False: "compute_0"}
