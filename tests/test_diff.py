"""`ollama-engine diff`: faithful models agree with llama.cpp tensor by tensor, and a model broken on
purpose (a wrong RoPE base, a missing norm weight) is caught at the first layer and tensor it breaks.

Models are broken in our engine only, after loading (diff.load_model is wrapped), so llama.cpp still
reads the file correctly: exactly the situation of a new architecture with a bug in its graph.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine import diff
from ollama_engine.cli import main
from ollama_engine.ml import Backend, DType, TensorCapture
from ollama_engine.models import Model, load_model

PROMPT = "The quick brown fox jumps over the lazy dog"
LLAMA_LAYER = ["attn_norm", "Kcur", "Vcur", "Qcur", "kqv_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_swiglu", "ffn_out", "l_out"]
EXPECTED = {  # what each architecture must compare in each layer, and outside the layers
    "llama": (LLAMA_LAYER[:5] + ["attn_out"] + LLAMA_LAYER[5:], ["embd", "result_norm", "result_output"]),
    "qwen2": (LLAMA_LAYER, ["embd", "result_norm", "result_output"]),
    "qwen3": (LLAMA_LAYER, ["embd", "result_norm", "result_output"]),
    "bert": (["Vcur", "Kcur", "Qcur", "kqv_out", "ffn_inp", "ffn_gelu", "ffn_out"],
             ["embd", "inp_embd", "result_embd", "result_embd_pooled"]),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    folder = tmp_path_factory.mktemp("diff")
    written: dict[tuple[str, str], Path] = {}

    def write(arch: str, weight_type: str = "F32") -> Path:
        if (arch, weight_type) not in written:
            written[arch, weight_type] = write_synthetic(folder / f"{arch}-{weight_type}.gguf", arch,
                                                         weight_type=weight_type)
        return written[arch, weight_type]

    return write


def break_model(monkeypatch: pytest.MonkeyPatch, breaks: Callable[[Model], None]) -> None:
    """Our engine's model, once loaded, gets `breaks` applied; llama.cpp reads the file as it is."""

    def load(*args, **kwargs) -> Model:
        model = load_model(*args, **kwargs)
        breaks(model)
        return model

    monkeypatch.setattr(diff, "load_model", load)


# ---------------------------------------------------------------- without llama.cpp


def test_layers_are_numbers_and_ranges_within_the_model():
    assert diff.parse_layers(None, 4) is None
    assert diff.parse_layers("0-2, 3", 4) == {0, 1, 2, 3}
    for bad in ("4", "2-1", "a", "1-", "-1"):
        with pytest.raises(ValueError, match="--layers"):
            diff.parse_layers(bad, 4)


def test_capture_copies_named_nodes_in_their_logical_shape_and_leaves_results_unchanged():
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)  # ggml shape (4, 3, 2)
    taken: dict[str, np.ndarray] = {}
    with Backend(None, num_threads=1) as backend, backend.new_context() as ctx:
        x = ctx.input().from_numpy(values)
        swapped = x.permute(1, 0, 2, 3).set_name("swapped")  # a strided view, ggml shape (3, 4, 2)
        half = swapped.contiguous().cast(DType.F16).set_name("half")
        out = half.cast(DType.F32).scale(2.0)
        ctx.compute(out)
        plain = out.numpy()
        capture = TensorCapture(lambda name: name in ("swapped", "half"), taken.__setitem__)
        with backend.eval_callback(capture):
            ctx.compute(out)
        np.testing.assert_array_equal(out.numpy(), plain)
    assert set(taken) == {"swapped", "half"}
    for name in taken:
        np.testing.assert_array_equal(taken[name].reshape(2, 4, 3), values.transpose(0, 2, 1))
        assert taken[name].dtype == np.float32


def test_diff_without_llama_cpp_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(diff, "have_llama_cpp", lambda: False)
    with pytest.raises(RuntimeError, match="pip install llama-cpp-python==0.3.36"):
        diff.run_diff(tmp_path / "any.gguf", PROMPT)
    assert main(["diff", str(tmp_path / "any.gguf"), "--prompt", PROMPT]) == 1
    assert "error: diff needs llama.cpp's Python bindings" in capsys.readouterr().err


def test_gpu_asks_for_a_gpu_and_says_when_there_is_none(stories_path, monkeypatch, capsys):
    monkeypatch.setattr(diff, "on_first_gpu", lambda total_layers, count=None: [])  # whatever this machine has
    with pytest.raises(ValueError, match="no GPU"):
        diff.run_diff(stories_path, PROMPT, gpu=True)
    assert main(["diff", str(stories_path), "--prompt", PROMPT, "--gpu"]) == 1
    assert "--gpu: this machine has no GPU" in capsys.readouterr().err


# ---------------------------------------------------------------- against llama.cpp


@pytest.mark.reference
@pytest.mark.parametrize(("arch", "weight_type"), [
    ("llama", "F32"), ("llama", "Q4_0"), ("qwen2", "F16"), ("qwen3", "Q8_0"), ("bert", "F32"),
])
def test_a_faithful_model_matches_llama_cpp_tensor_by_tensor(synthetic, arch, weight_type):
    result = diff.run_diff(synthetic(arch, weight_type), PROMPT, threads=1, generate=4)
    assert result.tokens == result.llama_tokens
    assert result.first_over is None and not result.departs, [t for t in result.tensors if t.rel > 0]
    per_layer, outside = EXPECTED[arch]
    names = [t.name for t in result.tensors]
    for layer in (0, 1):
        assert {n.rsplit("-", 1)[0] for n in names if n.endswith(f"-{layer}") and n != "inp_norm-0"} == set(per_layer)
    assert {n for n in names if "-" not in n} == set(outside)
    assert result.output_max_abs < 1e-4
    if arch != "bert":
        assert len(result.ours_argmax) == len(result.tokens) + 4 and result.greedy_agree


@pytest.mark.reference
def test_a_wrong_rope_base_is_found_at_layer_0s_rope(stories_path, monkeypatch):
    def wrong_rope_base(model: Model) -> None:
        model.options = dataclasses.replace(model.options, rope_base=model.options.rope_base * 2)

    break_model(monkeypatch, wrong_rope_base)
    result = diff.run_diff(stories_path, "Once upon a time there was a little", threads=1, generate=4)
    first = result.first_over
    assert first is not None and result.departs
    assert first.layer == 0 and first.name in ("Kcur-0", "Qcur-0")  # the first rotated tensor in our graph
    before = result.tensors[: result.tensors.index(first)]
    assert {"embd", "attn_norm-0"} <= {t.name for t in before} <= {"embd", "attn_norm-0", "Vcur-0"}
    assert all(t.max_abs == 0 for t in before)
    assert next(t for t in result.tensors if t.name == "Vcur-0").max_abs == 0  # no RoPE on values


@pytest.mark.reference
def test_a_missing_norm_is_found_at_its_layer_and_tensor(synthetic, monkeypatch, capsys):
    def drop_norm(model: Model) -> None:
        model.layers[1].ffn_norm = None  # layer 1 forgets its FFN norm's weight

    def found(first: diff.TensorDiff | None, missing: list[str]) -> bool:
        """Normalised without the weight (ffn_norm-1 differs), or the norm skipped (its first user differs,
        and llama.cpp's ffn_norm-1 has no counterpart)."""
        return first is not None and (first.name == "ffn_norm-1" or
                                      (first.name == "ffn_gate-1" and missing == ["ffn_norm-1"]))

    break_model(monkeypatch, drop_norm)
    path = synthetic("qwen2")
    assert main(["diff", str(path), "--prompt", PROMPT, "--threads", "1", "-n", "2"]) == 1
    text = capsys.readouterr().out
    marked = [line.split() for line in text.splitlines() if line.endswith("<- first over tolerance")]
    assert len(marked) == 1 and marked[0][0] == "1" and marked[0][1] in ("ffn_norm", "ffn_gate")
    assert f"first departure: layer 1, {marked[0][1]}-1" in text

    result = diff.run_diff(path, PROMPT, threads=1, generate=0, layers="1")
    assert found(result.first_over, result.missing), (result.first_over, result.missing)
    assert {t.layer for t in result.tensors} == {1, None}
    assert all(t.max_abs == 0 for t in result.tensors[: result.tensors.index(result.first_over)])


@pytest.mark.reference
def test_json_output_of_a_faithful_model(synthetic, capsys):
    path = synthetic("llama")
    assert main(["diff", str(path), "--prompt", PROMPT, "--layers", "0", "--json", "--threads", "1", "-n", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_over"] is None and out["greedy_agree"] and not out["departs"]
    assert {t["layer"] for t in out["tensors"]} == {0, None}
    norm = next(t for t in out["tensors"] if t["name"] == "attn_norm-0")
    assert norm == {"name": "attn_norm-0", "layer": 0, "shape": [64, len(out["tokens"])],
                    "llama_shape": [64, len(out["tokens"])], "max_abs": 0.0, "rel": 0.0}


@pytest.mark.reference
def test_smollm2_matches_llama_cpp_in_its_first_and_last_layers(smollm2_path):
    result = diff.run_diff(smollm2_path, "The capital of France is", layers="0,29", generate=4, threads=1)
    assert result.first_over is None and result.greedy_agree, result.first_over
    assert {t.layer for t in result.tensors} == {0, 29, None} and len(result.tensors) == 2 * 13 + 3
