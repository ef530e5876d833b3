"""Every KV cache type against llama.cpp with the same settings, on logprobs, alone and batched.

A quantized cache (q8_0, q4_0) needs flash attention, in llama.cpp as here (V is stored untransposed).
llama.cpp rotates queries, keys and values by a Walsh-Hadamard matrix before quantizing them into the
cache (and the attention output back); without that rotation our q4_0 logprobs were off by up to 1.0
on real SmolLM2. Real weights first: random ones hide the drift.
"""

from __future__ import annotations

import numpy as np
import pytest
from llama_reference import compare_schedule
from memory_checks import fitted_then_allocated
from synthetic.models import write_synthetic

from ollama_engine.kvcache import Batch
from ollama_engine.runner.allocate import LoadParams, open_model

# (cache type, flash attention): f16 both ways; the quantized types only with flash attention
SETTINGS = [("f16", False), ("f16", True), ("q8_0", True), ("q4_0", True)]
IDS = [f"{t}-{'flash' if f else 'matmul'}" for t, f in SETTINGS]


@pytest.mark.reference
@pytest.mark.parametrize("sequences", [1, 2], ids=["alone", "batched"])
@pytest.mark.parametrize(("cache_type", "flash"), SETTINGS, ids=IDS)
def test_real_smollm2_matches_llama_cpp(smollm2_path, cache_type, flash, sequences):
    compare_schedule(smollm2_path, flash=flash, cache_type=cache_type, sequences=sequences)


# (key type, value type, flash attention): llama.cpp's -ctk/-ctv (OLLAMA_KV_CACHE_TYPE_K/_V); a quantized V
# needs flash attention, quantized keys do not
SEPARATE = [("q8_0", "f16", False), ("q4_0", "f16", False), ("q8_0", "f16", True), ("f16", "q8_0", True),
            ("q8_0", "q4_0", True)]


@pytest.mark.reference
@pytest.mark.parametrize(("key_type", "value_type", "flash"), SEPARATE,
                         ids=[f"k-{k}-v-{v}-{'flash' if f else 'matmul'}" for k, v, f in SEPARATE])
def test_real_smollm2_separate_key_and_value_types_match_llama_cpp(smollm2_path, key_type, value_type, flash):
    compare_schedule(smollm2_path, flash=flash, cache_type=key_type, value_cache_type=value_type, sequences=2)


def test_separate_types_reach_the_cache_and_its_memory_report(smollm2_path):
    """K q8_0 and V f16 without flash attention: the keys take 34/64 of an f16 cache's bytes, values all."""
    sizes = {}
    for key_type, value_type in (("f16", "f16"), ("q8_0", "f16")):
        params = LoadParams(kv_cache_type="f16", kv_cache_type_k=key_type, kv_cache_type_v=value_type,
                            kv_size=512, batch_size=64, num_threads=2)
        loaded = open_model(str(smollm2_path), params, allocate=False)
        try:
            sizes[key_type] = sum(loaded.memory.cpu.cache)
        finally:
            loaded.close()
    assert sizes["q8_0"] / sizes["f16"] == pytest.approx((34 / 32 / 2 + 1) / 2, rel=1e-3)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-types")
    return {
        # head size 16: too small for llama.cpp's rotation, the plain quantized path
        "llama-head16": write_synthetic(folder / "llama16.gguf", "llama"),
        # head size 64: rotated keys and values
        "qwen2-head64": write_synthetic(folder / "qwen2-64.gguf", "qwen2", n_embd=256, n_head=4, n_head_kv=2),
    }


# Random weights give sharp, badly calibrated logits that magnify a last-bit difference (one that flips
# an 8-bit rounding of a key); measured up to 9e-4 (q8_0), 1.5e-4 (f16), against 0 to 2e-5 on SmolLM2.
SYNTHETIC_TOLERANCE = 2e-3


@pytest.mark.reference
@pytest.mark.parametrize(("name", "cache_type", "flash"), [
    *[("qwen2-head64", t, f) for t, f in SETTINGS],
    ("llama-head16", "f16", False), ("llama-head16", "f16", True),  # a quantized row needs 32 elements
])
def test_synthetic_models_match_llama_cpp(synthetic, name, cache_type, flash):
    compare_schedule(synthetic[name], flash=flash, cache_type=cache_type, sequences=2, steps=4,
                     tolerance=SYNTHETIC_TOLERANCE)


def test_quantized_cache_needs_whole_blocks(synthetic):
    params = LoadParams(kv_cache_type="q8_0", flash_attention=True, kv_size=256, batch_size=16)
    with pytest.raises(ValueError, match="multiple of 32"):
        open_model(str(synthetic["llama-head16"]), params, allocate=False)


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_quantized_cache_memory_report_equals_allocation(synthetic, cache_type):
    """fit reports what alloc allocates, and batches of every shape (several sequences, prompts and
    decode side by side) compute without allocating more."""
    path = str(synthetic["qwen2-head64"])
    params = LoadParams(parallel=2, batch_size=16, kv_size=512, kv_cache_type=cache_type, flash_attention=True,
                        num_threads=2)
    with fitted_then_allocated(path, params) as loaded:
        assert all(c > 0 for c in loaded.memory.cpu.cache[:-1])
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(15), sequences=[0] * 15, outputs=[14], tokens=[3] * 15))
        graphs.compute(Batch(positions=[15, 0, 1], sequences=[0, 1, 1], outputs=[0, 2], tokens=[4, 5, 6]))
        graphs.compute(Batch(positions=[16, 2], sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


def test_hadamard_rotation_is_orthonormal_and_matches_numpy():
    from ollama_engine.ml import Backend, hadamard_matrix

    matrix = hadamard_matrix(64)
    np.testing.assert_allclose(matrix @ matrix, np.eye(64), atol=1e-6)
    x = np.random.default_rng(0).standard_normal((3, 2, 128)).astype(np.float32)  # numpy order: ne0 = 128
    with Backend(None) as backend, backend.new_context() as ctx:
        rotated = ctx.input().from_numpy(x).hadamard(ctx.input().from_numpy(matrix))
        back = rotated.hadamard(ctx.input().from_numpy(matrix))
        ctx.compute(rotated, back)
        expected = (x.reshape(-1, 64) @ matrix.T).reshape(x.shape)
        np.testing.assert_allclose(rotated.numpy(), expected, atol=1e-5)
        np.testing.assert_allclose(back.numpy(), x, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_context_shift_of_a_quantized_cache_matches_llama_cpp(smollm2_path, cache_type):
    """Drop positions [3, 8) and move the rest down in both engines: rotated, quantized keys are
    dequantized, rotated back, re-rotated by RoPE, rotated and quantized again, as llama.cpp does."""
    from llama_reference import Reference, log_softmax

    from ollama_engine.kvcache import cache_dtype
    from ollama_engine.models import load_model

    keep, discard = 3, 5
    model = load_model(smollm2_path, num_threads=2, flash_attention=True)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype(cache_type), 1, 512, 64)
    reference = Reference(smollm2_path, n_ctx=512, n_batch=64, flash_attention=True, cache_type=cache_type)
    try:
        tokens = model.tokenizer.encode("In a small village by the sea, there lived a fisherman", add_special=True)
        n = len(tokens)
        ours = model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=[n - 1], tokens=tokens))
        theirs = reference.decode(tokens, range(n), [0] * n, [n - 1])
        model.cache.remove(0, keep, keep + discard)
        lib = reference.lib
        memory = lib.llama_get_memory(reference.ctx)
        assert lib.llama_memory_seq_rm(memory, 0, keep, keep + discard)
        lib.llama_memory_seq_add(memory, 0, keep + discard, -1, -discard)
        position = n - discard
        for _ in range(6):
            token = int(ours[0].argmax())
            assert token == int(theirs[0].argmax())
            ours = model.graphs.compute(Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token]))
            theirs = reference.decode([token], [position], [0], [0])
            assert np.abs(log_softmax(ours) - log_softmax(theirs)).max() < 1e-4
            position += 1
    finally:
        reference.close()
        model.close()
