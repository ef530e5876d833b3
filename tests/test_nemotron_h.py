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

MAMBA, MLP, ATTENTION = (0, 2, 4), (1, 5), (3,)


@pytest.fixture(scope="module")
def synthetic(synthetic_model):
    """synthetic(weight_type="Q8_0", arch="nemotron_h", **options) -> the GGUF."""
    return lambda weight_type="Q8_0", arch="nemotron_h", **options: synthetic_model(arch, weight_type, **options)


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of a prompt, F32: the Mamba-2 scan, attention and MLP layers as llama.cpp computes them."""
    assert prompt_logprob_gap(synthetic("F32")) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), DECODING_CASES)
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    assert decoding_gap(synthetic(weight_type), sequences, flash) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), MOE_DECODING_CASES)
def test_nemotron_h_moe_greedy_decoding_matches(synthetic, weight_type, sequences, flash):
    """nemotron_h_moe: sigmoid routing with a selection bias, normalised and scaled weights, ReLU² experts
    without a gate, plus the shared expert."""
    assert decoding_gap(synthetic(weight_type, "nemotron_h_moe"), sequences, flash) < TOLERANCE


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff: every layer's output (Mamba-2, MLP and attention layers) and the logits, bitwise."""
    assert_diff_finds_every_tensor_equal(synthetic("F32"), {
        *(f"nemotron_h_block_out-{i}" for i in range(6)), "mamba2_y_add_d-0", "attn_out-3", "l_out-1",
        "result_norm", "result_output"})


@pytest.mark.parametrize(("arch", "flash"), [("nemotron_h", False), ("nemotron_h", True), ("nemotron_h_moe", False)])
def test_batched_equals_solo(synthetic, arch, flash):
    assert_batched_equals_solo(synthetic(arch=arch), flash)


@pytest.mark.parametrize("arch", ["nemotron_h", "nemotron_h_moe"])
def test_fit_equals_alloc_and_states_are_reported_per_layer(synthetic, arch):
    """A Mamba-2 layer's cache is its state rows (conv state and SSM state side by side, F32), the attention
    layer's its keys and values, and the MLP layers have none."""
    conv, ssm = (4 - 1) * (128 + 2 * 2 * 32), 32 * 128
    assert_states_fit_and_run(synthetic(arch=arch), dict.fromkeys(MAMBA, (conv + ssm) * 4), ATTENTION, MLP)


@pytest.mark.parametrize(("options", "message"), [
    ({"conv_width": 1}, "ssm.conv_kernel 1 must be at least 2"),
    ({"ssm_heads": 3}, "a multiple of ssm.time_step_rank 3"),
])
def test_unsupported_files_are_a_clear_error(synthetic, options, message):
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(**options), allocate=False)


def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic):
    assert_batch_loop_gives_batched_the_solo_logprobs(synthetic())


def test_a_prompt_cache_hit_through_the_runner_resumes_from_a_checkpoint(synthetic):
    """As for lfm2 (the same tokenizer and batches): the second prompt resumes at 48."""
    assert_a_cache_hit_resumes_from_a_checkpoint(synthetic())
