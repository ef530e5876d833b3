"""laguna (poolside's Laguna) against llama.cpp: gated attention, sliding windows, per-layer heads and RoPE, experts.

Two tiny synthetic variants (tests/synthetic/models.py's tiny-laguna and an override):
- xs2: Laguna-XS.2's shape: layer 0 full attention (YaRN, half of each head turned), layers 1-3 sliding (window
  8, more query heads, whole heads turned by plain RoPE with their own theta), a softplus gate per head;
- m1: Laguna-M.1's: no sliding window (every layer full), a softplus gate per element.
Both have one dense layer, then sigmoid-routed experts with a selection bias and a shared expert. llama.cpp
cannot tell Ollama's conversion of xs2 (attn_g, rope.swa.* keys, the pattern as flags) from its own and would
miss its keys, so that one is checked against the llama.cpp-named file of the same weights, bitwise.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import decoding
import numpy as np
import pytest
from llama_reference import Reference, compare_schedule, log_softmax
from memory_checks import fitted_then_allocated
from synthetic.models import PRESETS, write_synthetic
from test_batch_invariance import logprob_gap, run_prompts

from ollama_engine import diff
from ollama_engine.kvcache import Batch, Causal, Wrapper, cache_dtype
from ollama_engine.ml import TensorCapture
from ollama_engine.models import ModelError, load_model
from ollama_engine.models.laguna import Laguna
from ollama_engine.models.moe import Gating
from ollama_engine.runner.allocate import LoadParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fuzz_gguf  # noqa: E402

TOLERANCE = 1e-4  # largest logprob difference against llama.cpp; measured: 0.0 (bit-identical logits)
PROMPTS = ("In a small village by the sea, there lived", "Once upon a time there was a king who ruled")
VARIANTS = {
    "xs2": {},
    "m1": {"sliding_window": None, "rope_base_swa": None,
           "laguna": dataclasses.replace(PRESETS["tiny-laguna"].laguna, gate_per_element=True)},
    "xs2-unscaled": {"rope_scaling_type": None, "rope_scaling_factor": None, "original_context": None},
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("laguna")

    def write(variant: str = "xs2", weight_type: str = "F16", layout: str = "llama.cpp") -> Path:
        path = folder / f"{variant}-{weight_type}-{layout}.gguf"
        return path if path.exists() else write_synthetic(path, "tiny-laguna", weight_type=weight_type,
                                                          layout=layout, **VARIANTS[variant])

    return write


def greedy(path: Path, seqs: list[int], steps: int = 12, flash: bool = False) -> dict[int, list[np.ndarray]]:
    """Each sequence's logits over its prompt's last token and `steps - 1` greedy decode steps, the sequences
    prefilled in one batch and decoded together; prompts and steps outgrow the window of 8."""
    return decoding.greedy(path, PROMPTS, seqs, steps, flash)


def test_reads_the_layer_pattern_heads_and_rope(synthetic):
    """XS.2's file: layer 0 full and 1-3 sliding (llama.cpp's default pattern, dense first), 4 and 6 query heads,
    two caches; M.1's: every layer full in one cache."""
    model = load_model(synthetic(), allocate=False)
    try:
        o = model.options
        assert isinstance(model, Laguna) and isinstance(model.cache, Wrapper)
        assert o.swa == (False, True, True, True) and o.heads == (4, 6, 6, 6) and o.window == 8
        assert (o.rope_dims, o.rope_dims_swa, o.rope_base, o.rope_base_swa) == (16, 24, 500000.0, 50000.0)
        assert o.dense == (True, False, False, False) and not model.ollama
        assert model.full_rope.extrapolation_factor == 1.0 and model.swa_rope.extrapolation_factor == 0.0
        assert (model.routing.gating, model.routing.normalize, model.routing.scale) == (Gating.SIGMOID, True, 2.5)
    finally:
        model.close()
    model = load_model(synthetic("m1"), allocate=False)
    try:
        assert model.options.swa == (False,) * 4 and type(model.cache) is Causal
        assert model.layers[1].attn_gate.shape == (64, 4 * 32)
    finally:
        model.close()


def test_ollama_conversion_reads_as_llama_cpps(synthetic):
    """Ollama's keys (rope.swa.*, per-layer flags and layer types, dense_layers, YaRN's parameters written out)
    give the options llama.cpp's keys give for the same model; its gate is attn_g."""
    ours, theirs = load_model(synthetic(layout="ollama"), allocate=False), load_model(synthetic(), allocate=False)
    try:
        assert ours.ollama and ours.backend.get("blk.1.attn_gate.weight") is None
        assert ours.options == theirs.options
        assert ours.full_rope == theirs.full_rope and ours.routing == theirs.routing
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_ollama_conversion_equals_llama_cpps(synthetic, weight_type):
    """Ollama's file computes what the llama.cpp-named file of the same weights computes: two sequences
    prefilled together and decoded past the window, bit-identical logits."""
    ours = greedy(synthetic("xs2", weight_type, "ollama"), [0, 1])
    theirs = greedy(synthetic("xs2", weight_type), [0, 1])
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(ours[s], theirs[s], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


OLLAMA_DEFAULTS = {  # Ollama's file with keys removed -> Ollama's model's defaults
    "attention.sliding_window_pattern": ("sliding", (False, True, True, True)),  # then from layer_types
    "rope.scaling.beta_fast": ("beta_fast", 64.0),
    "rope.scaling.original_context_length": ("original_context", 4096),
    "rope.swa.freq_base": ("rope_base_swa", 10000.0),
    "rope.swa.dimension_count": ("rope_dims_swa", 32),  # the head size
}


@pytest.mark.parametrize("key", OLLAMA_DEFAULTS)
def test_ollama_conversion_without_a_key_takes_ollamas_default(synthetic, tmp_path, key):
    """Where Ollama's file lacks a key, its model's default applies (not llama.cpp's)."""
    field, expected = OLLAMA_DEFAULTS[key]
    model = fuzz_gguf.Model.read(synthetic(layout="ollama"))
    del model.metadata[f"laguna.{key}"]
    path = tmp_path / "defaults.gguf"
    path.write_bytes(model.to_bytes())
    loaded = load_model(path, allocate=False)
    try:
        values = {"sliding": loaded.options.swa, "beta_fast": loaded.full_rope.beta_fast,
                  "original_context": loaded.full_rope.original_context,
                  "rope_base_swa": loaded.options.rope_base_swa, "rope_dims_swa": loaded.options.rope_dims_swa}
        assert values[field] == expected
    finally:
        loaded.close()


def load_and_prompt_logits(path: Path) -> float:
    """The largest difference of any prompt row's logits from llama.cpp's (one batch, both engines)."""
    model = load_model(path, num_threads=1)
    reference = Reference(path, n_ctx=512, n_batch=64, threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
        tokens = model.tokenizer.encode(" ".join(PROMPTS), add_special=True)
        n = len(tokens)
        ours = model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=range(n), tokens=tokens))
        theirs = reference.decode(tokens, range(n), [0] * n, range(n))
    finally:
        reference.close()
        model.close()
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max())


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["xs2", "m1"])
def test_prompt_logits_match(synthetic, variant):
    """Every row of a prompt longer than the window (F16), against llama.cpp's."""
    assert load_and_prompt_logits(synthetic(variant, "F16")) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("variant", "weight_type", "sequences", "flash", "steps"), [
    ("xs2", "F16", 1, False, 6),
    ("xs2", "F16", 2, True, 6),
    ("xs2", "Q8_0", 2, False, 24),  # decoding past the window of every sliding layer
    ("xs2", "Q4_0", 2, False, 6),  # repacked on the CPU where it can be, as llama.cpp repacks it
    ("m1", "F16", 2, False, 6),
    ("m1", "Q8_0", 1, True, 6),
])
def test_matches_llama_cpp(synthetic, variant, weight_type, sequences, flash, steps):
    """Prompts prefilled in one batch, then decoding a token for each: every logprob within the tolerance and
    the same greedy tokens as llama.cpp at every step."""
    worst = compare_schedule(synthetic(variant, weight_type), flash=flash, cache_type="f16", sequences=sequences,
                             steps=steps, tolerance=TOLERANCE, threads=1, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["xs2-unscaled", "xs2", "m1"])
def test_a_context_shift_matches_llama_cpps(synthetic, variant):
    """Positions 2-3 removed and the later keys moved down by RoPE (each layer's own: the full layers' partial
    rotation and theta, the sliding layers' whole-head one), as llama.cpp's seq_rm + seq_add do: the next
    tokens' logprobs within the tolerance of llama.cpp's (measured: 0.0) and the same greedy tokens.

    With YaRN (xs2, m1) the kept keys are turned by 0 as llama.cpp's shift graph turns them, which scales them
    by YaRN's magnitude (kvcache/causal.py _shift_keys); before that they differed by 0.29 in these logprobs."""
    path = synthetic(variant, "F16")
    model = load_model(path, num_threads=1)
    reference = Reference(path, n_ctx=512, n_batch=64, threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
        tokens = model.tokenizer.encode(" ".join(PROMPTS), add_special=True)
        n = len(tokens)
        model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=[n - 1], tokens=tokens))
        reference.decode(tokens, range(n), [0] * n, [n - 1])
        model.cache.remove(0, 2, 4)  # positions 4.. move down to 2..
        memory = reference.lib.llama_get_memory(reference.ctx)
        assert reference.lib.llama_memory_seq_rm(memory, 0, 2, 4)
        reference.lib.llama_memory_seq_add(memory, 0, 4, -1, -2)
        token = tokens[-1]
        for position in range(n - 2, n + 1):
            ours = model.graphs.compute(Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token]))
            theirs = reference.decode([token], [position], [0], [0])
            assert np.abs(log_softmax(ours) - log_softmax(theirs)).max() < TOLERANCE, position
            assert ours.argmax() == theirs.argmax(), position
            token = int(ours.argmax())
    finally:
        reference.close()
        model.close()


def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic):
    """Through the runner's batch loop (prompts longer than a batch, shared prefixes, two slots): the
    completions one after the other, then two at a time; the same greedy tokens and logprobs, exactly."""
    solo = run_prompts(synthetic("xs2", "Q8_0"), 2, False, concurrent=False)
    batched = run_prompts(synthetic("xs2", "Q8_0"), 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0


def routed(path: Path, batches: list[Batch]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The last batch's logits and router logits (every mixture layer's ffn_moe_logits), after the others."""
    model = load_model(path, num_threads=2)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        for batch in batches[:-1]:
            model.graphs.compute(batch)
        taken: dict[str, np.ndarray] = {}
        with model.backend.eval_callback(TensorCapture(lambda name: name.startswith("ffn_moe_logits"),
                                                       lambda name, values: taken.__setitem__(name, values.copy()))):
            logits = model.graphs.compute(batches[-1])
        return logits, taken
    finally:
        model.close()


def test_a_decode_step_batched_with_a_prompt_routes_as_alone(synthetic):
    """The F32 router (quantized files keep ffn_gate_inp F32) of one decode row next to another sequence's
    prompt rows: ggml would take llamafile's sgemm for the batch and the per-row dot product for the step
    alone, a last-bit difference that moves expert weights (it swapped top logprobs on an AVX2 CPU). Each
    sequence's rows get their own kernel (models/alone.py): router logits and logits bitwise the solo ones."""
    path = synthetic("xs2", "Q8_0")
    first = Batch(positions=range(10), sequences=[0] * 10, outputs=[9], tokens=np.arange(10) + 100)
    prompt = np.arange(9) + 300
    mixed, mixed_router = routed(path, [first, Batch(positions=[10, *range(9)], sequences=[0] + [1] * 9,
                                                     outputs=[0, 9], tokens=[7, *prompt])])
    step, step_router = routed(path, [first, Batch(positions=[10], sequences=[0], outputs=[0], tokens=[7])])
    alone, alone_router = routed(path, [Batch(positions=range(9), sequences=[1] * 9, outputs=[8], tokens=prompt)])
    assert set(mixed_router) == set(step_router) == {"ffn_moe_logits-1", "ffn_moe_logits-2", "ffn_moe_logits-3"}
    for name, values in mixed_router.items():  # one row per expert (the last layer keeps the output rows only)
        rows = values.reshape(-1, 8)
        np.testing.assert_array_equal(rows[:1], step_router[name].reshape(-1, 8), err_msg=name)
        np.testing.assert_array_equal(rows[1:], alone_router[name].reshape(-1, 8), err_msg=name)
    np.testing.assert_array_equal(mixed, np.concatenate([step, alone]))


@pytest.mark.parametrize("flash", [False, True])
def test_batched_equals_solo(synthetic, flash):
    """A sequence's logits do not depend on another sequence sharing its batches, past the window."""
    path = synthetic("xs2", "Q8_0")
    together = greedy(path, [0, 1], flash=flash)
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(greedy(path, [s], flash=flash)[s], together[s], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


@pytest.mark.parametrize("variant", ["xs2", "m1"])
def test_fit_equals_alloc(synthetic, variant):
    """fit reports what alloc allocates (both caches of the Wrapper per layer), and inference adds nothing."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(synthetic(variant)), params) as loaded:
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step] * 2, sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["xs2", "m1"])
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic, variant):
    """ollama-engine diff: every tensor named alike (the gates, the normed and roped q/k of both layer kinds,
    the routing, the shared expert) is bitwise llama.cpp's."""
    result = diff.run_diff(synthetic(variant, "F32"), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert {"attn_gate_proj-1", "attn_gate_softplus-1", "attn_gated-0", "attn_gated-1", "Qcur_normed-1",
            "Kcur_rope-0", "Kcur_rope-1", "attn_out-2", "attn_o_proj-2", "ffn_moe_probs_biased-1", "ffn_shexp-2",
            "ffn_out-0", "l_out-3", "result_output"} <= {t.name for t in result.tensors}


BAD = {
    "gate of 3 per layer": ("blk.1.attn_gate.weight", [64, 3], "blk.1.attn_gate.weight has shape [64, 3]"),
    "selection bias missing": ("blk.2.exp_probs_b.bias", None, "missing required tensor blk.2.exp_probs_b.bias"),
    "shared expert missing": ("blk.3.ffn_up_shexp.weight", None, "missing required tensor blk.3.ffn_up_shexp"),
    "heads for 3 layers": ("laguna.attention.head_count", [4, 6, 6], "has 3 values for 4 layers"),
    "odd sliding rope": ("laguna.rope.dimension_count_swa", 15, "rope.dimension_count_swa 15 must be even"),
    "window of 1": ("laguna.attention.sliding_window", 1, "attention.sliding_window must be in 2.."),
    "gating 4": ("laguna.expert_gating_func", 4, "expert_gating_func 4"),
}
OLLAMA_BAD = {  # Ollama's file -> what Ollama's model refuses
    "sinks": ("laguna.attention.sink_enabled", (7, None, True), "SWA attention sinks are not supported"),
    "gating type 0": ("laguna.attention.gating_type", (4, None, 0), "unsupported attention gating type 0"),
    "no q/k norms": ("laguna.attention.qk_norm", (7, None, False), "Q/K RMSNorm is required"),
    "softmax experts": ("laguna.expert_gating_func", (4, None, 1), "unsupported expert gating function 1"),
}


@pytest.mark.parametrize("case", OLLAMA_BAD)
def test_ollama_conversion_refuses_what_ollama_refuses(synthetic, tmp_path, case):
    name, value, message = OLLAMA_BAD[case]
    model = fuzz_gguf.Model.read(synthetic(layout="ollama"))
    model.metadata[name] = value
    path = tmp_path / "bad.gguf"
    path.write_bytes(model.to_bytes())
    with pytest.raises(ModelError, match=re.escape(message)):
        load_model(path).close()


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_refused_with_a_model_error(synthetic, tmp_path, case):
    """Inconsistent hyper-parameters or tensor shapes raise ModelError at load, before any ggml op could abort."""
    name, value, message = BAD[case]
    model = fuzz_gguf.Model.read(synthetic())
    if name.startswith("blk."):
        if value is None:
            model.tensors = [t for t in model.tensors if t.name != name]
        else:
            next(t for t in model.tensors if t.name == name).shape = value
    elif isinstance(value, list):
        model.metadata[name] = (9, 4, value)  # ARRAY of UINT32
    else:
        model.metadata[name] = (4, None, value)  # UINT32
    path = tmp_path / "bad.gguf"
    path.write_bytes(model.to_bytes())
    with pytest.raises(ModelError, match=re.escape(message)):
        load_model(path).close()
