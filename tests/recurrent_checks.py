"""Checks every architecture on kvcache.Recurrent runs (test_lfm2, test_nemotron_h, test_qwen3next): one copy
of each, so that a fix to one check reaches all of them.

Each takes the synthetic GGUF to check; what differs between architectures (which layers hold state and how
much, which tensors diff must find) is a parameter.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
from decoding import decode_together
from llama_reference import Reference, compare_schedule, log_softmax
from memory_checks import fitted_then_allocated
from test_batch_invariance import complete, logprob_gap, run_prompts

from ollama_engine import diff
from ollama_engine.kvcache import Batch, Recurrent, cache_dtype
from ollama_engine.models import load_model
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner

TOLERANCE = 1e-4  # on logprobs, as test_architectures
PROMPTS = ("In a small village by the sea, there lived a fisherman who had three sons",
           "Once upon a time there was a king who ruled")  # past min_position 16: checkpoints are written too
# (weight_type, sequences, flash) for a dense preset and for its mixture-of-experts sibling; two sequences per
# batch with quantized weights only (ggml's F16/F32 matmul rounds a decode step of two rows differently from one
# of one row, in both engines alike)
DECODING_CASES = [("F32", 1, False), ("F16", 1, True), ("Q8_0", 1, False), ("Q8_0", 2, False), ("Q8_0", 2, True),
                  ("Q4_0", 2, False)]
MOE_DECODING_CASES = [("F32", 1, False), ("Q8_0", 2, False), ("Q4_0", 2, True)]


def decoding_gap(path: object, sequences: int, flash: bool) -> float:
    """PROMPTS (two of different lengths in one batch where sequences is 2, split as llama.cpp splits them),
    then eight decode steps against llama.cpp: the largest logprob difference (the greedy tokens must agree)."""
    return compare_schedule(path, flash=flash, cache_type="f16", sequences=sequences, steps=8, tolerance=TOLERANCE,
                            prompts=PROMPTS)


def prompt_logprob_gap(path: object) -> float:
    """Every row of PROMPTS[0] in one batch, ours against llama.cpp's: the largest logprob difference."""
    model = load_model(path, num_threads=2)
    reference = Reference(path, n_ctx=512, n_batch=64)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
        tokens = model.tokenizer.encode(PROMPTS[0], add_special=True)
        n = len(tokens)
        ours = model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=range(n), tokens=tokens))
        theirs = reference.decode(tokens, range(n), [0] * n, range(n))
    finally:
        reference.close()
        model.close()
    return float(np.abs(log_softmax(ours) - log_softmax(theirs)).max())


def assert_diff_finds_every_tensor_equal(path: object, names: Collection[str]) -> None:
    """ollama-engine diff on PROMPTS[0]: every tensor bitwise equal to llama.cpp's, `names` among them."""
    result = diff.run_diff(path, PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert set(names) <= {t.name for t in result.tensors}


def greedy(model, seqs: list[int], steps: int = 12) -> dict[int, list[np.ndarray]]:
    """Each sequence's logits after its prompt and `steps` greedy steps, sequences batched together."""
    for s in seqs:
        model.cache.remove(s, 0)
    return decode_together(model, PROMPTS, seqs, steps)


def assert_batched_equals_solo(path: object, flash: bool) -> None:
    """A sequence's logits do not depend on another sequence sharing its batches (prompt of another length,
    then decode steps that cross checkpoint positions): bitwise."""
    model = load_model(path, num_threads=1, flash_attention=flash)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        together = greedy(model, [0, 1])
        assert model.cache.checkpoints(0) and model.cache.checkpoints(1)
        for s in (0, 1):
            for step, (a, b) in enumerate(zip(greedy(model, [s])[s], together[s], strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")
    finally:
        model.close()


def assert_states_fit_and_run(path: object, state_row_bytes: Mapping[int, int], attention: Collection[int],
                              stateless: Collection[int] = ()) -> None:
    """fit reports what alloc allocates; a recurrent layer's cache is `state_row_bytes[layer]` times its rows
    (2 slots with their checkpoints and resume checkpoints, a zero and a scratch row), an attention layer's its
    keys and values, a `stateless` layer's nothing; then a prompt batch and three decode steps compute."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(path), params) as loaded:
        cache = loaded.model.cache
        assert isinstance(cache, Recurrent)
        report = loaded.memory.cpu.cache
        rows = 2 * (cache.checkpoint_count + cache.resume_count + 1) + 2
        for layer, row_bytes in state_row_bytes.items():
            assert report[layer] == cache.state_bytes(layer) == row_bytes * rows, layer
        for layer in attention:
            assert report[layer] > 0 and cache.state_bytes(layer) == 0, layer
        for layer in stateless:
            assert report[layer] == 0, layer
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step], sequences=[0], outputs=[0], tokens=[7]))


def assert_batch_loop_gives_batched_the_solo_logprobs(path: object) -> None:
    """Through the runner's batch loop (prompts longer than a batch, shared prefixes, two slots): six
    completions one after the other, then two at a time; the same greedy tokens and logprobs, exactly."""
    solo = run_prompts(path, 2, False, concurrent=False)
    batched = run_prompts(path, 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0


def assert_a_cache_hit_resumes_from_a_checkpoint(path: object) -> None:
    """A prompt sharing most of an earlier one resumes from a state checkpoint (not from position 0) and
    answers as a cold runner does."""
    story = " ".join(["the old fisherman went down to the sea every morning"] * 6)
    first, second = story + ".", story + " and he caught nothing at all that day."
    params = LoadParams(parallel=1, batch_size=16, kv_size=512, num_threads=1)
    answers, restored = [], []
    for prompts in ([first, second], [second]):
        loaded = open_model(str(path), params, allocate=True)
        loaded.model.backend.load()

        def spy(seq: int, begin: int, end: int | None = None, remove=loaded.model.cache.remove) -> None:
            restored.append(begin)
            remove(seq, begin, end)

        loaded.model.cache.remove = spy
        errors: list[BaseException] = []
        runner = Runner(loaded, errors.append)
        runner.start()
        try:
            answers.append([complete(runner, prompt) for prompt in prompts][-1])
        finally:
            runner.close()
            loaded.close()
        assert not errors
    # the first prompt (61 inputs with these tokenizers, batches of 16) left checkpoints after positions 31 (its
    # first batch past min_position 16), 47 (its last full batch) and 60 (its end); exact reuse (runner/exact.py)
    # resumes the second prompt (69 inputs) at a batch boundary, 48, from the checkpoint after 47
    assert restored == [0, 48, 0]
    assert logprob_gap(answers[1], answers[0]) == 0.0
