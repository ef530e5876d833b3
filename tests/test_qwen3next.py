"""qwen3next, qwen35 and qwen35moe (gated DeltaNet and gated full attention on kvcache.Recurrent,
mixtures with a shared expert) against llama.cpp, batched, memory, diff, the runner.

The tiny-qwen3next preset: four layers, gated DeltaNet in 0-2 (2 key heads of 16 each serving 2 of the 4
value heads, 4 conv taps), gated full attention in 3 (head size 32, NeoX RoPE over 8 dims); every layer
a mixture of 8 SwiGLU experts (2 used) plus a sigmoid-gated shared expert. tiny-qwen35 and tiny-qwen35moe:
the same shapes with beta and alpha projected apart, value heads reading key heads in qwen35's order,
multimodal RoPE (sections 2, 1, 1, 0), and a SwiGLU FFN (qwen35) or the mixtures (qwen35moe).
Measured against llama.cpp (which runs its fused ggml_gated_delta_net on the CPU, as we do) on the same
batches: bit-identical logits in the cases run here at the time of writing; the tolerance is 1e-4 on
logprobs, as test_lfm2. Two sequences per batch are compared with quantized weights only, for
test_lfm2's reason.
"""

from __future__ import annotations

import pytest
from recurrent_checks import (
    MOE_DECODING_CASES,
    TOLERANCE,
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
    """synthetic(weight_type="Q8_0", arch="qwen3next", **options) -> the GGUF."""
    return lambda weight_type="Q8_0", arch="qwen3next", **options: synthetic_model(arch, weight_type, **options)


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of a prompt, F32: DeltaNet, gated attention and the mixtures as llama.cpp computes them."""
    assert prompt_logprob_gap(synthetic("F32")) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash", "options"), [
    ("F32", 1, False, {}), ("F16", 1, True, {}), ("Q8_0", 1, False, {}), ("Q8_0", 2, False, {}),
    ("Q8_0", 2, True, {}), ("Q4_0", 2, False, {}),
    ("Q8_0", 2, False, {"full_attention_interval": 2}),  # attention in layers 1 and 3
    ("F32", 1, False, {"ssm_groups": 4, "ssm_state": 16, "ssm_inner": 64}),  # as many key heads as value heads
])
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash, options):
    assert decoding_gap(synthetic(weight_type, **options), sequences, flash) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), MOE_DECODING_CASES)
def test_qwen35_greedy_decoding_matches(synthetic, arch, weight_type, sequences, flash):
    """qwen35 and qwen35moe: beta and alpha apart, key heads broadcast in qwen35's order, multimodal RoPE."""
    assert decoding_gap(synthetic(weight_type, arch), sequences, flash) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic, arch):
    """ollama-engine diff: every layer's output (DeltaNet and attention layers) and the logits, bitwise."""
    assert_diff_finds_every_tensor_equal(synthetic("F32", arch), {
        *(f"l_out-{i}" for i in range(4)), "linear_attn_out-0", "attn_output-3", "result_norm", "result_output"})


@pytest.mark.parametrize(("arch", "flash"), [("qwen3next", False), ("qwen3next", True), ("qwen35", False),
                                            ("qwen35moe", True)])
def test_batched_equals_solo(synthetic, arch, flash):
    assert_batched_equals_solo(synthetic(arch=arch), flash)


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_fit_equals_alloc_and_states_are_reported_per_layer(synthetic, arch):
    """A DeltaNet layer's cache is its state rows (conv state and the delta rule's state side by side, F32),
    the attention layer's its keys and values."""
    conv, delta = (4 - 1) * (2 * 2 * 16 + 64), 16 * 16 * 4
    assert_states_fit_and_run(synthetic(arch=arch), dict.fromkeys((0, 1, 2), (conv + delta) * 4), attention=(3,))


@pytest.mark.parametrize(("options", "message"), [
    ({"conv_width": 1}, "ssm.conv_kernel 1 at least 2"),
    ({"ssm_groups": 3}, "ssm.time_step_rank 4 a multiple of ssm.group_count 3"),
    ({"arch": "qwen35", "rope_sections": (3, 2, 0, 0)}, "rope.dimension_sections .* at most 4 in all"),
])
def test_unsupported_files_are_a_clear_error(synthetic, options, message):
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(**options), allocate=False)


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic, arch):
    assert_batch_loop_gives_batched_the_solo_logprobs(synthetic(arch=arch))
