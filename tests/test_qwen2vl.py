"""qwen2vl (Qwen2-VL and Qwen2.5-VL's text model): multimodal RoPE against llama.cpp, on text and on rows
given as embeddings with their own positions (an image's, laid out as llama.cpp's mtmd lays them out).

The tiny-qwen2vl preset: tiny-qwen2's shapes (2 layers, 4 heads of 16, 2 KV heads, biases on q, k, v) with
rope.dimension_sections 2, 3, 3, 0 over its 8 rotated pairs.

The pinned llama.cpp's qwen2vl loader reads no attention.layer_norm_rms_epsilon (its load_arch_hparams reads
only the sections; qwen2's reads the epsilon), so its RMS norms run with epsilon 0 on every file. We use the
file's (Qwen2.5-VL's 1e-6, as Hugging Face and Ollama do): the comparisons with llama.cpp run on files whose
epsilon is 0, where both agree; test_the_files_epsilon_is_used shows the difference is only that.
"""

from __future__ import annotations

import numpy as np
import pytest
from decoding import greedy
from llama_reference import compare_schedule
from recurrent_checks import prompt_logprob_gap

from ollama_engine.models import ModelError, load_model
from ollama_engine.models.qwen2vl import Qwen2VL

TOLERANCE = 1e-4  # on logprobs, as test_architectures


@pytest.fixture(scope="module")
def synthetic(synthetic_model):
    """synthetic(weight_type="F32", **options) -> the tiny-qwen2vl GGUF."""
    return lambda weight_type="F32", **options: synthetic_model("qwen2vl", weight_type, **options)


@pytest.fixture(scope="module")
def comparable(synthetic):
    """The tiny-qwen2vl GGUF with RMS epsilon 0, the one llama.cpp's qwen2vl uses whatever the file says."""
    return lambda weight_type="F32", **options: synthetic(weight_type, eps=0.0, **options)


def test_loads_with_its_sections(synthetic):
    model = load_model(synthetic(), allocate=False)
    try:
        assert isinstance(model, Qwen2VL) and model.sections == [2, 3, 3, 0]
        assert model.position_components == 4
    finally:
        model.close()


@pytest.mark.parametrize(("sections", "message"), [
    ((0, 0, 0, 0), "1 to 8 in all"), ((4, 4, 4, 0), "1 to 8 in all"), ((2, -1, 3, 0), "non-negative"),
    ((1, 1, 1, 1, 1), "up to 4"),
])
def test_bad_sections_are_refused_before_ggml(synthetic, sections, message):
    """ggml divides by the sections' sum: a file whose sum is 0 must fail at load, not fault in RoPE."""
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(rope_sections=sections), allocate=False)


@pytest.mark.reference
def test_prompt_logits_match(comparable):
    """Every row of a prompt, F32: text tokens rotated by p, p, p, 0 as llama.cpp rotates them."""
    assert prompt_logprob_gap(comparable()) < TOLERANCE


@pytest.mark.reference
def test_the_files_epsilon_is_used(synthetic):
    """On a file with epsilon 1e-6 we differ from llama.cpp (which uses 0), by little: the gap above is then
    the epsilon's alone."""
    assert 1e-5 < prompt_logprob_gap(synthetic()) < 0.05


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [
    ("F32", 1, False), ("F16", 1, True), ("Q8_0", 2, False), ("Q8_0", 2, True), ("Q4_0", 2, False)])
def test_greedy_decoding_matches(comparable, weight_type, sequences, flash):
    assert compare_schedule(comparable(weight_type), flash=flash, cache_type="f16", sequences=sequences,
                            steps=8, tolerance=TOLERANCE) < TOLERANCE


def test_ollamas_file_computes_what_llama_cpps_does(synthetic):
    """Ollama's qwen25vl file (its architecture name, 3 sections under rope.mrope_section): the same logits."""
    ollama = synthetic(layout="ollama")
    model = load_model(ollama, allocate=False)
    try:
        assert model.config.architecture() == "qwen25vl" and model.sections == [2, 3, 3, 0]
    finally:
        model.close()
    prompts = ("In a small village by the sea, there lived",)
    ours, theirs = greedy(ollama, prompts, [0], 6, False)[0], greedy(synthetic(), prompts, [0], 6, False)[0]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
