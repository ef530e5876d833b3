"""Synthetic GGUF models: our reader sees the tensors and keys llama.cpp expects, and llama.cpp runs them."""

from __future__ import annotations

import re
from pathlib import Path

import assets
import gguf
import numpy as np
import pytest
from synthetic.declared import SHAPES, declared_tensors, families
from synthetic.models import ARCHITECTURES, PRESETS, resolve_spec, write_synthetic

from ollama_engine.fs import GGUFFile
from ollama_engine.ml import Backend


@pytest.fixture(autouse=True)
def vocab_folder() -> Path:
    """Synthetic models copy a real tokenizer from llama.cpp's vocab files."""
    return assets.vocab_dir()


ARCHS = ("llama", "qwen2", "qwen3", "bert")
WEIGHT_TYPES = ("F32", "F16", "Q8_0", "Q4_0")
F32 = gguf.GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


def synthetic(model_dir: Path, arch: str, weight_type: str) -> Path:
    """Each (arch, type) file once per module: the llama.cpp tests reuse what the reader tests wrote."""
    path = model_dir / f"{arch}-{weight_type}.gguf"
    if not path.exists():
        write_synthetic(path, arch, weight_type=weight_type)
    return path


def expected_tensors(arch: str) -> dict[str, str]:
    """llama.cpp's tensor names for the tiny preset, with the kind of each (from src/models/<arch>.cpp)."""
    spec = resolve_spec(arch)
    names = {"token_embd.weight": "matrix"}
    if arch == "bert":
        names |= {
            "token_types.weight": "f32",
            "position_embd.weight": "f32",
            "token_embd_norm.weight": "f32",
            "token_embd_norm.bias": "f32",
        }
        per_layer = {
            "attn_q.weight": "matrix",
            "attn_k.weight": "matrix",
            "attn_v.weight": "matrix",
            "attn_output.weight": "matrix",
            "ffn_up.weight": "matrix",
            "ffn_down.weight": "matrix",
        }
        per_layer |= {
            n: "f32"
            for n in (
                "attn_q.bias",
                "attn_k.bias",
                "attn_v.bias",
                "attn_output.bias",
                "ffn_up.bias",
                "ffn_down.bias",
                "attn_output_norm.weight",
                "attn_output_norm.bias",
                "layer_output_norm.weight",
                "layer_output_norm.bias",
            )
        }
    else:
        names["output_norm.weight"] = "f32"
        if not spec.tied_embeddings:
            names["output.weight"] = "matrix"
        if spec.rope_freqs:
            names["rope_freqs.weight"] = "f32"
        per_layer = {
            n: "matrix"
            for n in (
                "attn_q.weight",
                "attn_k.weight",
                "attn_v.weight",
                "attn_output.weight",
                "ffn_gate.weight",
                "ffn_up.weight",
                "ffn_down.weight",
            )
        }
        per_layer |= {"attn_norm.weight": "f32", "ffn_norm.weight": "f32"}
        if arch == "qwen2":
            per_layer |= {"attn_q.bias": "f32", "attn_k.bias": "f32", "attn_v.bias": "f32"}
        if arch == "qwen3":
            per_layer |= {"attn_q_norm.weight": "f32", "attn_k_norm.weight": "f32"}
    for i in range(spec.n_layer):
        names |= {f"blk.{i}.{n}": kind for n, kind in per_layer.items()}
    return names


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_reader_sees_expected_tensors_and_keys(model_dir: Path, arch: str, weight_type: str) -> None:
    spec = resolve_spec(arch)
    model = GGUFFile.open(synthetic(model_dir, arch, weight_type))
    config = model.config
    assert model.architecture == arch

    expected = expected_tensors(arch)
    assert set(model.tensors) == set(expected)
    wanted_type = gguf.GGMLQuantizationType[weight_type]
    for name, kind in expected.items():
        assert model.tensors[name].ggml_type == (wanted_type if kind == "matrix" else F32), name

    n_vocab = len(config.get_strings("tokenizer.ggml.tokens"))
    head_dim = spec.head_dim or spec.n_embd // spec.n_head
    shapes = {
        "token_embd.weight": (spec.n_embd, n_vocab),
        "blk.0.attn_q.weight": (spec.n_embd, spec.n_head * head_dim),
        "blk.0.attn_k.weight": (spec.n_embd, spec.n_head_kv * head_dim),
        "blk.0.attn_v.weight": (spec.n_embd, spec.n_head_kv * head_dim),
        "blk.0.attn_output.weight": (spec.n_head * head_dim, spec.n_embd),
        "blk.1.ffn_up.weight": (spec.n_embd, spec.n_ff),
        "blk.1.ffn_down.weight": (spec.n_ff, spec.n_embd),
    }
    for name, shape in shapes.items():
        assert model.tensors[name].shape == shape, name

    assert config.get_uint("block_count") == spec.n_layer
    assert config.get_uint("embedding_length") == spec.n_embd
    assert config.get_uint("feed_forward_length") == spec.n_ff
    assert config.get_uint("attention.head_count") == spec.n_head
    assert config.get_uint("attention.head_count_kv") == spec.n_head_kv
    assert config.get_uint("context_length") == spec.context_length
    if arch == "bert":
        assert config.get_float("attention.layer_norm_epsilon") == pytest.approx(spec.eps)
        assert config.get_bool("attention.causal", True) is False
        assert model.tensors["position_embd.weight"].shape == (spec.n_embd, spec.context_length)
    else:
        assert config.get_float("attention.layer_norm_rms_epsilon") == pytest.approx(spec.eps)
        assert config.get_float("rope.freq_base") == spec.rope_base
        assert config.get_uint("rope.dimension_count") == head_dim
        assert config.get_uint("attention.key_length", spec.n_embd // spec.n_head) == head_dim
    if arch == "qwen3":
        assert model.tensors["blk.0.attn_q_norm.weight"].shape == (head_dim,)
        assert head_dim != spec.n_embd // spec.n_head  # the preset exercises an explicit key_length


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_keys_are_copied_verbatim(model_dir: Path, arch: str) -> None:
    model = GGUFFile.open(synthetic(model_dir, arch, "Q8_0"))
    vocab = GGUFFile.open(assets.vocab(resolve_spec(arch).vocab))
    copied = {k: v for k, v in model.metadata.items() if k.startswith("tokenizer.")}
    assert copied == {k: v for k, v in vocab.metadata.items() if k.startswith("tokenizer.")}
    for key in copied:
        assert model.value_types[key] == vocab.value_types[key], key


def test_quantized_weights_are_the_f32_weights_quantized(model_dir: Path) -> None:
    f32 = GGUFFile.open(synthetic(model_dir, "llama", "F32"))
    for weight_type, tolerance in (("Q8_0", 0.01), ("Q4_0", 0.15), ("F16", 1e-3)):
        quantized = GGUFFile.open(synthetic(model_dir, "llama", weight_type))
        for name in ("blk.0.attn_q.weight", "token_embd.weight"):
            info = quantized.tensors[name]
            values = gguf.quants.dequantize(quantized.tensor_data(name), info.ggml_type).reshape(-1)
            reference = f32.tensor_data(name).view(np.float32)
            scale = np.abs(reference).max()
            assert np.abs(values - reference).max() <= tolerance * scale, (weight_type, name)
        np.testing.assert_array_equal(
            quantized.tensor_data("blk.0.attn_norm.weight"), f32.tensor_data("blk.0.attn_norm.weight")
        )


def test_weights_are_spread_and_seeded(model_dir: Path, tmp_path: Path) -> None:
    first = GGUFFile.open(synthetic(model_dir, "llama", "F32"))
    again = GGUFFile.open(write_synthetic(tmp_path / "again.gguf", "llama", seed=0))
    other = GGUFFile.open(write_synthetic(tmp_path / "other.gguf", "llama", seed=1))
    assert first.path.read_bytes() == again.path.read_bytes()

    spec = resolve_spec("llama")
    q = first.tensor_data("blk.0.attn_q.weight").view(np.float32)
    assert q.std() == pytest.approx(1 / np.sqrt(spec.n_embd), rel=0.05)
    norm = first.tensor_data("blk.0.attn_norm.weight").view(np.float32)
    assert abs(norm.mean() - 1.0) < 0.05 and 0.05 < norm.std() < 0.2
    assert not np.array_equal(q, other.tensor_data("blk.0.attn_q.weight").view(np.float32))
    assert first.metadata == other.metadata

    factors = first.tensor_data("rope_freqs.weight").view(np.float32)
    assert factors.shape == (spec.n_rot // 2,)
    assert factors[0] == 1.0 and factors[-1] == 32.0  # Llama 3: high frequencies kept, low ones scaled


def test_overrides_and_vocab_padding(tmp_path: Path) -> None:
    path = write_synthetic(
        tmp_path / "padded.gguf",
        "qwen2",
        vocab="llama-spm",
        n_vocab=32010,
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_head_kv=1,
        n_ff=64,
        tied_embeddings=False,
    )
    model = GGUFFile.open(path)
    tokens = model.config.get_strings("tokenizer.ggml.tokens")
    assert len(tokens) == 32010 and tokens[-1] == "[PAD32009]"
    assert model.config.get_ints("tokenizer.ggml.token_type")[-1] == gguf.TokenType.UNUSED
    assert len(model.config.get_floats("tokenizer.ggml.scores")) == 32010
    assert model.config.get_string("tokenizer.ggml.model") == "llama"
    assert model.tensors["token_embd.weight"].shape == (32, 32010)
    assert model.tensors["output.weight"].shape == (32, 32010)
    assert {n for n in model.tensors if n.startswith("blk.")} == {n for n in model.tensors if n.startswith("blk.0.")}


def test_presets_for_benchmarks() -> None:
    smollm = PRESETS["smollm2-135m"]
    assert (smollm.arch, smollm.n_embd, smollm.n_layer, smollm.n_head, smollm.n_head_kv, smollm.n_ff) == (
        "llama",
        576,
        30,
        9,
        3,
        1536,
    )
    assert smollm.tied_embeddings and smollm.vocab == "gpt-2"
    llama = PRESETS["llama-3.2-1b"]
    assert (llama.arch, llama.n_embd, llama.n_layer, llama.n_head, llama.n_head_kv, llama.n_ff) == (
        "llama",
        2048,
        16,
        32,
        8,
        8192,
    )
    assert llama.tied_embeddings and llama.rope_freqs and llama.vocab == "llama-bpe"


TINY_PRESETS = [name for name in PRESETS if name.startswith("tiny-")]


def test_every_architecture_is_derived_from_its_declarations() -> None:
    assert set(families()) == set(ARCHITECTURES)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_declared_tensors_are_what_the_model_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    preset: str) -> None:
    """The tensors the writer derives from an architecture's declarations are exactly those its model asks the
    backend for (those the Backend copies per layer asked for under the layer's name), and loading the file
    finds every required one."""
    from ollama_engine.models import load_model

    asked: set[str] = set()
    get = Backend.get

    def recording(self: Backend, name: str):
        asked.add(name)
        return get(self, name)

    monkeypatch.setattr(Backend, "get", recording)
    path = write_synthetic(tmp_path / f"{preset}.gguf", preset)
    model = load_model(path, allocate=False)
    try:
        written = set(GGUFFile.open(path).tensors)
        assert {name for name in written if name not in asked and f"blk.0.{name}" not in asked} == set()
    finally:
        model.close()


def test_a_declared_tensor_without_a_shape_rule_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(SHAPES, "attn_q.bias")
    with pytest.raises(ValueError, match=r"qwen2: no shape rule for \['attn_q.bias'\]"):
        list(declared_tensors(resolve_spec("qwen2"), 1000))


def test_smollm_shape_with_gpt2_vocab(tmp_path: Path) -> None:
    model = GGUFFile.open(write_synthetic(tmp_path / "smol.gguf", "smollm2-135m", weight_type="Q8_0", n_layer=1))
    assert model.tensors["token_embd.weight"].shape == (576, 50257)
    assert "output.weight" not in model.tensors
    assert model.tensors["blk.0.attn_k.weight"].shape == (576, 192)
    assert model.config.get_string("tokenizer.ggml.pre") == "gpt-2"


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("mamba", {}, "unknown synthetic model"),
        ("llama", {"n_layers": 3}, "unknown synthetic model option"),
        ("llama", {"weight_type": "Q8_K"}, "unknown weight type"),
        ("llama", {"n_head": 4, "n_head_kv": 3}, "not a multiple of n_head_kv"),
        ("qwen2", {"head_dim": 8}, re.escape("head_dim * n_head == n_embd")),
        ("bert", {"n_head_kv": 2}, "n_head_kv == n_head"),
        ("llama", {"head_dim": 15}, "must be even"),
        ("llama", {"vocab": "no-such-vocab"}, "no llama.cpp vocab 'no-such-vocab'"),
        ("llama", {"n_vocab": 100}, "smaller than"),
        (
            "llama",
            {"weight_type": "Q4_0", "n_embd": 48, "n_head": 4, "n_head_kv": 2},
            "not a multiple of the Q4_0",
        ),
    ],
)
def test_bad_requests_are_clear_errors(tmp_path: Path, arch: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_synthetic(tmp_path / "bad.gguf", arch, **kwargs)
    assert not (tmp_path / "bad.gguf").exists()


def write_q4_k(path: Path) -> Path:
    try:
        import ollama_engine.ggml  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Q4_K is quantized by ggml through ollama_engine.ggml, which is not available: {e}")
    return write_synthetic(path, "llama", weight_type="Q4_K", n_embd=256, n_ff=512)


def test_q4_k(tmp_path: Path) -> None:
    model = GGUFFile.open(write_q4_k(tmp_path / "q4k.gguf"))
    f32 = GGUFFile.open(write_synthetic(tmp_path / "f32.gguf", "llama", n_embd=256, n_ff=512))
    info = model.tensors["blk.0.ffn_up.weight"]
    assert info.ggml_type == gguf.GGMLQuantizationType.Q4_K and info.shape == (256, 512)
    values = gguf.quants.dequantize(model.tensor_data(info.name), info.ggml_type).reshape(-1)
    reference = f32.tensor_data(info.name).view(np.float32)
    assert np.abs(values - reference).max() <= 0.15 * np.abs(reference).max()
    assert model.tensors["blk.0.ffn_norm.weight"].ggml_type == F32


# ---------------------------------------------------------------- llama.cpp loads and runs them


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="the llama.cpp reference (llama-cpp-python) is not installed")


def run_prompt(llm) -> np.ndarray:
    tokens = llm.tokenize(b"Once upon a time, there was a little robot")
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)])
    assert logits.shape == (len(tokens), llm.n_vocab())
    return logits


def assert_sane(logits: np.ndarray) -> None:
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all()  # every position has spread-out logits
    assert len(set(logits.argmax(axis=1).tolist())) > 1  # and the prediction depends on the input


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("arch", ("llama", "qwen2", "qwen3"))
def test_llama_cpp_runs_synthetic_model(llama_cpp, model_dir: Path, arch: str, weight_type: str) -> None:
    llm = llama_cpp.Llama(
        model_path=str(synthetic(model_dir, arch, weight_type)), n_ctx=128, logits_all=True, verbose=False
    )
    assert_sane(run_prompt(llm))


@pytest.mark.reference
def test_llama_cpp_runs_q4_k_model(llama_cpp, tmp_path: Path) -> None:
    path = write_q4_k(tmp_path / "q4k.gguf")
    assert_sane(run_prompt(llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False)))


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_llama_cpp_embeds_with_synthetic_bert(llama_cpp, model_dir: Path, weight_type: str) -> None:
    llm = llama_cpp.Llama(
        model_path=str(synthetic(model_dir, "bert", weight_type)), n_ctx=128, embedding=True, verbose=False
    )
    first = np.array(llm.embed("the cat sat on the mat"))
    second = np.array(llm.embed("a completely different sentence"))
    assert first.shape == (resolve_spec("bert").n_embd,)
    assert np.isfinite(first).all() and first.std() > 0
    assert not np.allclose(first, second)
