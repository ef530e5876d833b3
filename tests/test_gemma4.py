"""gemma4 (the text model) against llama.cpp: logits, greedy tokens, batching, memory, diff, refusals.

The tiny-gemma4 preset (tests/synthetic/models.py) has what llama.cpp's gemma4 graph does beyond Gemma 3: sliding
layers 0-2 and 4 with heads of 64 and 2 KV heads (window 8), global layers 3 and 5 with heads of 128, one
KV head, no attn_v (the key projection is the value) and proportional RoPE (a quarter of the head turns);
layers 4 and 5 share the keys and values of layers 2 and 3 (and have FFNs twice as wide); per-layer
embeddings of 32; a learned scale per layer output; final logits capped at 10. `mixture` adds 26B-A4B's
experts (4 GELU experts, 2 used) beside every layer's FFN, gate and up apart or fused. Prompts of ~11 tokens
and 12 decoded ones go past the window. Logprobs are compared within TOLERANCE; measured at the time of
writing: bit-identical to llama.cpp's with F16, Q8_0 and Q4_0 weights (one and two sequences, flash on and
off, mixtures split and fused), within 1e-6 with F32 weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from llama_reference import PROMPTS, Reference, compare_schedule, log_softmax
from memory_checks import fitted_then_allocated
from synthetic.models import PRESETS, write_synthetic
from test_batch_invariance import logprob_gap, run_prompts
from test_olmo3 import greedy

from ollama_engine import diff
from ollama_engine.kvcache import Batch, Wrapper, cache_dtype
from ollama_engine.models import ModelError, load_model
from ollama_engine.models.gemma4 import Gemma4
from ollama_engine.runner.allocate import LoadParams

TOLERANCE = 1e-4
THREADS = 2


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gemma4")

    def write(weight_type: str = "F16", name: str = "", **options) -> Path:
        path = folder / f"{name or 'tiny'}-{weight_type}.gguf"
        return path if path.exists() else write_synthetic(path, "tiny-gemma4", weight_type=weight_type, **options)

    return write


def test_reads_llama_cpps_layout(synthetic):
    """Per-layer kinds, head sizes, KV heads, rotary dims and bases; donors of the shared layers; one cache
    per kind."""
    model = load_model(synthetic(), allocate=False)
    try:
        assert isinstance(model, Gemma4) and isinstance(model.cache, Wrapper)
        o = model.options
        assert o.swa == (True, True, True, False, True, False)
        assert o.head_dim == [64, 64, 64, 128, 64, 128] and o.kv_heads == [2, 2, 2, 1, 2, 1]
        assert o.rope_dims == [64, 64, 64, 128, 64, 128]
        assert o.rope_base == [10000.0, 10000.0, 10000.0, 1000000.0, 10000.0, 1000000.0]
        assert o.donors == {4: 2, 5: 3} and o.per_layer_dim == 32 and o.final_softcap == 10.0
        assert model.layers[3].attn_v is None and model.layers[4].attn_k is None
    finally:
        model.close()


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_prompt_logits_match(synthetic, weight_type):
    """Every row of a prompt: logprobs within tolerance of llama.cpp's, the same argmax in each row."""
    path = synthetic(weight_type)
    model = load_model(path, num_threads=THREADS)
    reference = Reference(path, n_ctx=512, n_batch=64, threads=THREADS)
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
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash", "cache_type"), [
    ("F16", 1, False, "f16"), ("F16", 2, False, "f16"), ("Q8_0", 1, False, "f16"), ("Q8_0", 2, False, "f16"),
    ("Q4_0", 2, False, "f16"), ("F16", 2, True, "f16"), ("Q8_0", 2, True, "q8_0"),
])
def test_greedy_decoding_matches(synthetic, weight_type, sequences, flash, cache_type):
    """Prompts (two of different lengths in one batch where sequences is 2, split as llama.cpp splits
    them), then 12 decode steps past the window: logprobs within tolerance, the same greedy tokens."""
    compare_schedule(synthetic(weight_type), flash=flash, cache_type=cache_type, sequences=sequences, steps=12,
                     tolerance=TOLERANCE, threads=THREADS)


def mixture(synthetic, weight_type: str, fused: bool = False) -> Path:
    """tiny-gemma4 with 4 GELU experts (2 used, 64 wide) beside every layer's FFN, as Gemma 4 26B-A4B."""
    g = dataclasses.replace(PRESETS["tiny-gemma4"].gemma4, fused_gate_up=fused)
    return synthetic(weight_type, name=f"moe-fused{fused}", n_expert=4, n_expert_used=2, n_ff_exp=64, gemma4=g)


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "fused"), [
    ("F16", 1, False), ("F16", 2, True), ("Q8_0", 2, False), ("Q4_0", 2, True),
])
def test_mixture_matches_llama_cpp(synthetic, weight_type, sequences, fused):
    """The 26B-A4B's layers: experts routed on their own norm, scaled per expert, beside the dense FFN;
    gate and up apart or in one stack."""
    compare_schedule(mixture(synthetic, weight_type, fused), flash=False, cache_type="f16", sequences=sequences,
                     steps=12, tolerance=TOLERANCE, threads=THREADS)


def shift_prompt(path: Path) -> list[int]:
    from test_gemma import encode

    return encode(path, "In a small village by the sea, there lived a fisherman who had three sons")


@pytest.mark.reference
def test_context_shift_matches_llama_cpp(synthetic):
    """Dropping positions 3..8 re-rotates each stored layer's keys with its own RoPE (the global layers'
    proportional factors and base, the sliding ones'); the shared layers read the shifted keys. The window
    (64 here) covers the whole sequence: see the next test for a window that slides past shifted keys."""
    from test_gemma import shift_then_decode

    path = synthetic(name="wide-window", sliding_window=64)
    shift_then_decode(path, shift_prompt(path), keep=3, discard=5, steps=10, tolerance=TOLERANCE)


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True])
def test_context_shift_past_the_window_matches_llama_cpp(synthetic, flash):
    """The same greedy tokens and logprobs as llama.cpp once the 8-position window slides past shifted keys.
    After a shift the sliding layers' ring takes its next cells from cell 0 on, as llama.cpp's seq_add leaves
    its head; when it went on from the first freed cell instead, the same keys sat in other cells, the
    attention summed them in another order, and one decode step differed by 2e-3 (AVX-512; below 1e-4 on AVX2)."""
    from test_gemma import shift_then_decode

    path = synthetic()
    shift_then_decode(path, shift_prompt(path), keep=3, discard=5, steps=10, tolerance=TOLERANCE, flash=flash)


@pytest.mark.reference
def test_context_shift_to_the_windows_edge_matches_llama_cpp(synthetic):
    """14 tokens, positions 3-8 dropped: the first token after the shift is at 8, exactly the window (n_swa)
    past position 0 in the ring's cell 0, which llama.cpp reuses at once. Kept one token longer (the ring's
    earlier rule), the keys sat in other cells and the logprobs differed by up to 6.6e-3 on AVX-512."""
    from test_gemma import encode, shift_then_decode

    path = synthetic()
    tokens = encode(path, "In a small village by the sea, there lived a fisherman")
    assert len(tokens) == 14
    shift_then_decode(path, tokens, keep=3, discard=6, steps=10, tolerance=TOLERANCE)


@pytest.mark.parametrize(("flash", "experts"), [(False, False), (True, False), (False, True)])
def test_batched_equals_solo(synthetic, flash, experts):
    """A sequence's logits do not depend on another sequence sharing its batches (shared layers included)."""
    path = mixture(synthetic, "Q8_0", fused=True) if experts else synthetic("Q8_0")
    together = greedy(path, [0, 1], flash=flash)
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(greedy(path, [s], flash=flash)[s], together[s], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


@pytest.mark.parametrize("experts", [False, True])
def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic, experts):
    """Through the runner (prompts longer than a batch, shared prefixes, two slots): the same greedy tokens
    and logprobs, exactly, alone or two at a time."""
    path = mixture(synthetic, "Q8_0", fused=True) if experts else synthetic("Q8_0")
    solo = run_prompts(path, 2, False, concurrent=False)
    batched = run_prompts(path, 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0


@pytest.mark.parametrize("experts", [False, True])
def test_fit_equals_alloc(synthetic, experts):
    """fit reports what alloc allocates (the shared layers hold no cache), and inference adds nothing."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(mixture(synthetic, "F16") if experts else synthetic()), params) as loaded:
        cache = loaded.memory.cpu.cache
        assert all(cache[i] > 0 for i in range(4)) and cache[4] == cache[5] == 0
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step], sequences=[0], outputs=[0], tokens=[7]))


@pytest.mark.reference
def test_kv_memory_equals_llama_cpps_report(synthetic):
    """At 32k: the sliding layers' rings of 8 + 512 cells (padded to 768), the global ones of 32 768, and no
    cache for the shared layers: the bytes llama.cpp reports."""
    from test_kv_memory import NUM_CTX, assert_same_as_llama_cpp

    mib = assert_same_as_llama_cpp(synthetic(name="long", context_length=131072), [768, NUM_CTX])
    per_cell_swa, per_cell_global = 2 * 2 * 64 * 2, 2 * 1 * 128 * 2  # keys and values of f16
    expected = (3 * 768 * per_cell_swa + NUM_CTX * per_cell_global) / (1 << 20)
    assert mib == pytest.approx(expected, abs=0.01)  # llama.cpp prints MiB with 2 decimals


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff: every tensor named alike within diff's tolerance, shared layers and per-layer
    embeddings included, and the same greedy continuation."""
    result = diff.run_diff(synthetic("F32"), PROMPTS[0], threads=THREADS, generate=4)
    assert result.first_over is None and not result.departs
    assert {"inp_scaled", "inp_per_layer", "per_layer_proj", "Qcur_pos-0", "Kcur_pos-3", "Vcur_normed-3",
            "Qcur_pos-4", "kqv_out-5", "attn_out-5", "l_out-5", "result_output"} <= {t.name for t in result.tensors}


def test_shared_layers_read_the_last_storing_layer_of_their_kind(synthetic):
    """Where llama.cpp's n - 2 / n - 1 would give a shared layer keys of the other kind (another head size),
    it reads the last storing layer of its own kind, as Ollama's gemma4, and runs; a kind with no storing
    layer is a clear error at load."""
    g = PRESETS["tiny-gemma4"].gemma4
    path = synthetic(name="crossed", gemma4=dataclasses.replace(g, swa=(True, True, False, True, True, False)))
    model = load_model(path, allocate=False)
    try:
        assert model.options.donors == {4: 3, 5: 2}
    finally:
        model.close()
    assert all(np.isfinite(row).all() for row in greedy(path, [0], steps=3)[0])
    lonely = dataclasses.replace(g, swa=(True, True, True, True, False, True))
    with pytest.raises(ModelError, match=r"shared layer 4 \(global\) has no earlier layer of its kind"):
        load_model(synthetic(name="lonely", gemma4=lonely), allocate=False)
