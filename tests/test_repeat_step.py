"""A decode step formed in place (Runner._repeat, Graphs.repeat, Causal.repeat): bit for bit what forming, placing
and binding the batch anew gives, and refused wherever it would not be."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ollama_engine.kvcache import Batch
from ollama_engine.ml import DType
from ollama_engine.models import load_model
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import Piece, SequenceOptions
from ollama_engine.sample import Sampler

FORM_IN_PLACE = Runner._repeat
PROMPTS = ["Once upon a time, there was a little girl named Lily. She", "The dog ran to the park and", "Tom had a"]


# ------------------------------------------------------------ through the runner


def decode_all(path, monkeypatch, repeat: bool, kv_size: int, num_predict: list[int]) -> tuple[list, int]:
    """Each prompt's text and logprobs, and the steps formed in place. The first two start together, the third
    joins once the first has sent 5 pieces (added from its sink, on the batch loop's thread: at the same step in
    every run), and they leave at their num_predict."""
    formed = [0]

    def counted(self, previous):
        state = FORM_IN_PLACE(self, previous) if repeat else None
        formed[0] += state is not None
        return state

    monkeypatch.setattr(Runner, "_repeat", counted)
    loaded = open_model(str(path), LoadParams(parallel=4, batch_size=64, kv_size=kv_size, num_threads=2,
                                                      flash_attention=False), allocate=True)
    try:
        loaded.model.backend.load()
        runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"), inline=True, stream_interval=0)
        outputs: list[list[Piece]] = [[] for _ in PROMPTS]
        done = [threading.Event() for _ in PROMPTS]
        seqs = [runner.new_sequence(prompt, SequenceOptions(sampler=Sampler(temperature=0), logprobs=True,
                                                            top_logprobs=3, num_predict=num_predict[i]))
                for i, prompt in enumerate(PROMPTS)]

        def sink(piece: Piece | None, i: int) -> None:
            if piece is None:
                done[i].set()
                return
            outputs[i].append(piece)
            if i == 0 and len(outputs[0]) == 5:
                runner.add(seqs[2], lambda piece: sink(piece, 2))

        for i in (0, 1):
            runner.add(seqs[i], lambda piece, i=i: sink(piece, i))
        runner.start()
        try:
            assert all(event.wait(120) for event in done)
        finally:
            runner.close()
    finally:
        loaded.close()
    return [("".join(p.text for p in pieces), [entry for p in pieces for entry in p.logprobs])
            for pieces in outputs], formed[0]


@pytest.mark.parametrize("model", ["stories260K", "smollm2"])
@pytest.mark.parametrize("kv_size, num_predict", [(2048, [300, 120, 200]), (512, [200, 60, 150])],
                         ids=["past-the-padding", "context-shift"])
def test_steps_formed_in_place_give_what_steps_formed_anew_give(model, kv_size, num_predict, stories_path,
                                                                 smollm2_path, monkeypatch):
    """Three sequences joining and leaving, histories growing past 256 cells (a new layout) and, with 128 cells a
    slot, shifting their context: the same texts and logprobs, bitwise, and most steps formed in place. On the real
    TinyStories llama (F32) and SmolLM2-135M Q4_1 (from PyPI)."""
    path = {"stories260K": stories_path, "smollm2": smollm2_path}[model]
    anew, none = decode_all(path, monkeypatch, False, kv_size, num_predict)
    in_place, formed = decode_all(path, monkeypatch, True, kv_size, num_predict)
    assert none == 0
    assert formed > max(num_predict) // 2, formed  # steps, of the sequences together
    for i, (expected, got) in enumerate(zip(anew, in_place, strict=True)):
        assert got[0] == expected[0], f"sequence {i}"
        assert got[1] == expected[1], f"sequence {i}: logprobs"


# ------------------------------------------------------------ the graphs and the cache


def open_tiny(path, sequences: int = 2):
    model = load_model(path, num_threads=1)
    model.backend.load()
    model.cache.init(model.backend, DType.F16, sequences, 512, 64)
    return model


def step(model, batch: Batch) -> np.ndarray:
    graph = model.graphs.acquire(batch)
    try:
        graph.bind(batch)
        return graph.run()
    finally:
        model.graphs.release(graph)


def last_graph(model):
    """The graph computed last (the most recently used one Graphs keeps)."""
    return model.graphs._kept[next(reversed(model.graphs._kept))]


def prompts(model) -> None:
    for seq, tokens in enumerate(([5, 6, 7, 8, 9], [10, 11, 12])):
        step(model, Batch(positions=range(len(tokens)), sequences=[seq] * len(tokens), outputs=[len(tokens) - 1],
                          tokens=tokens))


def decoding(model) -> tuple[Batch, object]:
    """Both prompts, then a decode step of the first sequence: the step's batch and graph."""
    prompts(model)
    batch = Batch(positions=[5], sequences=[0], outputs=[0], tokens=[1])
    step(model, batch)
    return batch, last_graph(model)


def test_the_cache_places_a_repeated_step_as_prepare_would(synthetic_model):
    """Two sequences decoding together (their rows stacked), 300 steps, crossing the 256-cell padding: in place
    where it can be, the logits and the cache's cells those of batches acquired anew."""
    path = synthetic_model("llama")
    repeated, fresh = open_tiny(path), open_tiny(path)
    try:
        prompts(repeated)
        prompts(fresh)
        batch = None
        kept = refused = 0
        for n in range(300):
            positions, tokens = [5 + n, 3 + n], [20 + n % 50, 30 + n % 50]
            expected = step(fresh, Batch(positions=positions, sequences=[0, 1], outputs=[0, 1], tokens=tokens))
            graph = last_graph(repeated)
            if batch is not None and repeated.graphs.repeat(graph, batch):
                kept += 1
                assert batch.positions.tolist() == positions
                batch.tokens[:] = tokens
                try:
                    got = graph.run()
                finally:
                    repeated.graphs.release(graph)
            else:
                refused += 1
                batch = Batch(positions=positions, sequences=[0, 1], outputs=[0, 1], tokens=tokens)
                got = step(repeated, batch)
            np.testing.assert_array_equal(got, expected, err_msg=f"step {n}")
            np.testing.assert_array_equal(repeated.cache._used, fresh.cache._used)
            np.testing.assert_array_equal(repeated.cache._pos[fresh.cache._used], fresh.cache._pos[fresh.cache._used])
        assert kept > 290 and refused >= 2  # the first step, and histories passing 256 cells
    finally:
        repeated.close()
        fresh.close()


def test_a_repeat_is_refused_where_prepare_must_place_the_batch(synthetic_model):
    model = open_tiny(synthetic_model("llama"))
    try:
        batch, graph = decoding(model)
        assert model.graphs.repeat(graph, batch)  # the usual case
        model.graphs.release(graph)
        model.cache.remove(1, 0)  # the cache changed since
        before = batch.positions.tolist()
        assert not model.graphs.repeat(graph, batch)
        assert batch.positions.tolist() == before  # nothing changed

        several = Batch(positions=[6, 7], sequences=[0, 0], outputs=[0, 1], tokens=[1, 2])
        step(model, several)
        assert not model.graphs.repeat(last_graph(model), several)

        # a used cell of a later position in the row's history: prepare hides it, adding the row's cell would not
        model.cache.remove(0, 0)
        step(model, Batch(positions=range(10, 15), sequences=[0] * 5, outputs=[4], tokens=[1] * 5))
        early = Batch(positions=[5], sequences=[0], outputs=[0], tokens=[1])
        step(model, early)
        assert not model.graphs.repeat(last_graph(model), early)
    finally:
        model.close()


def test_a_sliding_window_cache_is_always_prepared(synthetic_model):
    model = open_tiny(synthetic_model("gemma3"))
    try:
        batch, graph = decoding(model)
        assert not model.graphs.repeat(graph, batch)
    finally:
        model.close()


# ------------------------------------------------------------ against llama.cpp


@pytest.mark.reference
def test_steps_formed_in_place_match_llama_cpp_on_real_smollm2(smollm2_path, monkeypatch):
    """Two sequences decoding together through the runner, most steps formed in place: every token's logprob
    within 1e-4 of llama.cpp's, which decodes each sequence alone (prompt, then token by token), and the same
    greedy tokens (SmolLM2-135M Q4_1's rows are rounded as alone: batched == solo)."""
    from llama_reference import Reference, log_softmax

    formed = [0]

    def counted(self, previous):
        state = FORM_IN_PLACE(self, previous)
        formed[0] += state is not None
        return state

    monkeypatch.setattr(Runner, "_repeat", counted)
    loaded = open_model(str(smollm2_path), LoadParams(parallel=2, batch_size=64, kv_size=1024, num_threads=2,
                                                      flash_attention=False), allocate=True)
    runs = []
    try:
        loaded.model.backend.load()
        runner = Runner(loaded, lambda err: pytest.fail(f"runner failed: {err}"), inline=True, stream_interval=0)
        done = [threading.Event() for _ in PROMPTS[:2]]
        logprobs: list[list[dict]] = [[], []]
        for i, prompt in enumerate(PROMPTS[:2]):
            seq = runner.new_sequence(prompt, SequenceOptions(sampler=Sampler(temperature=0), logprobs=True,
                                                              num_predict=40))
            runner.add(seq, lambda piece, i=i: done[i].set() if piece is None else logprobs[i].extend(piece.logprobs))
            runs.append(seq)
        runner.start()
        try:
            assert all(event.wait(120) for event in done)
        finally:
            runner.close()
        # the slot holds the prompt and every generated token but the last (never computed)
        histories = [[inp.token for inp in seq.slot.inputs] for seq in runs]
        prompt_lengths = [seq.num_prompt_inputs for seq in runs]
    finally:
        loaded.close()
    assert formed[0] > 20
    for history, length, got in zip(histories, prompt_lengths, logprobs, strict=True):
        reference = Reference(smollm2_path, n_ctx=512, n_batch=64)
        try:
            rows = [reference.decode(history[:length], range(length), [0] * length, [length - 1])[0]]
            rows += [reference.decode([token], [position], [0], [0])[0]
                     for position, token in enumerate(history[length:], start=length)]
        finally:
            reference.close()
        generated = history[length:]
        assert len(got) == len(generated) + 1
        for k, (row, entry) in enumerate(zip(rows, got, strict=False)):
            expected = log_softmax(row)
            token = int(row.argmax())
            if k < len(generated):
                assert token == generated[k], f"step {k}: greedy tokens differ"
            assert abs(float(expected[token]) - entry["logprob"]) < 1e-4, f"step {k}"
