"""nemotron_h and nemotron_h_moe (Mamba-2, attention and MLP or MoE layers on kvcache.Recurrent) against
llama.cpp, batched, memory, diff, the runner.

The tiny-nemotron_h preset: six layers "M-M*M-" (Mamba-2 in 0, 2 and 4; a ReLU² MLP in 1 and 5;
attention without RoPE in 3), Mamba-2 with 4 conv taps, 8 heads of 16, 2 groups of state 32;
tiny-nemotron_h_moe the same with mixtures of 8 ungated ReLU² experts (2 used) and a shared expert in 1 and 5.
Measured against llama.cpp on the same batches: bit-identical logits in the cases run here at the time of
writing; the tolerance is 1e-4 on logprobs, as test_architectures and test_lfm2. Two sequences per batch
are compared with quantized weights only, for test_lfm2's reason (ggml's F16/F32 matmul rounds a decode
step of two rows differently from one of one row, in both engines alike).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_reference import Reference, compare_schedule, log_softmax
from memory_checks import fitted_then_allocated
from test_batch_invariance import complete, logprob_gap, run_prompts
from test_lfm2 import PROMPTS, greedy

from ollama_engine import diff
from ollama_engine.fs.synthetic import write_synthetic
from ollama_engine.kvcache import Batch, Recurrent, cache_dtype
from ollama_engine.models import ModelError, load_model
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.loop import Runner

TOLERANCE = 1e-4
MAMBA, MLP, ATTENTION = (0, 2, 4), (1, 5), (3,)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("nemotron_h")

    def write(weight_type: str = "Q8_0", arch: str = "nemotron_h", **options) -> Path:
        path = folder / f"{arch}-{weight_type}-{'-'.join(f'{k}{v}' for k, v in options.items())}.gguf"
        return path if path.exists() else write_synthetic(path, arch, weight_type=weight_type, **options)

    return write


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of a prompt, F32: the Mamba-2 scan, attention and MLP layers as llama.cpp computes them."""
    path = synthetic("F32")
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
    assert np.abs(log_softmax(ours) - log_softmax(theirs)).max() < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [
    ("F32", 1, False), ("F16", 1, True), ("Q8_0", 1, False), ("Q8_0", 2, False), ("Q8_0", 2, True),
    ("Q4_0", 2, False),
])
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    """Prompts (two of different lengths in one batch where sequences is 2, split as llama.cpp splits
    them), then eight decode steps: logprobs within TOLERANCE, the same greedy tokens."""
    worst = compare_schedule(synthetic(weight_type), flash=flash, cache_type="f16", sequences=sequences, steps=8,
                             tolerance=TOLERANCE, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [("F32", 1, False), ("Q8_0", 2, False),
                                                                 ("Q4_0", 2, True)])
def test_nemotron_h_moe_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    """nemotron_h_moe: sigmoid routing with a selection bias, normalised and scaled weights, ReLU² experts
    without a gate, plus the shared expert."""
    worst = compare_schedule(synthetic(weight_type, "nemotron_h_moe"), flash=flash, cache_type="f16",
                             sequences=sequences, steps=8, tolerance=TOLERANCE, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff: every layer's output (Mamba-2, MLP and attention layers) and the logits, bitwise."""
    result = diff.run_diff(synthetic("F32"), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert {*(f"nemotron_h_block_out-{i}" for i in range(6)), "mamba2_y_add_d-0", "attn_out-3", "l_out-1",
            "result_norm", "result_output"} <= {t.name for t in result.tensors}


@pytest.mark.parametrize(("arch", "flash"), [("nemotron_h", False), ("nemotron_h", True), ("nemotron_h_moe", False)])
def test_batched_equals_solo(synthetic, arch, flash):
    """A sequence's logits do not depend on another sequence sharing its batches (prompt of another length,
    then decode steps that cross checkpoint positions): bitwise."""
    model = load_model(synthetic(arch=arch), num_threads=1, flash_attention=flash)
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


@pytest.mark.parametrize("arch", ["nemotron_h", "nemotron_h_moe"])
def test_fit_equals_alloc_and_states_are_reported_per_layer(synthetic, arch):
    """fit reports what alloc allocates; a Mamba-2 layer's cache is its state rows (conv state and SSM
    state side by side; slots, checkpoints, a zero and a scratch row), the attention layer's its keys and
    values, and the MLP layers have none."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(synthetic(arch=arch)), params) as loaded:
        cache = loaded.model.cache
        assert isinstance(cache, Recurrent)
        report = loaded.memory.cpu.cache
        rows = 2 * (cache.checkpoint_count + 1) + 2
        conv, ssm = (4 - 1) * (128 + 2 * 2 * 32), 32 * 128
        for layer in MAMBA:
            assert report[layer] == cache.state_bytes(layer) == (conv + ssm) * 4 * rows
        assert report[ATTENTION[0]] > 0 and cache.state_bytes(ATTENTION[0]) == 0
        assert all(report[layer] == 0 for layer in MLP)
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step], sequences=[0], outputs=[0], tokens=[7]))


@pytest.mark.parametrize(("options", "message"), [
    ({"conv_width": 1}, "ssm.conv_kernel 1 must be at least 2"),
    ({"ssm_heads": 3}, "a multiple of ssm.time_step_rank 3"),
])
def test_unsupported_files_are_a_clear_error(synthetic, options, message):
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(**options), allocate=False)


def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic):
    """Through the runner's batch loop (prompts longer than a batch, shared prefixes, two slots): six
    completions one after the other, then two at a time; the same greedy tokens and logprobs, exactly."""
    solo = run_prompts(synthetic(), 2, False, concurrent=False)
    batched = run_prompts(synthetic(), 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0


def test_a_prompt_cache_hit_through_the_runner_resumes_from_a_checkpoint(synthetic):
    """A prompt sharing most of an earlier one resumes from a state checkpoint (not from position 0) and
    answers as a cold runner does."""
    story = " ".join(["the old fisherman went down to the sea every morning"] * 6)
    first, second = story + ".", story + " and he caught nothing at all that day."
    params = LoadParams(parallel=1, batch_size=16, kv_size=512, num_threads=1)
    answers, restored = [], []
    for prompts in ([first, second], [second]):
        loaded = open_model(str(synthetic()), params, allocate=True)
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
    # as in test_lfm2 (the same tokenizer and batches): the second prompt resumes at 48, from the
    # checkpoint after the first prompt's last full batch
    assert restored == [0, 48, 0]
    assert logprob_gap(answers[1], answers[0]) == 0.0
