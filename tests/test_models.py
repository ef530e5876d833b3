"""Model definitions without the reference: registry, tensor binding, hyper-parameters, output rows,
context shift, and the in-process generator. Parity with llama.cpp is in test_parity.py."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.fs import Config, GGUFFile
from ollama_engine.generate import generate, prefill
from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, DType
from ollama_engine.models import ModelError, architectures, bind, load_model, model_class, registry_name
from ollama_engine.models.layers import LlamaLayer
from ollama_engine.models.llama import Llama
from ollama_engine.models.options import Options
from ollama_engine.models.qwen2 import Qwen2, Qwen2Layer
from ollama_engine.models.qwen3 import Qwen3

THREADS = 1  # tiny models: more threads only add synchronisation
PROMPT = "The quick brown fox jumps over the lazy dog. It was"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    """write(arch, weight_type, **overrides) -> path, each file written once per module."""
    folder = tmp_path_factory.mktemp("models")
    written: dict[tuple, Path] = {}

    def write(arch: str, weight_type: str = "F32", **overrides) -> Path:
        key = (arch, weight_type, tuple(sorted(overrides.items())))
        if key not in written:
            name = "-".join([arch, weight_type, *(f"{k}{v}" for k, v in sorted(overrides.items()))])
            written[key] = write_synthetic(folder / f"{name}.gguf", arch, weight_type=weight_type, **overrides)
        return written[key]

    return write


def open_model(path: Path, capacity: int = 256, max_batch: int = 64):
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, DType.F16, 1, capacity, max_batch)
    return model


def prompt_batch(tokens: list[int], start: int = 0, outputs=None) -> Batch:
    n = len(tokens)
    return Batch(positions=np.arange(start, start + n), sequences=np.zeros(n),
                 outputs=range(n) if outputs is None else outputs, tokens=tokens)


# ------------------------------------------------------------ registry


def test_registry_serves_the_three_architectures():
    assert {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3}.items() <= architectures().items()


def test_a_fresh_process_imports_only_the_architecture_it_loads(tmp_path):
    """A runner's start imports the file's architecture module alone; an architecture served by a module of
    another name and an unknown one are still found (every module is then imported); the towers are there."""
    from synthetic.vision import VisionSpec, write_mmproj

    llama_file = write_synthetic(tmp_path / "llama.gguf", "llama", weight_type="F32")
    gemma_file = write_synthetic(tmp_path / "gemma3.gguf", "gemma3", weight_type="F32")  # served by gemma2.py
    mmproj = write_mmproj(tmp_path / "mmproj.gguf", VisionSpec(), weight_type="F32")
    script = f"""
import sys
from ollama_engine.fs import Config
from ollama_engine.models import ModelError, load_model, model_class
from ollama_engine.models.vision import load_vision

def architecture_modules():
    return sorted(m for m in sys.modules if m.startswith("ollama_engine.models.") and m.rsplit(".", 1)[1] in
                  ("llama", "gemma2", "qwen3", "bert"))

load_model({str(llama_file)!r}, allocate=False).close()
print(architecture_modules())
load_model({str(gemma_file)!r}, allocate=False).close()
try:
    model_class(Config({{"general.architecture": "os"}}))
except ModelError as err:
    print("llama," in str(err) and "qwen3," in str(err))
print(type(load_vision({str(mmproj)!r}, allocate=False)).__name__)
print(architecture_modules())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    first, unknown, tower, last = result.stdout.splitlines()
    assert first == "['ollama_engine.models.llama']"
    assert unknown == "True" and tower == "Gemma3Vision"
    assert last == str([f"ollama_engine.models.{m}" for m in ("bert", "gemma2", "llama", "qwen3")])


def test_registry_name_adds_embed_for_pooling_models():
    assert registry_name(Config({"general.architecture": "qwen3"})) == "qwen3"
    assert registry_name(Config({"general.architecture": "qwen3", "qwen3.pooling_type": 1})) == "qwen3_embed"
    assert registry_name(Config({"general.architecture": "qwen3", "qwen3.pooling_type": 0})) == "qwen3"


def test_unknown_architecture_is_an_error_naming_it():
    with pytest.raises(ModelError, match="unknown model architecture: 'gpt-j'"):
        model_class(Config({"general.architecture": "gpt-j"}))
    with pytest.raises(ModelError, match="unknown model architecture: 'llama_embed'"):
        model_class(Config({"general.architecture": "llama", "llama.pooling_type": 2}))
    with pytest.raises(ModelError, match="no general.architecture"):
        model_class(Config({}))


# ------------------------------------------------------------ tensors and hyper-parameters


def test_bind_fills_fields_and_leaves_missing_optional_tensors_none(synthetic):
    with Backend(GGUFFile.open(synthetic("llama")), allocate=False, tensor_groups=Llama.tensor_groups) as backend:
        layer = bind(LlamaLayer, backend, "blk.1.")
        assert layer.attn_q is backend.get("blk.1.attn_q.weight")
        assert layer.rope_freqs is backend.get("blk.1.rope_freqs.weight") is not None  # tiny-llama has them
    with Backend(GGUFFile.open(synthetic("qwen2")), allocate=False, tensor_groups=Qwen2.tensor_groups) as backend:
        layer = bind(Qwen2Layer, backend, "blk.0.")
        assert layer.rope_freqs is None
        assert layer.attn_k_bias.shape == (32,)


def test_missing_required_tensor_is_an_error_naming_it(synthetic):
    with Backend(GGUFFile.open(synthetic("llama")), allocate=False, tensor_groups=Llama.tensor_groups) as backend:
        with pytest.raises(ModelError, match=r"missing required tensor blk\.0\.attn_q\.bias"):
            bind(Qwen2Layer, backend, "blk.0.")
    # a qwen2 file written without QKV biases fails at load, naming the first missing one
    with pytest.raises(ModelError, match=r"missing required tensor blk\.0\.attn_q\.bias"):
        load_model(synthetic("qwen2", qkv_bias=False, name="nobias"), allocate=False)


def test_tied_embeddings_give_an_output_weight(synthetic):
    model = load_model(synthetic("qwen2"), allocate=False)  # tiny-qwen2 has no output.weight
    try:
        assert "output.weight" not in model.backend.model.tensors
        assert model.weights.output.shape == model.weights.token_embd.shape
    finally:
        model.close()


def test_hyper_parameters_and_llama_cpp_defaults():
    base = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.attention.head_count": 4}
    o = Options.from_config(Config(base))
    assert (o.kv_heads, o.head_dim, o.rope_dims, o.rope_base, o.rope_scale, o.eps) == (4, 16, 16, 10000.0, 1.0, 1e-5)
    assert o.attention_scale == pytest.approx(1 / math.sqrt(16))
    o = Options.from_config(Config({**base, "llama.attention.head_count_kv": 2, "llama.attention.key_length": 32,
                                    "llama.rope.scaling.factor": 4.0, "llama.rope.freq_base": 5e5,
                                    "llama.rope.dimension_count": 8}))
    assert (o.kv_heads, o.head_dim, o.rope_dims, o.rope_base, o.rope_scale) == (2, 32, 8, 5e5, 0.25)
    with pytest.raises(ModelError, match=r"llama\.block_count"):
        Options.from_config(Config({k: v for k, v in base.items() if k != "llama.block_count"}))
    with pytest.raises(ModelError, match="head_count_kv 3"):
        Options.from_config(Config({**base, "llama.attention.head_count_kv": 3}))


# ------------------------------------------------------------ forward


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_only_the_requested_rows_reach_the_output_layer(synthetic, arch):
    path = synthetic(arch)
    everything, some = open_model(path), open_model(path)
    try:
        tokens = everything.tokenizer.encode(PROMPT)
        n = len(tokens)
        full = everything.graphs.compute(prompt_batch(tokens))
        picked = some.graphs.compute(prompt_batch(tokens, outputs=[n - 1, 2]))
        assert full.shape == (n, everything.tokenizer.vocab_size)
        assert picked.shape == (2, everything.tokenizer.vocab_size)
        np.testing.assert_allclose(picked, full[[n - 1, 2]], rtol=0, atol=1e-4)
    finally:
        everything.close()
        some.close()


def test_batches_without_outputs_still_fill_the_cache(synthetic):
    path = synthetic("llama")
    whole, split = open_model(path), open_model(path)
    try:
        tokens = whole.tokenizer.encode(PROMPT)
        expected = whole.graphs.compute(prompt_batch(tokens, outputs=[len(tokens) - 1]))[0]
        assert split.graphs.compute(prompt_batch(tokens[:5], outputs=[])) is None
        np.testing.assert_allclose(prefill(split, tokens[5:], 5), expected, rtol=0, atol=1e-4)
    finally:
        whole.close()
        split.close()


def test_a_batch_needs_token_ids(synthetic):
    model = open_model(synthetic("llama"))
    try:
        with pytest.raises(ValueError, match="token ids"):
            model.graphs.compute(Batch(positions=[0], sequences=[0], outputs=[0]))
    finally:
        model.close()


# ------------------------------------------------------------ context shift


def rotate(keys: np.ndarray, delta: int, options: Options, neox: bool, factors: np.ndarray | None) -> np.ndarray:
    """RoPE by `delta` positions in float64: keys (cells, heads, head_dim), the reference for shift()."""
    half = options.rope_dims // 2
    theta = options.rope_scale * delta * options.rope_base ** (-np.arange(half) / half)
    if factors is not None:
        theta = theta / factors[:half]
    cos, sin = np.cos(theta), np.sin(theta)
    x = keys.astype(np.float64).copy()
    if neox:
        a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
        x[..., :half], x[..., half : 2 * half] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = a * cos - b * sin, a * sin + b * cos
    return x


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shift_rotates_stored_keys_to_their_new_positions(synthetic, arch):
    path = synthetic(arch)
    model, direct = open_model(path), open_model(path)
    try:
        cache, o = model.cache, model.options
        tokens = model.tokenizer.encode(PROMPT)
        n, keep, discard = len(tokens), 2, 4
        prefill(model, tokens)
        before = [cache._keys[i].numpy()[:n].copy() for i in range(o.block_count)]
        cache.remove(0, keep, keep + discard)
        after = [cache._keys[i].numpy()[:n] for i in range(o.block_count)]
        moved = slice(keep + discard, n)
        for i in range(o.block_count):
            factors = model.layers[i].rope_freqs
            expected = rotate(before[i][moved], -discard, o, model.rope_options.neox,
                              factors.numpy() if factors is not None else None)
            np.testing.assert_allclose(after[i][moved], expected, rtol=0, atol=2e-2)
            np.testing.assert_array_equal(after[i][:keep], before[i][:keep])

        # layer 0's keys depend only on token and position: computing them at the new positions agrees
        survivors = tokens[:keep] + tokens[keep + discard :]
        prefill(direct, survivors)
        np.testing.assert_allclose(after[0][moved], direct.cache._keys[0].numpy()[keep : len(survivors)],
                                   rtol=0, atol=2e-2)

        # and generation goes on: the next token goes into the first freed cell
        assert np.isfinite(prefill(model, [tokens[-1]], len(survivors))).all()
        assert np.abs(cache._keys[0].numpy()[keep] - after[0][keep]).max() > 0
    finally:
        model.close()
        direct.close()


# ------------------------------------------------------------ generate


class Chunks(io.StringIO):
    """Remembers every write, to check that text is streamed."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_generate_streams_greedy_text(stories_path):
    out = Chunks()
    ids = generate(stories_path, "Once upon a time", 24, out=out, num_threads=THREADS)
    assert len(ids) == 24
    assert sum(1 for w in out.writes if w) >= 12  # one write per token (a few pieces may be empty)
    model = load_model(stories_path, allocate=False)
    try:
        assert out.getvalue() == "".join(model.tokenizer.vocab.piece(t, special=False).decode() for t in ids)
    finally:
        model.close()
    again = io.StringIO()
    assert generate(stories_path, "Once upon a time", 24, out=again, num_threads=THREADS) == ids
    assert again.getvalue() == out.getvalue()


def test_generate_with_temperature_is_reproducible_by_seed(stories_path):
    runs = [generate(stories_path, "Once upon a time", 32, 1.5, seed, io.StringIO(), num_threads=THREADS)
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    greedy = generate(stories_path, "Once upon a time", 32, 0.0, 7, io.StringIO(), num_threads=THREADS)
    assert runs[0] != greedy


def with_eos(source: Path, eos: int, destination: Path) -> Path:
    """A copy of the GGUF file whose tokenizer.ggml.eos_token_id (a UINT32) is `eos`."""
    key = b"tokenizer.ggml.eos_token_id"
    data = source.read_bytes()
    at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    assert data[at : at + 4] == (4).to_bytes(4, "little")  # GGUF value type UINT32
    destination.write_bytes(data[: at + 4] + eos.to_bytes(4, "little") + data[at + 8 :])
    return destination


def test_generate_stops_at_end_of_generation(stories_path, tmp_path):
    free = generate(stories_path, "Once upon a time", 64, out=io.StringIO(), num_threads=THREADS)
    newline = 13  # the <0x0A> byte token, which this run produces
    first = free.index(newline)
    out = io.StringIO()
    ids = generate(with_eos(stories_path, newline, tmp_path / "eos.gguf"), "Once upon a time", 64, out=out,
                   num_threads=THREADS)
    assert ids == free[:first]
    assert "\n" not in out.getvalue()


def test_generate_rejects_a_prompt_longer_than_the_context(synthetic):
    path = synthetic("llama", context_length=8, name="short")
    with pytest.raises(ValueError, match="does not fit the context of 8 tokens"):
        generate(path, PROMPT, 4, out=io.StringIO(), num_threads=THREADS)


def test_a_file_opened_twice_in_a_row_is_parsed_once_unless_it_changed(tmp_path):
    """The runner opens every model twice (fit, then allocate): the second open reuses the tokenizer."""
    path = write_synthetic(tmp_path / "tiny.gguf", "llama")
    fit = load_model(path, allocate=False)
    allocated = load_model(path)
    try:
        assert allocated.tokenizer is fit.tokenizer and allocated.backend is not fit.backend
    finally:
        fit.close()
        allocated.close()
    write_synthetic(path, "llama", seed=1)  # rewritten: read again
    model = load_model(path, allocate=False)
    try:
        assert model.tokenizer is not fit.tokenizer
    finally:
        model.close()
