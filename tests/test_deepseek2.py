"""deepseek2 (DeepSeek-V2/V3, multi-head latent attention) against llama.cpp, its cache, memory and bad files.

Three tiny synthetic variants (tests/synthetic/models.py's tiny-deepseek2 and two overrides):
- v3: low-rank query, attn_k_b/attn_v_b (the latent cache), sigmoid routing with a selection bias in
  expert groups, normalised and scaled weights, YaRN with yarn_log_multiplier;
- lite: V2-Lite's direct query (attn_q), softmax routing, no YaRN;
- kv_b: an older conversion's single attn_kv_b (llama.cpp's non-MLA path: multi-head keys and values);
- temperature: Mistral Large 3's query temperature (reused decode graphs get it rewritten per position).
Each has one dense layer, then mixtures with a shared expert. The schedules use two prompts of one token
count (see compare_schedule): llama.cpp splits a batch of unequal sequences, and this model's F32 and F16
caches then round its last prompt token visibly differently from a one-graph prefill (measured: 1e-3 in
the logprobs against llama.cpp's own unsplit result).
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_reference import Reference, compare_schedule
from memory_checks import fitted_then_allocated
from synthetic.models import MLASpec, write_synthetic

from ollama_engine import diff
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.ml import Backend
from ollama_engine.models import ModelError, load_model
from ollama_engine.models.moe import Experts, Gating, Routing, moe
from ollama_engine.runner.allocate import LoadParams, open_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fuzz_gguf  # noqa: E402

TOLERANCE = 1e-4  # largest logprob difference; measured: 0.0 in every case (bit-identical logits)
PROMPTS = ("In a small village by the sea, there lived", "Once upon a time there was a king who ruled")  # 11 each
VARIANTS = {
    "v3": {},
    "lite": {"mla": MLASpec(), "rope_scaling_type": None, "rope_scaling_factor": None, "yarn_log_mul": None,
             "original_context": None},
    "kv_b": {"mla": MLASpec(q_lora_rank=32, kv_b=True), "n_head_kv": 4},
    # Mistral Large 3: the query temperature, here changing every 4 positions
    "temperature": {"mla": MLASpec(q_lora_rank=32, temperature_length=4), "attn_temperature_scale": 0.5},
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("deepseek2")
    written: dict[tuple[str, str], Path] = {}

    def write(variant: str, weight_type: str = "F32") -> Path:
        if (variant, weight_type) not in written:
            written[variant, weight_type] = write_synthetic(folder / f"{variant}-{weight_type}.gguf", "deepseek2",
                                                            weight_type=weight_type, **VARIANTS[variant])
        return written[variant, weight_type]

    return write


def test_group_routing_with_selection_bias_matches_numpy():
    """DeepSeek V3's routing: sigmoid probabilities, the bias added only to pick, only the groups whose two
    best experts score highest, weights from the unbiased probabilities, normalised and scaled."""
    rng = np.random.default_rng(11)
    d, f, n_expert, n = 16, 8, 8, 6
    x = rng.standard_normal((n, d), dtype=np.float32)
    router = rng.standard_normal((n_expert, d), dtype=np.float32)
    bias = rng.standard_normal(n_expert, dtype=np.float32) / 2
    gate, up = (rng.standard_normal((n_expert, f, d), dtype=np.float32) / 4 for _ in range(2))
    down = rng.standard_normal((n_expert, d, f), dtype=np.float32) / 3
    routing = Routing(n_expert, 2, Gating.SIGMOID, normalize=True, scale=2.5, groups=4, groups_used=2)
    with Backend(None) as backend, backend.new_context() as ctx:
        inputs = ctx.input()
        experts = Experts(router=inputs.from_numpy(router), router_bias=None, gate=inputs.from_numpy(gate),
                          gate_bias=None, up=inputs.from_numpy(up), up_bias=None, down=inputs.from_numpy(down),
                          down_bias=None, selection_bias=inputs.from_numpy(bias))
        out = moe(inputs.from_numpy(x), experts, routing, 0)
        ctx.compute(out)
        ours = out.numpy()
    expected = np.zeros_like(x)
    for t, row in enumerate(x):
        probs = 1 / (1 + np.exp(-(router @ row)))
        selection = (probs + bias).reshape(4, 2)
        best_groups = np.argsort(-selection.sum(axis=1), kind="stable")[:2]  # groups of 2: both experts count
        masked = np.full_like(selection, -np.inf)
        masked[best_groups] = selection[best_groups]
        chosen = np.argsort(-masked.reshape(-1), kind="stable")[:2]
        weights = probs[chosen] / probs[chosen].sum() * 2.5
        for e, w in zip(chosen, weights, strict=True):
            expected[t] += w * (down[e] @ ((gate[e] @ row) / (1 + np.exp(-(gate[e] @ row))) * (up[e] @ row)))
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize(("variant", "weight_type", "flash", "cache_type"), [
    ("v3", "F32", False, "f16"),
    ("v3", "F16", True, "f16"),
    ("v3", "Q8_0", False, "f16"),
    ("v3", "Q8_0", True, "q8_0"),  # the latent cache quantized (llama.cpp rotates no MLA cache)
    ("lite", "F16", False, "f16"),
    ("lite", "F32", True, "f16"),
    ("kv_b", "F16", False, "f16"),
    ("kv_b", "Q8_0", True, "f16"),
    ("temperature", "F16", False, "f16"),
])
def test_matches_llama_cpp(synthetic, variant, weight_type, flash, cache_type):
    """Two sequences prefilled in one batch, then six batches decoding a token for each: every logprob
    within the tolerance and the same greedy tokens as llama.cpp at every step."""
    worst = compare_schedule(synthetic(variant, weight_type), flash=flash, cache_type=cache_type, sequences=2,
                             steps=6, tolerance=TOLERANCE, threads=1, prompts=PROMPTS)
    assert worst < TOLERANCE


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff: every tensor named alike (MLA's kv_cmpr, k_pe, q_pe, the routing's masked groups
    with their -inf, the shared expert) is bitwise llama.cpp's."""
    result = diff.run_diff(synthetic("v3"), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    names = {t.name for t in result.tensors}
    assert {"kv_cmpr-1", "k_pe-1", "q_pe-1", "Qcur-1", "Kcur-1", "kqv_out-1", "ffn_moe_probs_masked-1",
            "ffn_moe_probs_biased-1", "ffn_shexp-1", "ffn_out-1", "l_out-2", "result_output"} <= names


@pytest.mark.parametrize("flash", [False, True])
def test_batched_equals_solo(synthetic, flash):
    """A sequence's logits do not depend on another sequence sharing its batches (prefill and decode)."""
    model = load_model(synthetic("v3", "Q8_0"), num_threads=1, flash_attention=flash)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        texts = [model.tokenizer.encode(p, add_special=True) for p in PROMPTS]

        def run(seqs: list[int], steps: int = 4) -> dict[int, list[np.ndarray]]:
            for s in seqs:
                model.cache.remove(s, 0)
            tokens = {s: list(texts[s]) for s in seqs}
            batch = Batch(positions=[p for s in seqs for p in range(len(texts[s]))],
                          sequences=[s for s in seqs for _ in texts[s]],
                          outputs=np.cumsum([len(texts[s]) for s in seqs]) - 1,
                          tokens=[t for s in seqs for t in texts[s]])
            logits: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
            for _ in range(steps):
                rows = model.graphs.compute(batch)
                for s, row in zip(seqs, rows, strict=True):
                    logits[s].append(row)
                    tokens[s].append(int(row.argmax()))
                batch = Batch(positions=[len(tokens[s]) - 1 for s in seqs], sequences=seqs,
                              outputs=range(len(seqs)), tokens=[tokens[s][-1] for s in seqs])
            return logits

        together = run([0, 1])
        for s in (0, 1):
            alone = run([s])[s]
            for step, (a, b) in enumerate(zip(alone, together[s], strict=True)):
                np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")
    finally:
        model.close()


def test_latent_cache_stores_one_key_per_token(synthetic):
    """The MLA cache holds, per token and layer, one key of kv_lora_rank + rope dims and no value."""
    model = load_model(synthetic("v3"), num_threads=1)
    try:
        model.cache.init(model.backend, cache_dtype("f16"), 1, 256, 16)
        model.backend.load()
        model.graphs.compute(Batch(positions=range(4), sequences=[0] * 4, outputs=[3], tokens=[1, 2, 3, 4]))
        o = model.options
        keys, values = model.cache._keys, model.cache._values
        assert len(keys) == o.block_count and all(v is None for v in values.values())
        assert all(k.shape == (o.kv_lora_rank + o.rope_dims, 1, model.cache.cells) for k in keys.values())
    finally:
        model.close()


@pytest.mark.reference
def test_quantized_with_repacked_weights_matches_llama_cpp(synthetic):
    """Q4_0, which the CPU repacks (where it can) for 2-D weights and stacked experts, as llama.cpp does; the
    per-head attn_k_b/attn_v_b (3-D, multiplied per head) stay in ggml's plain layout, as in llama.cpp, where
    a repacked one would make ggml abort at compute."""
    path = synthetic("v3", "Q4_0")
    model = load_model(path, allocate=False)
    try:
        repacked = model.backend.repacked_weights()
    finally:
        model.close()
    assert not any(name.endswith(("attn_k_b.weight", "attn_v_b.weight")) for name in repacked)
    worst = compare_schedule(path, flash=False, cache_type="f16", sequences=2, steps=4, tolerance=TOLERANCE,
                             threads=1, prompts=PROMPTS)
    assert worst < TOLERANCE


CELL_METADATA = 12  # llama.cpp's state also saves each cell's position, sequence count and sequence id


@pytest.mark.reference
@pytest.mark.parametrize("variant", ["v3", "kv_b"])
def test_kv_bytes_per_token_equal_llama_cpp(synthetic, variant):
    """Our cache's bytes per token equal llama.cpp's (its saved state grows by its K and V rows per token):
    (kv_lora_rank + rope dims) * 2 bytes per layer with MLA, keys and values of every head without."""
    path = synthetic(variant)
    params = LoadParams(parallel=1, batch_size=32, kv_size=256, num_threads=1)
    loaded = open_model(str(path), params, allocate=True)
    try:
        ours = sum(loaded.memory.cpu.cache) // loaded.model.cache.cells
        o = loaded.model.options
    finally:
        loaded.close()
    reference = Reference(path, n_ctx=256, n_batch=32, threads=1)
    try:
        sizes = []
        for n in (8, 24):
            reference.lib.llama_memory_seq_rm(reference.lib.llama_get_memory(reference.ctx), 0, -1, -1)
            reference.decode(list(range(100, 100 + n)), list(range(n)), [0] * n, [n - 1])
            sizes.append(reference.lib.llama_state_seq_get_size(reference.ctx, ctypes.c_int32(0)))
        theirs = (sizes[1] - sizes[0]) // 16 - CELL_METADATA
    finally:
        reference.close()
    expected = (o.kv_lora_rank + o.rope_dims) * 2 if o.mla else o.heads * (o.k_head + o.v_head) * 2
    assert ours == theirs == expected * o.block_count


def test_fit_equals_alloc_and_inference_allocates_nothing_more(synthetic):
    """fit measured exactly what alloc allocated, and the worst-case graphs cover a full prompt batch and
    a decode step of every sequence."""
    path = str(synthetic("v3"))
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(path, params) as loaded:
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        graphs.compute(Batch(positions=range(32), sequences=[1] * 32, outputs=[31], tokens=np.arange(32) + 200))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step] * 2, sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


def test_shift_moves_only_the_rotary_part(synthetic):
    """Removing positions re-ropes the later keys' last rope dims and leaves their latent part as it was:
    layer 0's keys (which depend on their token alone) equal a fresh prefill's at the new positions."""
    model = load_model(synthetic("v3"), num_threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f32"), 1, 256, 32)
        o, tokens = model.options, model.tokenizer.encode(PROMPTS[0], add_special=True)
        n = len(tokens)
        model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=[n - 1], tokens=tokens))
        before = [k.numpy()[4:n, 0] for k in model.cache._keys.values()]  # numpy order: (cells, heads, dims)
        model.cache.remove(0, 2, 4)  # positions 4.. move down to 2..
        after = [k.numpy()[4:n, 0] for k in model.cache._keys.values()]
        model.cache.remove(0, 0)
        kept = tokens[:2] + tokens[4:]
        model.graphs.compute(Batch(positions=range(n - 2), sequences=[0] * (n - 2), outputs=[n - 3], tokens=kept))
        fresh = model.cache._keys[0].numpy()[2 : n - 2, 0]
    finally:
        model.close()
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(new[:, : o.kv_lora_rank], old[:, : o.kv_lora_rank])
        assert np.abs(new[:, o.kv_lora_rank :] - old[:, o.kv_lora_rank :]).max() > 0.1
    np.testing.assert_allclose(after[0], fresh, atol=1e-5)


BAD = {
    "kv_lora_rank missing": ("deepseek2.attention.kv_lora_rank", None, "kv_lora_rank"),
    "kv_lora_rank off by 32": ("deepseek2.attention.kv_lora_rank", 32, "MLA needs attention.key_length"),
    "key_length_mla alone": ("deepseek2.attention.value_length_mla", None, "must be set together"),
    "no features without RoPE": ("deepseek2.attention.key_length_mla", 32, "must exceed rope.dimension_count"),
    "q_b of the wrong width": ("blk.1.attn_q_b.weight", [32, 192], "blk.1.attn_q_b.weight has shape [32, 192]"),
    "k_b for 2 heads": ("blk.2.attn_k_b.weight", [32, 64, 2], "expected [32, 64, 4]"),
    "shared expert missing": ("blk.2.ffn_up_shexp.weight", None, "missing required tensor blk.2.ffn_up_shexp"),
    "expert gates missing": ("blk.2.ffn_gate_exps.weight", None, "missing required tensor blk.2.ffn_gate_exps"),
    "selection bias of 4": ("blk.1.exp_probs_b.bias", [4], "expected [8]"),
    "gating 4": ("deepseek2.expert_gating_func", 4, "expert_gating_func 4"),
    "temperature without a length": ("deepseek2.attention.temperature_scale", 1.0, "temperature_length"),
    "groups of 3": ("deepseek2.expert_group_count", 3, "expert_group_count 3"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_refused_with_a_model_error(synthetic, tmp_path, case):
    """Inconsistent hyper-parameters or tensor shapes raise ModelError at load, before any ggml op could abort."""
    name, value, message = BAD[case]
    model = fuzz_gguf.Model.read(synthetic("v3"))
    if name.startswith("blk."):
        if value is None:
            model.tensors = [t for t in model.tensors if t.name != name]
        else:
            next(t for t in model.tensors if t.name == name).shape = value
    elif value is None:
        del model.metadata[name]
    else:
        model.metadata[name] = (6 if isinstance(value, float) else 4, None, value)  # FLOAT32 or UINT32
    path = tmp_path / "bad.gguf"
    path.write_bytes(model.to_bytes())
    with pytest.raises(ModelError, match=re.escape(message)):
        load_model(path).close()


def test_multi_token_prediction_blocks_take_no_memory(synthetic, tmp_path):
    """A file with nextn_predict_layers blocks after the trunk (DeepSeek V3, GLM) runs as the trunk alone: the
    extra block is neither allocated nor counted, as llama.cpp skips it, and the logits are the trunk's."""
    plain = synthetic("v3")
    model = fuzz_gguf.Model.read(plain)
    blocks = model.metadata["deepseek2.block_count"][2]
    last = [t for t in model.tensors if t.name.startswith(f"blk.{blocks - 1}.")]
    model.tensors += [dataclasses.replace(t, name=t.name.replace(f"blk.{blocks - 1}.", f"blk.{blocks}."), offset=None)
                      for t in last]
    model.tensors = [dataclasses.replace(t, offset=None) for t in model.tensors]
    model.metadata["deepseek2.block_count"] = (4, None, blocks + 1)  # UINT32
    model.metadata["deepseek2.nextn_predict_layers"] = (4, None, 1)
    with_mtp = tmp_path / "mtp.gguf"
    with_mtp.write_bytes(model.to_bytes())

    batch = Batch(positions=range(4), sequences=[0] * 4, outputs=[3], tokens=[1, 2, 3, 4])
    results = []
    for path in (plain, with_mtp):
        loaded = load_model(path, num_threads=1)
        try:
            loaded.cache.init(loaded.backend, cache_dtype("f16"), 1, 256, 16)
            loaded.backend.load()
            weights = loaded.backend.memory.cpu.weights
            results.append((sum(weights), loaded.graphs.compute(batch)))
            assert not any(name.startswith(f"blk.{blocks}.") for name in loaded.backend.weights)
        finally:
            loaded.close()
    (plain_bytes, plain_logits), (mtp_bytes, mtp_logits) = results
    assert mtp_bytes == plain_bytes
    np.testing.assert_array_equal(mtp_logits, plain_logits)
