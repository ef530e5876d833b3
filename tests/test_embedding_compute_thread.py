"""The runner's /embedding and /rerank compute on the batch loop's compute thread, which keeps its OpenMP pool.

Before, each request's forward pass ran on an asyncio worker thread, which does not compute in place
(ml/compute_threads.py), so ggml ran it on a thread started for it and ended after it: a thread start and a
new OpenMP pool per request, the pool gone again after. Now the thread that computes the completion batches
runs it (the compute thread, or the batch builder where the runner computes inline): one pool, kept between
requests, and never a second one beside it.

Asserted through the OS threads that Python did not start (the pool's workers), as tests/test_compute_threads.py
does: with a runner serving a 2-thread encoder, one pool of THREADS - 1 workers stays after the requests, and
more requests do not add another. Linux only (/proc).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from runner_client import runner_client
from synthetic.models import write_synthetic
from test_compute_threads import THREADS, LongLived, steady

from ollama_engine.ml import compute_here
from ollama_engine.models import Model, load_model
from ollama_engine.runner.embed import Embedding, embed, rerank
from ollama_engine.server.app import RunnerServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")

CONTEXT = 64
LOAD = {
    "Parallel": 1, "BatchSize": CONTEXT, "FlashAttention": 0, "KvSize": CONTEXT, "KvCacheType": "",
    "NumThreads": THREADS, "GPULayers": None, "MultiUserCache": False, "UseMmap": False,
}
TEXTS = ["hello world", "the quick brown fox", "a b c d e f g"]


def serve_and_count(path: Path, route: str, bodies: list[dict]) -> tuple[list[tuple[int, dict]], list[int], set[str]]:
    """Load the model in an in-process runner, POST the bodies to `route` one after another; the answers, the
    native thread count (steady) before loading and after the first and the last request, and the names of the
    Python threads that computed them, each as "inline:NAME" where the runner's builder computes its batches."""
    computed_on: set[str] = set()

    async def run():
        server = RunnerServer(str(path))
        counts = [steady()]
        try:
            async with runner_client(server) as client:
                for operation in (0, 1, 2):
                    response = await client.post("/load", data=json.dumps({**LOAD, "Operation": operation}))
                    assert response.status == 200, await response.text()
                await server.ready.wait()
                model = server.loaded.model
                forward = model.forward

                def recording(*args, **kwargs):
                    computed_on.add(("inline:" if server.runner.inline else "") + threading.current_thread().name)
                    return forward(*args, **kwargs)

                model.forward = recording
                answers = []
                for i, body in enumerate(bodies):
                    response = await client.post(route, data=json.dumps(body))
                    answers.append((response.status, await response.json()))
                    if i == 0 or i == len(bodies) - 1:
                        counts.append(steady())
                return answers, counts
        finally:
            if server.runner is not None:
                server.runner.close()
            if server.loaded is not None:
                server.loaded.close()

    answers, counts = asyncio.run(run())
    return answers, counts, computed_on


def reference(path: Path, compute: Callable[[Model], Embedding]) -> tuple[np.ndarray, bool]:
    """`compute` in a model of its own, on a long-lived thread that computes in place; and whether ggml left an
    OpenMP pool doing so (counted while that thread lives: this process's main thread may hold a pool already)."""
    model = load_model(path, num_threads=THREADS)
    worker = LongLived("reference")
    try:
        model.backend.load()
        before = steady()
        vector = worker.run(lambda: (compute_here(), compute(model).vector)[1])
        return vector, steady() > before
    finally:
        worker.close()
        model.close()


def on_the_batch_thread(names: set[str]) -> bool:
    """Every compute on one thread, the one that computes the runner's batches: its compute thread, or its batch
    builder where that computes them itself (Runner.inline: ggml's threads fill the CPUs)."""
    return len(names) == 1 and next(iter(names)) in ("inline:batch-builder", "compute_0")


def check_pools(counts: list[int], openmp: bool) -> None:
    before, after_first, after_last = counts
    if not openmp:
        pytest.skip("ggml's CPU backend left no worker threads: not built with OpenMP")
    assert after_first == before + THREADS - 1, "the compute thread's pool did not stay after the request"
    assert after_last == after_first, "later requests added a pool"


def test_embeddings_keep_one_pool_on_the_compute_thread(tmp_path):
    path = write_synthetic(tmp_path / "bert.gguf", "tiny-bert")
    expected, openmp = zip(*(reference(path, lambda model, t=t: embed(model, t, CONTEXT)) for t in TEXTS),
                           strict=True)
    bodies = [{"content": text} for text in TEXTS * 3]
    answers, counts, computed_on = serve_and_count(path, "/embedding", bodies)
    for (status, body), want in zip(answers, list(expected) * 3, strict=True):
        assert status == 200
        np.testing.assert_array_equal(np.array(body["embedding"], dtype=np.float32), want)
    assert on_the_batch_thread(computed_on), computed_on
    check_pools(counts, all(openmp))
    assert steady() <= counts[0], "the runner's pool outlived it"


def test_rerank_computes_on_the_compute_thread_too(tmp_path):
    path = write_synthetic(tmp_path / "reranker.gguf", "tiny-bert-reranker")
    query = "what is a fox"
    expected, openmp = reference(path, lambda model: rerank(model, query, TEXTS[0], CONTEXT))
    answers, counts, computed_on = serve_and_count(path, "/rerank", [{"query": query, "document": TEXTS[0]}] * 3)
    for status, body in answers:
        assert status == 200
        np.testing.assert_array_equal(np.array(body["embedding"], dtype=np.float32), expected)
    assert on_the_batch_thread(computed_on), computed_on
    check_pools(counts, openmp)
