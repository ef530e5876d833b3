"""Mixtures of experts: the routing against numpy, each MoE architecture against llama.cpp, and memory.

The architectures run on tiny synthetic models (tests/synthetic/models.py presets) through
llama_reference.compare_schedule: two sequences of different lengths prefilled in one batch, then
eight batches decoding one token for each; every logprob within the tolerance and the same greedy
tokens at every step.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from llama_reference import PROMPTS, compare_schedule
from memory_checks import fitted_then_allocated
from synthetic.models import write_synthetic

from ollama_engine.fs.gguf_file import Conversion
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.ml import Backend
from ollama_engine.models import load_model
from ollama_engine.models.moe import Experts, Gating, Routing, moe
from ollama_engine.runner.allocate import LoadParams, open_model

TOLERANCE = 1e-4  # largest logprob difference; measured: see each test


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("moe")
    written: dict[tuple, Path] = {}

    def write(arch: str, weight_type: str = "F32", **options) -> Path:
        key = (arch, weight_type, *sorted(options.items()))
        if key not in written:
            written[key] = write_synthetic(folder / f"{arch}-{weight_type}-{len(written)}.gguf", arch,
                                           weight_type=weight_type, **options)
        return written[key]

    return write


# ---------------------------------------------------------------- routing, against numpy


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def numpy_moe(x, router, gate, up, down, routing: Routing) -> np.ndarray:
    """The mixture written out token by token: x (n, d); router (E, d); gate/up (E, f, d); down (E, d, f)."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = router @ row
        probs = {Gating.SOFTMAX: softmax, Gating.SIGMOID: lambda v: 1 / (1 + np.exp(-v))}.get(
            routing.gating, lambda v: v)(logits)
        chosen = np.argsort(-(logits if routing.weight_before_ffn else probs), kind="stable")[: routing.n_used]
        weights = probs[chosen]
        if routing.gating == Gating.SOFTMAX_WEIGHT:
            weights = softmax(weights)
        if routing.normalize:
            weights = weights / weights.sum()
        if routing.scale not in (0.0, 1.0):
            weights = weights * routing.scale
        for e, w in zip(chosen, weights, strict=True):
            if routing.weight_before_ffn:  # Llama 4: the weight scales the expert's input
                out[t] += down[e] @ (silu(gate[e] @ (w * row)) * (up[e] @ (w * row)))
            else:
                out[t] += w * (down[e] @ (silu(gate[e] @ row) * (up[e] @ row)))
    return out


@pytest.mark.parametrize(("gating", "normalize", "scale", "n_used", "before"), [
    (Gating.SOFTMAX, True, 1.0, 3, False),  # qwen3moe, mixtral
    (Gating.SOFTMAX, False, 1.0, 1, False),  # one expert: the output is still contiguous
    (Gating.SIGMOID, True, 2.5, 2, False),  # deepseek-v3 style
    (Gating.SOFTMAX_WEIGHT, False, 1.0, 4, False),  # gpt-oss
    (Gating.SIGMOID, False, 1.0, 2, True),  # llama4 (one expert there; two here, to see the sum)
])
def test_routing_matches_numpy(gating, normalize, scale, n_used, before):
    rng = np.random.default_rng(7)
    d, f, n_expert, n = 16, 8, 6, 5
    x = rng.standard_normal((n, d), dtype=np.float32)
    router = rng.standard_normal((n_expert, d), dtype=np.float32)
    gate, up = (rng.standard_normal((n_expert, f, d), dtype=np.float32) / 4 for _ in range(2))
    down = rng.standard_normal((n_expert, d, f), dtype=np.float32) / 3
    routing = Routing(n_expert, n_used, gating, normalize, scale, weight_before_ffn=before)
    with Backend(None) as backend, backend.new_context() as ctx:
        inputs = ctx.input()
        experts = Experts(router=inputs.from_numpy(router), router_bias=None, gate=inputs.from_numpy(gate),
                          gate_bias=None, up=inputs.from_numpy(up), up_bias=None, down=inputs.from_numpy(down),
                          down_bias=None)
        out = moe(inputs.from_numpy(x), experts, routing, 0)
        assert out.name == "ffn_moe_out-0"
        ctx.compute(out)
        ours = out.numpy()
    np.testing.assert_allclose(ours, numpy_moe(x, router, gate, up, down, routing), rtol=1e-4, atol=1e-5)


def test_expert_biases_are_added_per_chosen_expert():
    """gpt-oss's biases: add_id adds the bias row of the expert each slot chose."""
    rng = np.random.default_rng(3)
    with Backend(None) as backend, backend.new_context() as ctx:
        inputs = ctx.input()
        x = rng.standard_normal((4, 2, 3), dtype=np.float32)  # numpy order: (n, n_used, d)
        biases = rng.standard_normal((5, 3), dtype=np.float32)  # (n_expert, d)
        ids = np.array([[4, 0], [1, 1], [3, 2], [0, 4]], dtype=np.int32)
        out = inputs.from_numpy(x).add_id(inputs.from_numpy(biases), inputs.from_numpy(ids))
        ctx.compute(out)
        np.testing.assert_allclose(out.numpy(), x + biases[ids], rtol=1e-6)


# ---------------------------------------------------------------- architectures against llama.cpp


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("flash", [False, True])
def test_qwen3moe_matches_llama_cpp(synthetic, weight_type, flash):
    worst = compare_schedule(synthetic("qwen3moe", weight_type), flash=flash, cache_type="f16", sequences=2,
                             tolerance=TOLERANCE, threads=1)
    assert worst < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2moe"])
@pytest.mark.parametrize(("weight_type", "sequences", "flash"),
                         [("F16", 1, False), ("F16", 2, True), ("Q8_0", 2, False)])
def test_mixtral_and_qwen2moe_match_llama_cpp(synthetic, preset, weight_type, sequences, flash):
    """Mixtral (a llama file with experts: softmax router, the two chosen experts' weights renormalised)
    and Qwen2-MoE (weights not renormalised, plus a sigmoid-gated shared expert); one sequence alone, and
    two batched. Measured: 0.0 (F16, Q8_0), 5e-7 (flash)."""
    worst = compare_schedule(synthetic(preset, weight_type), flash=flash, cache_type="f16",
                             sequences=sequences, tolerance=TOLERANCE, threads=1)
    assert worst < TOLERANCE


@pytest.mark.reference
def test_mistral3_with_experts_matches_llama_cpp(synthetic):
    """mistral3's llama.cpp graph routes experts as llama's does; ours shares Llama's mixture."""
    path = synthetic("mistral3", "F16", n_expert=4, n_expert_used=2, n_ff_exp=128)
    assert compare_schedule(path, flash=False, cache_type="f16", sequences=2, tolerance=TOLERANCE,
                            threads=1) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "expert_type"), [("F32", None), ("F32", "MXFP4"), ("Q8_0", "MXFP4")])
@pytest.mark.parametrize("flash", [False, True])
def test_gpt_oss_matches_llama_cpp(synthetic, weight_type, expert_type, flash):
    """Prompts of ~10 tokens and 8 decoded ones: past the 8-position window of the sliding layer, YaRN
    beyond its 16-position original context, sinks in every head; MXFP4 experts as the real files have."""
    worst = compare_schedule(synthetic("gpt-oss", weight_type, expert_type=expert_type), flash=flash,
                             cache_type="f16", sequences=2, tolerance=TOLERANCE, threads=1)
    assert worst < TOLERANCE


def greedy_logits(path: Path, steps: int = 6) -> np.ndarray:
    """Our logits for both prompts prefilled in one batch, then `steps` greedy decode steps of both."""
    model = load_model(path, num_threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        texts = [model.tokenizer.encode(prompt, add_special=True) for prompt in PROMPTS]
        batch = Batch(positions=[p for t in texts for p in range(len(t))],
                      sequences=[s for s, t in enumerate(texts) for _ in t],
                      outputs=np.cumsum([len(t) for t in texts]) - 1, tokens=[token for t in texts for token in t])
        logits = []
        for _ in range(steps + 1):
            logits.append(model.graphs.compute(batch))
            next_tokens = logits[-1].argmax(axis=1).tolist()
            batch = Batch(positions=[len(t) for t in texts], sequences=[0, 1], outputs=[0, 1], tokens=next_tokens)
            for text, token in zip(texts, next_tokens, strict=True):
                text.append(token)
        return np.stack(logits)
    finally:
        model.close()


@pytest.mark.parametrize("layout", ["ollama", "ollama-qkv", "ollama-2025-09", "ollama-2025-08"])
def test_ollama_gpt_oss_files_match_llama_cpp_named_ones(synthetic, layout):
    """Ollama's own gpt-oss conversions (architecture "gptoss": attn_out, attn_sinks, ffn_norm, no
    rope.scaling.type as Ollama always applies YaRN; q, k and v fused in attn_qkv when converted from
    OpenAI's original checkpoint; its files until October 2025 also fuse gate and up with their rows
    interleaved and store the experts' biases in BF16, and until 26 August 2025 MXFP4 under type id 4 in
    OpenAI's nibble order) hold the same model as llama.cpp's: the same weights under both names give
    identical logits. (llama.cpp cannot load Ollama's files; the llama.cpp-named one is checked against
    llama.cpp above.) Measured: bit-identical."""
    from ollama_engine.models.gptoss import OllamaGptOss

    ours = synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout=layout)
    model = load_model(ours, allocate=False)
    try:
        assert isinstance(model, OllamaGptOss) and model.config.architecture() == "gptoss"
    finally:
        model.close()
    reference = synthetic("gpt-oss", "Q8_0", expert_type="MXFP4")
    np.testing.assert_array_equal(greedy_logits(ours), greedy_logits(reference))


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "flash"), [("F32", False), ("Q8_0", True)])
def test_llama4_matches_llama_cpp(synthetic, weight_type, flash):
    """Four layers: dense and mixture alternating, three RoPE layers with q/k norms, one global without."""
    worst = compare_schedule(synthetic("llama4", weight_type), flash=flash, cache_type="f16", sequences=2,
                             tolerance=TOLERANCE, threads=1)
    assert worst < TOLERANCE


def test_llama4_temperature_follows_llama_cpp_formula():
    """The query scale of the layers without RoPE: 1 + 0.1 ln(floor((p + 1) / 8192) + 1)."""
    from ollama_engine.models.llama4 import Llama4

    positions = np.array([0, 8190, 8191, 8192, 20000, 100000, 1 << 20], dtype=np.int32)
    with Backend(None) as backend, backend.new_context() as ctx:
        scale = Llama4.temperature(ctx.input().from_numpy(positions))
        ctx.compute(scale)
        ours = scale.numpy().reshape(-1)
    expected = np.log(np.floor((positions + 1.0) / 8192) + 1.0) * 0.1 + 1.0
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert ours[1] == 1.0 and ours[2] > 1.0


def test_attention_sinks_match_numpy():
    """A sink is a logit per head in each row's softmax denominator, with no value: rows sum to below 1."""
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((3, 4, 6), dtype=np.float32)  # numpy order: (heads, rows, history)
    sinks = rng.standard_normal(3, dtype=np.float32)
    with Backend(None) as backend, backend.new_context() as ctx:
        inputs = ctx.input()
        out = inputs.from_numpy(scores).softmax(scale=0.5, sinks=inputs.from_numpy(sinks))
        ctx.compute(out)
        ours = out.numpy()
    logits = np.concatenate([scores * 0.5, np.broadcast_to(sinks[:, None, None], (3, 4, 1))], axis=-1)
    expected = softmax(logits)[..., :-1]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)
    assert (ours.sum(axis=-1) < 1).all()


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "llama4", "tiny-mixtral", "qwen2moe"])
def test_fit_equals_alloc_and_inference_allocates_nothing_more(synthetic, arch):
    """The worst-case graphs reserved at load cover the routing: a full prompt batch and a decode step of
    every sequence compute without growing any buffer, and fit measured exactly what alloc allocated.

    (Batches of other shapes, e.g. one sequence's decode beside another's prompt, can need a few hundred
    bytes more where ggml's allocator packs their nodes less tightly: llama4's preset does; that is the
    runner's reservation, not the routing.)"""
    path = str(synthetic(arch))
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(path, params) as loaded:
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        graphs.compute(Batch(positions=range(32), sequences=[1] * 32, outputs=[31], tokens=np.arange(32) + 200))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step] * 2, sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


def test_fit_equals_alloc_for_ollamas_august_2025_gpt_oss_files(synthetic):
    """Ollama's gpt-oss files of August to October 2025 are converted at load (BF16 biases become F32,
    twice their bytes in the file): the memory report counts what ggml holds, the llama.cpp-named file's."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    reference = open_model(str(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4")), params, allocate=False)
    try:
        weights = reference.memory.cpu.weights
    finally:
        reference.close()
    path = str(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout="ollama-2025-08"))
    with fitted_then_allocated(path, params) as loaded:
        assert loaded.memory.cpu.weights == weights
        loaded.model.graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31],
                                          tokens=np.arange(32) + 100))
        loaded.model.graphs.compute(Batch(positions=[32, 0], sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


FP4_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP microscaling: sign, 2 exponent bits, 1 mantissa bit


def test_openai_mxfp4_blocks_become_ggml_mxfp4():
    """Type id 4's blocks (a scale byte 2^(s - 127), then byte i holding elements 2i (low nibble) and 2i + 1)
    converted to ggml's MXFP4 dequantize to the values decoded by hand from OpenAI's order."""
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (40, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(110, 140, 40)
    expected = np.empty((40, 32))
    for b, block in enumerate(raw):
        for i, byte in enumerate(block[1:]):
            for k, nibble in enumerate((byte & 0x0F, byte >> 4)):
                value = FP4_E2M1[nibble & 7] * (-1.0 if nibble & 8 else 1.0)
                expected[b, 2 * i + k] = value * 2.0 ** (int(block[0]) - 127)
    converted = Conversion.OPENAI_MXFP4.convert(raw.reshape(-1))
    assert converted.dtype == np.uint8 and converted.size == raw.size
    ours = gguf.quants.dequantize(converted, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(ours.reshape(40, 32), expected)


def test_bf16_expert_biases_become_f32():
    """A BF16 is sign, 8 exponent bits and 7 mantissa bits: decoded by hand, normal and subnormal."""
    rng = np.random.default_rng(12)
    bits = rng.integers(0, 1 << 16, 500, dtype=np.uint16)
    bits = bits[(bits >> 7 & 0xFF) != 0xFF]  # no infinities or NaNs
    sign = np.where(bits >> 15, -1.0, 1.0)
    exponent, mantissa = (bits >> 7 & 0xFF).astype(int), (bits & 0x7F).astype(float)
    expected = sign * np.where(exponent > 0, 2.0 ** (exponent - 127) * (1 + mantissa / 128),
                               2.0 ** -126 * mantissa / 128)
    ours = Conversion.BF16_TO_F32.convert(bits.view(np.uint8)).view("<f4")
    np.testing.assert_array_equal(ours, expected)


def test_august_2025_gpt_oss_file_holds_what_ollama_wrote(synthetic):
    """Type ids 4 (MXFP4, OpenAI's order) and BF16 (the experts' biases) in the file, as Ollama's converter
    wrote them; the reader reports what ggml gets (MXFP4, F32) and what the file holds (Ollama's `show`)."""
    from ollama_engine.fs import GGUFFile

    old = GGUFFile.open(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout="ollama-2025-08"))
    tensors = ("blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_gate_up_exps.bias", "blk.1.ffn_down_exps.weight",
               "blk.1.ffn_down_exps.bias", "blk.1.attn_qkv.bias")
    data = old.path.read_bytes()
    found = []
    for name in tensors:
        at = _tensor_info(data, name)  # the type id follows the dimensions
        raw_type = struct.unpack_from("<I", data, at + 4 + 8 * struct.unpack_from("<I", data, at)[0])[0]
        found.append((raw_type, old.tensors[name].ggml_type.name, old.tensors[name].file_type.name))
    assert found == [(4, "MXFP4", "MXFP4"), (30, "F32", "BF16"), (4, "MXFP4", "MXFP4"), (30, "F32", "BF16"),
                     (0, "F32", "F32")]


def _tensor_info(data: bytes, name: str) -> int:
    """Where the tensor info of `name` has its dimension count in the GGUF bytes `data`."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


@pytest.mark.parametrize(("change", "message"), [
    ("shape", "blk.0.ffn_gate_up_exps.weight has shape [64, 64, 8], expected [64, 128, 8]"),
    ("name", "missing required tensor blk.0.ffn_gate_exps.weight"),
])
def test_fused_gate_up_is_checked(synthetic, tmp_path, change, message):
    """A fused gate_up of half its rows is refused (ggml would read past the stack), and gated experts with
    neither gate nor gate_up are missing their gate."""
    from ollama_engine.models.base import ModelError

    data = bytearray(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout="ollama-2025-08").read_bytes())
    at = _tensor_info(data, "blk.0.ffn_gate_up_exps.weight")
    if change == "shape":
        struct.pack_into("<Q", data, at + 4 + 8, 64)  # dimension 1: 2 n_ff -> n_ff
    else:
        data[at - 1:at] = b"x"  # blk.0.ffn_gate_up_exps.weighx
    path = tmp_path / "case.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelError, match=re.escape(message)):
        load_model(path, allocate=False).close()


def test_august_2025_gpt_oss_file_loads_in_chunks_as_ggml_holds_it(synthetic, monkeypatch):
    """Backend.load converts a chunk of whole blocks at a time (repacked weights whole): with chunks of
    under 1000 bytes and the plain layout, every weight holds the bytes the llama.cpp-named file has."""
    from ollama_engine.fs import GGUFFile
    from ollama_engine.ml import model_backend as backend_module

    monkeypatch.setattr(backend_module, "LOAD_CHUNK", 1000)
    old = GGUFFile.open(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout="ollama-2025-08"))
    new = GGUFFile.open(synthetic("gpt-oss", "Q8_0", expert_type="MXFP4"))
    with Backend(old, allocate=True, repack_weights=False) as backend:
        backend.load()
        for suffix in ("weight", "bias"):
            fused = backend.get(f"blk.0.ffn_gate_up_exps.{suffix}").numpy().tobytes()
            info = old.tensors[f"blk.0.ffn_gate_up_exps.{suffix}"]
            assert len(fused) == info.ggml_bytes > 1000
            halves = [np.asarray(new.tensor_data(f"blk.0.ffn_{part}_exps.{suffix}")).reshape(
                info.shape[-1], info.shape[-2] // 2, -1) for part in ("gate", "up")]
            assert fused == np.stack(halves, axis=2).tobytes()
            down = backend.get(f"blk.0.ffn_down_exps.{suffix}").numpy().tobytes()
            assert down == np.asarray(new.tensor_data(f"blk.0.ffn_down_exps.{suffix}")).tobytes()


def test_august_2025_gpt_oss_repacked_experts_are_gathered_from_chunks(synthetic, monkeypatch):
    """Experts in the CPU's repacked layout (MXFP4 has one on x86 with AVX2) are converted in chunks and
    written whole: the same logits as the llama.cpp-named file's."""
    from ollama_engine.ml import model_backend as backend_module

    monkeypatch.setattr(backend_module, "LOAD_CHUNK", 1000)
    old = synthetic("gpt-oss", "Q8_0", expert_type="MXFP4", layout="ollama-2025-08")
    reference = synthetic("gpt-oss", "Q8_0", expert_type="MXFP4")
    np.testing.assert_array_equal(greedy_logits(old, steps=2), greedy_logits(reference, steps=2))


def test_expert_weights_are_counted_in_their_layer(synthetic):
    from ollama_engine.fs import GGUFFile

    path = synthetic("qwen3moe")
    file = GGUFFile.open(path)
    with Backend(file, allocate=False) as backend:
        for layer in range(backend.block_count):
            experts = sum(info.n_bytes for name, info in file.tensors.items()
                          if name.startswith(f"blk.{layer}.ffn_") and "_exps" in name)
            assert experts > 0
            assert backend.memory.cpu.weights[layer] >= experts


@pytest.mark.reference
def test_repacked_q4_0_experts_match_llama_cpp(synthetic):
    """Q4_0 experts in the CPU's repacked layout (mul_mat_id's fast kernels), as llama.cpp stores them."""
    from ollama_engine.models import load_model

    path = synthetic("qwen3moe", "Q4_0", n_embd=128, n_head=4, n_ff_exp=128)
    model = load_model(path, allocate=False)
    try:
        repacked = model.backend.repacked_weights()
    finally:
        model.close()
    if not any("_exps" in name for name in repacked):
        pytest.skip("this CPU has no repacked Q4_0 layout")
    assert compare_schedule(path, flash=False, cache_type="f16", sequences=2, threads=1) < TOLERANCE
