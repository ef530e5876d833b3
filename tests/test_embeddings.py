"""Embeddings: the bert model against llama.cpp's embeddings, and the runner's /embedding route.

llama.cpp (llama-cpp-python 0.3.36) pools with the pooling type it is given and L2-normalises with
`normalize=True`; our model reads the pooling type from the file (`bert.pooling_type`, rewritten in
place per case) and normalises by default, as Ollama does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from runner_client import runner_client
from synthetic.models import write_synthetic

from ollama_engine.models import load_model
from ollama_engine.models.bert import Pooling
from ollama_engine.runner.embed import embed
from ollama_engine.runner.sequence import InputTooLongError
from ollama_engine.server.app import RunnerServer

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Embeddings: café, naïve, 3.14159!"]
CONTEXT = 512
THREADS = 1
# largest |ours - llama.cpp| over a unit vector's elements; measured on one thread: at most 3e-8 for F32 and F16
# (the same ggml operations; only the mean pooling's summation order differs)
TOLERANCE = {"F32": 1e-6, "F16": 1e-6}


@pytest.fixture(scope="module")
def bert(synthetic_model):
    """bert(weight_type, pooling) -> a synthetic BERT pooling that way."""
    return lambda weight_type, pooling: synthetic_model("bert", weight_type, pooling_type=int(pooling))


def open_model(path: Path, flash: bool = False):
    model = load_model(path, num_threads=THREADS, flash_attention=flash)
    model.backend.load()
    return model


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
@pytest.mark.parametrize("pooling", [Pooling.MEAN, Pooling.CLS, Pooling.LAST])
@pytest.mark.parametrize("flash", [False, True], ids=["matmul", "flash"])
def test_embeddings_match_llama_cpp(bert, weight_type, pooling, flash):
    """With flash attention (serve's default), the encoder's F32 keys and values go to F16 as llama.cpp's."""
    import llama_cpp

    path = bert(weight_type, pooling)
    model = open_model(path, flash)
    reference = llama_cpp.Llama(
        model_path=str(path), embedding=True, pooling_type=int(pooling), n_ctx=CONTEXT, n_batch=CONTEXT,
        n_ubatch=CONTEXT, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, flash_attn=flash,
    )
    try:
        for prompt in PROMPTS:
            ours = embed(model, prompt, CONTEXT)
            theirs = np.array(reference.embed(prompt, normalize=True), dtype=np.float32)
            assert ours.prompt_eval_count == len(reference.tokenize(prompt.encode()))
            assert ours.vector.shape == (model.options.hidden,)
            assert np.linalg.norm(ours.vector) == pytest.approx(1.0, abs=1e-5)
            diff = np.abs(ours.vector - theirs).max()
            assert diff <= TOLERANCE[weight_type], f"{prompt!r}: largest difference {diff}"
    finally:
        reference.close()
        model.close()


def test_pooling_types_pick_different_vectors(bert):
    vectors = {}
    for pooling in (Pooling.MEAN, Pooling.CLS, Pooling.LAST):
        model = open_model(bert("F32", pooling))
        try:
            vectors[pooling] = embed(model, PROMPTS[0], CONTEXT).vector
        finally:
            model.close()
    assert not np.allclose(vectors[Pooling.MEAN], vectors[Pooling.CLS])
    assert not np.allclose(vectors[Pooling.CLS], vectors[Pooling.LAST])


def test_too_long_input_is_rejected(bert):
    model = open_model(bert("F32", Pooling.CLS))
    try:
        with pytest.raises(InputTooLongError):
            embed(model, "word " * 20, 8)
    finally:
        model.close()


# ---------------------------------------------------------------- the runner over HTTP

LOAD = {
    "Parallel": 1, "BatchSize": 64, "FlashAttention": 0, "KvSize": CONTEXT, "KvCacheType": "", "NumThreads": THREADS,
    "GPULayers": None, "MultiUserCache": False, "UseMmap": False,
}


def serve(path: Path, requests: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    """Load the model through /load fit, alloc and commit, then POST each (route, body) in turn."""

    async def run():
        server = RunnerServer(str(path))
        try:
            async with runner_client(server) as client:
                for operation in (0, 1, 2):
                    response = await client.post("/load", data=json.dumps({**LOAD, "Operation": operation}))
                    assert response.status == 200, await response.text()
                answers = []
                for route, body in requests:
                    response = await client.post(route, data=body)
                    answers.append((response.status, await response.read()))
                return answers
        finally:
            if server.runner is not None:
                server.runner.close()
            if server.loaded is not None:
                server.loaded.close()

    return asyncio.run(run())


def test_runner_embedding_equals_in_process(bert):
    path = bert("F32", Pooling.MEAN)
    model = open_model(path)
    try:
        expected = [embed(model, prompt, CONTEXT) for prompt in PROMPTS]
    finally:
        model.close()
    answers = serve(path, [("/embedding", json.dumps({"content": p}).encode()) for p in PROMPTS] + [
        ("/embedding", b"{oops"),
        ("/embedding", json.dumps({"content": "word " * CONTEXT}).encode()),
    ])
    for (status, body), want in zip(answers, expected, strict=False):
        assert status == 200, body
        got = json.loads(body)
        assert got["prompt_eval_count"] == want.prompt_eval_count
        # float32 values written with their shortest digits read back exactly
        np.testing.assert_array_equal(np.array(got["embedding"], dtype=np.float32), want.vector)
    status, body = answers[len(PROMPTS)]
    assert status == 400 and body.startswith(b"bad request: ")
    assert answers[len(PROMPTS) + 1] == (400, b"the input length exceeds the context length\n")


def test_runner_embedding_on_a_generative_model_is_501(tmp_path):
    path = write_synthetic(tmp_path / "llama.gguf", "llama")
    assert serve(path, [("/embedding", b'{"content": "Hello"}')]) == [
        (501, b"this model does not support embeddings\n")
    ]
