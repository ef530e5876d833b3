"""Nomic BERT (nomic-embed-text v1.5 and v2, nomic-bert-moe) embeddings against llama.cpp's, on tiny
synthetic models; v2 also through the runner's memory fit and its /embedding route."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from memory_checks import fitted_then_allocated
from synthetic.models import write_synthetic
from test_embeddings import LOAD, serve

from ollama_engine.models import ModelError, load_model
from ollama_engine.models.bert import Pooling
from ollama_engine.runner.allocate import LoadParams
from ollama_engine.runner.embed import embed

PROMPTS = ["search_query: What is the capital of France?", "Hello", "Embeddings: café, naïve, 3.14159!"]
CONTEXT = 512
THREADS = 1
# largest |ours - llama.cpp| over a unit vector's elements (the same ggml operations); measured: see below
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def nomic(synthetic_model):
    """nomic(weight_type, pooling) -> a synthetic nomic-bert pooling that way."""
    return lambda weight_type, pooling: synthetic_model("nomic-bert", weight_type, pooling_type=int(pooling))


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "pooling"), [("F32", Pooling.MEAN), ("F16", Pooling.MEAN),
                                                      ("Q8_0", Pooling.MEAN), ("F32", Pooling.CLS)])
def test_embeddings_match_llama_cpp(nomic, weight_type, pooling):
    import llama_cpp

    path = nomic(weight_type, pooling)
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    reference = llama_cpp.Llama(
        model_path=str(path), embedding=True, pooling_type=int(pooling), n_ctx=CONTEXT, n_batch=CONTEXT,
        n_ubatch=CONTEXT, n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
    )
    try:
        for prompt in PROMPTS:
            ours = embed(model, prompt, CONTEXT)
            theirs = np.array(reference.embed(prompt, normalize=True), dtype=np.float32)
            assert ours.prompt_eval_count == len(reference.tokenize(prompt.encode()))
            assert ours.vector.shape == (model.options.hidden,)
            assert float(ours.vector @ theirs) > 1 - 1e-4  # cosine: both are unit vectors
            diff = np.abs(ours.vector - theirs).max()
            assert diff <= TOLERANCE, f"{prompt!r}: largest difference {diff}"
    finally:
        reference.close()
        model.close()


def test_positions_matter_through_rope(nomic):
    """No position table: word order reaches the embedding only through the rotary positions."""
    model = load_model(nomic("F32", Pooling.MEAN), num_threads=THREADS)
    model.backend.load()
    try:
        a = embed(model, "dog bites man", CONTEXT).vector
        b = embed(model, "man bites dog", CONTEXT).vector
    finally:
        model.close()
    assert not np.allclose(a, b, atol=1e-4)



# ---------------------------------------------------------------- v2: nomic-bert-moe

# v2's vocabulary is XLM-RoBERTa's (250k Unigram pieces): accents, CJK and emoji become real pieces
MOE_PROMPTS = [*PROMPTS, "Quelle est la capitale de la France ? 我想吃饭 😁", "word " * 100]
# llama.cpp's batch of all prompts against its own one-prompt batches differs by up to 2.8e-5 (F16: other
# matrix kernels for more rows); ours, always one prompt a batch, stays within 1e-7 of its one-prompt ones
BATCHED_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def nomic_moe(synthetic_model):
    """nomic_moe(weight_type, moe_every) -> a synthetic nomic-bert-moe with experts every moe_every layers."""
    return lambda weight_type="F32", moe_every=2: synthetic_model("nomic-bert-moe", weight_type, moe_every=moe_every)


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "moe_every"), [("F32", 2), ("F16", 2), ("Q8_0", 2), ("F32", 3)])
def test_moe_embeddings_match_llama_cpp(nomic_moe, weight_type, moe_every):
    """Each prompt alone, and all of them in one llama.cpp batch (one sequence each): the routing of a
    token does not depend on its neighbours. Measured, largest difference alone: 6e-8 (F32, Q8_0), 1e-7
    (F16); batched: 8e-7 (F32), 2.8e-5 (F16), 6e-8 (Q8_0)."""
    import llama_cpp

    path = nomic_moe(weight_type, moe_every)
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    assert model.mixtures == set(range(1, 4, moe_every))  # llama.cpp's rule: i % moe_every_n_layers == 1
    reference = llama_cpp.Llama(
        model_path=str(path), embedding=True, pooling_type=int(Pooling.MEAN), n_ctx=CONTEXT, n_batch=CONTEXT,
        n_ubatch=CONTEXT, n_threads=THREADS, n_threads_batch=THREADS, n_seq_max=len(MOE_PROMPTS), verbose=False,
    )
    try:
        ours = [embed(model, prompt, CONTEXT) for prompt in MOE_PROMPTS]
        alone = [reference.embed(prompt, normalize=True) for prompt in MOE_PROMPTS]
        batched = reference.embed(MOE_PROMPTS, normalize=True)
        for prompt, mine, one, many in zip(MOE_PROMPTS, ours, alone, batched, strict=True):
            assert mine.prompt_eval_count == len(reference.tokenize(prompt.encode()))
            for vector, tolerance in ((one, TOLERANCE), (many, BATCHED_TOLERANCE)):
                vector = np.array(vector, dtype=np.float32)
                assert float(mine.vector @ vector) > 1 - 1e-4
                diff = np.abs(mine.vector - vector).max()
                assert diff <= tolerance, f"{prompt!r}: largest difference {diff}"
    finally:
        reference.close()
        model.close()


def test_moe_fit_equals_alloc_and_embedding_allocates_nothing_more(nomic_moe):
    path = str(nomic_moe())
    params = LoadParams(batch_size=64, kv_size=64, num_threads=THREADS)
    with fitted_then_allocated(path, params) as loaded:
        for prompt in ("Hello", "word " * 60):  # one token, and the whole 64-token batch
            embed(loaded.model, prompt, 64)


def test_moe_served_by_the_runner(nomic_moe):
    """The runner's /embedding serves v2 end to end: the same floats as the model in this process."""
    path = nomic_moe()
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    try:
        expected = [embed(model, prompt, LOAD["KvSize"]) for prompt in MOE_PROMPTS[:4]]
    finally:
        model.close()
    answers = serve(path, [("/embedding", json.dumps({"content": p}).encode()) for p in MOE_PROMPTS[:4]])
    for (status, body), want in zip(answers, expected, strict=True):
        assert status == 200, body
        got = json.loads(body)
        assert got["prompt_eval_count"] == want.prompt_eval_count
        np.testing.assert_array_equal(np.array(got["embedding"], dtype=np.float32), want.vector)


def test_moe_preset_experts_are_as_wide_as_the_ffn(tmp_path):
    with pytest.raises(ValueError, match="n_ff_exp == n_ff"):
        write_synthetic(tmp_path / "bad.gguf", "nomic-bert-moe", n_ff_exp=64)


def test_moe_experts_not_matching_expert_count_are_refused(nomic_moe, tmp_path):
    """ggml aborts on an expert id beyond a stack: a file whose stacks hold fewer experts than expert_count
    says is refused at load."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_gguf

    model = fuzz_gguf.Model.read(nomic_moe())
    value_type, _, _ = model.metadata["nomic-bert-moe.expert_count"]
    model.metadata["nomic-bert-moe.expert_count"] = (value_type, None, 8)
    path = tmp_path / "eight.gguf"
    path.write_bytes(model.to_bytes())
    with pytest.raises(ModelError, match=r"blk.1.ffn_gate_inp.weight has shape \[64, 4\], expected \[64, 8\]"):
        load_model(path, allocate=False)
