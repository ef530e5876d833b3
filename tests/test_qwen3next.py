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

from pathlib import Path

import numpy as np
import pytest
from llama_reference import Reference, compare_schedule, log_softmax
from memory_checks import fitted_then_allocated
from test_batch_invariance import logprob_gap, run_prompts
from test_lfm2 import PROMPTS, greedy

from ollama_engine import diff
from ollama_engine.fs.synthetic import write_synthetic
from ollama_engine.kvcache import Batch, Recurrent, cache_dtype
from ollama_engine.models import ModelError, load_model
from ollama_engine.runner.allocate import LoadParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("qwen3next")

    def write(weight_type: str = "Q8_0", arch: str = "qwen3next", **options) -> Path:
        path = folder / f"{arch}-{weight_type}-{'-'.join(f'{k}{v}' for k, v in options.items())}.gguf"
        return path if path.exists() else write_synthetic(path, arch, weight_type=weight_type, **options)

    return write


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of a prompt, F32: DeltaNet, gated attention and the mixtures as llama.cpp computes them."""
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
@pytest.mark.parametrize(("weight_type", "sequences", "flash", "options"), [
    ("F32", 1, False, {}), ("F16", 1, True, {}), ("Q8_0", 1, False, {}), ("Q8_0", 2, False, {}),
    ("Q8_0", 2, True, {}), ("Q4_0", 2, False, {}),
    ("Q8_0", 2, False, {"full_attention_interval": 2}),  # attention in layers 1 and 3
    ("F32", 1, False, {"ssm_groups": 4, "ssm_state": 16, "ssm_inner": 64}),  # as many key heads as value heads
])
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash, options):
    """Prompts (two of different lengths in one batch where sequences is 2, split as llama.cpp splits
    them), then eight decode steps: logprobs within TOLERANCE, the same greedy tokens."""
    worst = compare_schedule(synthetic(weight_type, **options), flash=flash, cache_type="f16", sequences=sequences,
                             steps=8, tolerance=TOLERANCE, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [("F32", 1, False), ("Q8_0", 2, False),
                                                                 ("Q4_0", 2, True)])
def test_qwen35_greedy_decoding_matches(synthetic, arch, weight_type, sequences, flash):
    """qwen35 and qwen35moe: beta and alpha apart, key heads broadcast in qwen35's order, multimodal RoPE."""
    worst = compare_schedule(synthetic(weight_type, arch), flash=flash, cache_type="f16", sequences=sequences,
                             steps=8, tolerance=TOLERANCE, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic, arch):
    """ollama-engine diff: every layer's output (DeltaNet and attention layers) and the logits, bitwise."""
    result = diff.run_diff(synthetic("F32", arch), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert {*(f"l_out-{i}" for i in range(4)), "linear_attn_out-0", "attn_output-3", "result_norm",
            "result_output"} <= {t.name for t in result.tensors}


@pytest.mark.parametrize(("arch", "flash"), [("qwen3next", False), ("qwen3next", True), ("qwen35", False),
                                            ("qwen35moe", True)])
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


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35"])
def test_fit_equals_alloc_and_states_are_reported_per_layer(synthetic, arch):
    """fit reports what alloc allocates; a DeltaNet layer's cache is its state rows (conv state and the
    delta rule's state side by side; slots, checkpoints, a zero and a scratch row), the attention layer's
    its keys and values."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(synthetic(arch=arch)), params) as loaded:
        cache = loaded.model.cache
        assert isinstance(cache, Recurrent)
        report = loaded.memory.cpu.cache
        rows = 2 * (cache.checkpoint_count + 1) + 2
        conv, delta = (4 - 1) * (2 * 2 * 16 + 64), 16 * 16 * 4
        for layer in (0, 1, 2):
            assert report[layer] == cache.state_bytes(layer) == (conv + delta) * 4 * rows
        assert report[3] > 0 and cache.state_bytes(3) == 0
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step], sequences=[0], outputs=[0], tokens=[7]))


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
    """Through the runner's batch loop (prompts longer than a batch, shared prefixes, two slots): six
    completions one after the other, then two at a time; the same greedy tokens and logprobs, exactly."""
    solo = run_prompts(synthetic(arch=arch), 2, False, concurrent=False)
    batched = run_prompts(synthetic(arch=arch), 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0
