"""OLMo 3 (olmo2 with sliding-window layers): Ollama's conversion, batched == solo, fit == alloc.

Its parity with llama.cpp is in test_architectures.py (MODELS["olmo3"]); llama.cpp cannot load Ollama's
files (architecture "olmo3"), so those are checked against the llama.cpp-named file of the same weights.
"""

from __future__ import annotations

from pathlib import Path

import decoding
import numpy as np
import pytest
from llama_reference import compare_schedule
from memory_checks import fitted_then_allocated
from synthetic.models import write_synthetic

from ollama_engine import diff
from ollama_engine.kvcache import Batch, Wrapper, cache_dtype
from ollama_engine.models import load_model
from ollama_engine.models.olmo2 import Olmo3
from ollama_engine.runner.allocate import LoadParams

PROMPTS = ("In a small village by the sea, there lived", "Once upon a time there was a king who ruled")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("olmo3")

    def write(layout: str = "llama.cpp", weight_type: str = "F16") -> Path:
        path = folder / f"{layout}-{weight_type}.gguf"
        return path if path.exists() else write_synthetic(path, "tiny-olmo3", weight_type=weight_type, layout=layout)

    return write


def greedy(path: Path, seqs: list[int], steps: int = 12, flash: bool = False) -> dict[int, list[np.ndarray]]:
    """Each sequence's logits over its prompt's last token and `steps` greedy decode steps, the sequences
    prefilled in one batch and decoded together; the prompts (10 tokens) and steps outgrow the window of 8."""
    return decoding.greedy(path, PROMPTS, seqs, steps, flash)


def test_ollama_conversion_equals_llama_cpps(synthetic):
    """Ollama's olmo3 file (its architecture name, the pattern as per-layer flags, its YaRN keys) computes
    what the llama.cpp-named file of the same weights computes: bit-identical logits."""
    model = load_model(synthetic("ollama"), allocate=False)
    try:
        assert isinstance(model, Olmo3) and model.swa == (True, True, False)
        assert isinstance(model.cache, Wrapper)
    finally:
        model.close()
    ours, theirs = greedy(synthetic("ollama"), [0])[0], greedy(synthetic(), [0])[0]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


@pytest.mark.parametrize("flash", [False, True])
def test_batched_equals_solo(synthetic, flash):
    """A sequence's logits do not depend on another sequence sharing its batches, past the window."""
    together = greedy(synthetic(weight_type="Q8_0"), [0, 1], flash=flash)
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(greedy(synthetic(weight_type="Q8_0"), [s], flash=flash)[s], together[s],
                                          strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


def test_fit_equals_alloc(synthetic):
    """fit reports what alloc allocates (both caches of the Wrapper per layer), and inference adds nothing."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(synthetic()), params) as loaded:
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step], sequences=[0], outputs=[0], tokens=[7]))


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff on the sliding and global layers: every tensor named alike is llama.cpp's, bitwise."""
    result = diff.run_diff(synthetic(), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert {"Qcur-0", "Kcur-2", "kqv_out-1", "attn_post_norm-2", "l_out-2", "result_output"} <= {
        t.name for t in result.tensors}


@pytest.mark.reference
def test_sliding_layers_match_llama_cpp_after_their_ring_wraps(synthetic):
    """Two sequences decoding 260 steps: the sliding layers' rings (window 8 + batch 64 cells, padded to 256)
    wrap around, as llama.cpp's do; every logprob within 1e-4 of llama.cpp's and the same greedy tokens."""
    model = load_model(synthetic(weight_type="Q8_0"), allocate=False)
    try:
        model.cache.init(model.backend, cache_dtype("f16"), 2, 512, 64)
        assert model.cache.caches[0].region == 256  # the sliding layers' ring, which 270 positions wrap
    finally:
        model.close()
    assert compare_schedule(synthetic(weight_type="Q8_0"), flash=False, cache_type="f16", sequences=2, steps=260,
                            threads=1) < 1e-4
