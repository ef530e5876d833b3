"""lfm2 and lfm2moe (short convolutions and attention on kvcache.Recurrent) against llama.cpp, batched,
memory, diff, the runner.

The tiny-lfm2 preset: four layers, short convolutions (3 taps) in layers 0 and 2, attention in 1 and 3;
tiny-lfm2moe the same with mixtures of 8 experts (2 used) after its first layer.
Measured against llama.cpp on the same batches: bit-identical logits in every case below (tolerance 1e-4
on logprobs, as test_architectures). Two sequences per batch are compared with quantized weights only:
with F16 or F32 weights, ggml's matmul rounds a decode step of two rows differently from one of one row
(both engines alike: llama.cpp's own solo and batched runs differ by up to 2e-3 here), which is not this
cache's doing; with Q8_0 and Q4_0 weights batched equals solo bitwise in both engines.
"""

from __future__ import annotations

import pytest
from recurrent_checks import (
    DECODING_CASES,
    MOE_DECODING_CASES,
    TOLERANCE,
    assert_a_cache_hit_resumes_from_a_checkpoint,
    assert_batch_loop_gives_batched_the_solo_logprobs,
    assert_batched_equals_solo,
    assert_diff_finds_every_tensor_equal,
    assert_states_fit_and_run,
    decoding_gap,
    prompt_logprob_gap,
)

from ollama_engine.models import ModelError, load_model


@pytest.fixture(scope="module")
def synthetic(synthetic_model):
    """synthetic(weight_type="Q8_0", arch="lfm2", **options) -> the GGUF."""
    return lambda weight_type="Q8_0", arch="lfm2", **options: synthetic_model(arch, weight_type, **options)


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of a prompt, F32: the short convolutions and attention layers as llama.cpp computes them."""
    assert prompt_logprob_gap(synthetic("F32")) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), DECODING_CASES)
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    assert decoding_gap(synthetic(weight_type), sequences, flash) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), MOE_DECODING_CASES)
def test_lfm2moe_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    """lfm2moe: a dense first layer, then mixtures (sigmoid routing, selection bias, normalised weights)."""
    assert decoding_gap(synthetic(weight_type, "lfm2moe"), sequences, flash) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [("F32", 1, False), ("Q8_0", 2, True)])
def test_sliding_window_attention_matches(synthetic, weight_type, sequences, flash):
    """attention.sliding_window 8 (every attention layer slides): prompts and decoding past the window."""
    assert decoding_gap(synthetic(weight_type, sliding_window=8), sequences, flash) < TOLERANCE


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff: every layer's output (convolution and attention layers) and the logits, bitwise."""
    assert_diff_finds_every_tensor_equal(synthetic("F32"), {"l_out-0", "l_out-1", "l_out-2", "l_out-3",
                                                            "result_norm", "result_output"})


@pytest.mark.parametrize(("arch", "flash"), [("lfm2", False), ("lfm2", True), ("lfm2moe", False)])
def test_batched_equals_solo(synthetic, arch, flash):
    assert_batched_equals_solo(synthetic(arch=arch), flash)


@pytest.mark.parametrize("arch", ["lfm2", "lfm2moe"])
def test_fit_equals_alloc_and_states_are_reported_per_layer(synthetic, arch):
    """The convolution layers' cache is their state rows (3 - 1 taps of 64 channels, F32), the attention
    layers' their keys and values."""
    assert_states_fit_and_run(synthetic(arch=arch), {0: (3 - 1) * 64 * 4, 2: (3 - 1) * 64 * 4}, attention=(1, 3))


@pytest.mark.parametrize(("options", "message"), [
    ({"conv_width": 1}, "shortconv.l_cache must be at least 2"),
    ({"sliding_window": 1}, "attention.sliding_window must be in 2.."),
])
def test_unsupported_files_are_a_clear_error(synthetic, options, message):
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(**options), allocate=False)


def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic):
    assert_batch_loop_gives_batched_the_solo_logprobs(synthetic())


def test_a_prompt_cache_hit_through_the_runner_resumes_from_a_checkpoint(synthetic):
    assert_a_cache_hit_resumes_from_a_checkpoint(synthetic())
