"""Nomic BERT (nomic-embed-text) embeddings against llama.cpp's, on tiny synthetic models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ollama_engine.fs.synthetic import write_synthetic
from ollama_engine.models import load_model
from ollama_engine.models.bert import Pooling
from ollama_engine.runner.embed import embed

PROMPTS = ["search_query: What is the capital of France?", "Hello", "Embeddings: café, naïve, 3.14159!"]
CONTEXT = 512
THREADS = 1
# largest |ours - llama.cpp| over a unit vector's elements (the same ggml operations); measured: see below
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def nomic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("nomic")
    written: dict[tuple[str, Pooling], Path] = {}

    def write(weight_type: str, pooling: Pooling) -> Path:
        if (weight_type, pooling) not in written:
            target = folder / f"nomic-{weight_type}-{pooling.name.lower()}.gguf"
            written[weight_type, pooling] = write_synthetic(
                target, "nomic-bert", weight_type=weight_type, pooling_type=int(pooling))
        return written[weight_type, pooling]

    return write


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

