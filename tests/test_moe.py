"""Mixtures of experts: the routing against numpy, each MoE architecture against llama.cpp, and memory.

The architectures run on tiny synthetic models (tests/.. fs/synthetic.py presets) through
llama_reference.compare_schedule: two sequences of different lengths prefilled in one batch, then
eight batches decoding one token for each; every logprob within the tolerance and the same greedy
tokens at every step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_reference import PROMPTS, compare_schedule
from memory_checks import fitted_then_allocated

from ollama_engine.fs.synthetic import write_synthetic
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.ml import Backend
from ollama_engine.models import load_model
from ollama_engine.models.moe import Experts, Gating, Routing, moe
from ollama_engine.runner.allocate import LoadParams

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


@pytest.mark.parametrize("layout", ["ollama", "ollama-qkv"])
def test_ollama_gpt_oss_files_match_llama_cpp_named_ones(synthetic, layout):
    """Ollama's own gpt-oss conversions (architecture "gptoss": attn_out, attn_sinks, ffn_norm, no
    rope.scaling.type as Ollama always applies YaRN; q, k and v fused in attn_qkv when converted from
    OpenAI's original checkpoint) hold the same model as llama.cpp's: the same weights under both names
    give identical logits. (llama.cpp cannot load Ollama's files; the llama.cpp-named one is checked
    against llama.cpp above.) Measured: bit-identical."""
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
