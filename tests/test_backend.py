"""The ml Backend: placement, memory accounting (fit reports what alloc really allocates), out-of-memory
reports, and loading weights from the file."""

from __future__ import annotations

import numpy as np
import pytest

from ollama_engine import ggml
from ollama_engine.fs import GGUFFile
from ollama_engine.ggml import backend as ggml_backend
from ollama_engine.ml import Backend, DeviceID, DType, GPULayers, NoMemory, TensorGroups

CACHE_CELLS = 256
GROUPS = TensorGroups(outputs=frozenset({"output", "output_norm"}), per_layer=frozenset({"rope_freqs"}),
                      tied=(("token_embd.weight", "output.weight"),))
"""What a Llama model declares (models.base.Model.tensor_groups has more): the Backend only applies it."""


@pytest.fixture(scope="module")
def stories(stories_path):
    return GGUFFile.open(stories_path)


def build_graph(backend: Backend, ctx, n_tokens: int):
    """A small graph over the real weights: embeddings, one projection per layer, the output layer."""
    ids = ctx.input().from_ints(np.arange(n_tokens) % 100, n_tokens)
    h = backend.get("token_embd.weight").rows(ids)
    for i in range(backend.block_count):
        h = backend.get(f"blk.{i}.attn_q.weight").matmul(h).rms_norm(backend.get(f"blk.{i}.attn_norm.weight"), 1e-5)
    return backend.get("output.weight").matmul(h)


def measure(model: GGUFFile, allocate: bool, **options) -> Backend:
    """What the runner does for one /load: weights, a KV cache per layer, worst-case graphs."""
    backend = Backend(model, allocate=allocate, num_threads=2, tensor_groups=GROUPS, **options)
    cache_ctx = backend.new_context()
    for layer in range(backend.block_count):
        cache_ctx.layer(layer).zeros(DType.F16, 32, 4, CACHE_CELLS)
        cache_ctx.layer(layer).zeros(DType.F16, 32, 4, CACHE_CELLS)
    for n_tokens in (64, 1):
        with backend.new_context() as ctx:
            ctx.reserve(build_graph(backend, ctx, n_tokens))
    backend.cache_context = cache_ctx  # keep the cache tensors alive with the backend
    return backend


def test_fit_reports_exactly_what_alloc_allocates(stories):
    fit = measure(stories, allocate=False)
    alloc = measure(stories, allocate=True)
    try:
        assert fit.memory.to_json() == alloc.memory.to_json()
        report = alloc.memory
        assert len(report.cpu.weights) == len(report.cpu.cache) == stories.config.get_uint("block_count") + 1
        assert report.input_weights >= stories.tensors["token_embd.weight"].n_bytes
        assert report.cpu.weights[-1] >= stories.tensors["output.weight"].n_bytes
        assert all(w > 0 for w in report.cpu.weights)
        assert all(c == 2 * 32 * 4 * CACHE_CELLS * 2 for c in report.cpu.cache[:-1]) and report.cpu.cache[-1] == 0
        assert report.cpu.graph > 0
        really = alloc.allocated()["CPU"]
        assert really == report.input_weights + report.cpu.size()
        assert fit.allocated()["CPU"] == 0  # fit allocated nothing
    finally:
        for backend in (fit, alloc):
            backend.cache_context.close()
            backend.close()


def test_graph_is_the_maximum_over_reserved_graphs(stories):
    sizes = []
    for n_tokens in (1, 64):
        with Backend(stories, tensor_groups=GROUPS, allocate=False) as backend, backend.new_context() as ctx:
            ctx.reserve(build_graph(backend, ctx, n_tokens))
            sizes.append(backend.memory.cpu.graph)
    with Backend(stories, tensor_groups=GROUPS, allocate=False) as backend:
        for n_tokens in (64, 1):
            with backend.new_context() as ctx:
                ctx.reserve(build_graph(backend, ctx, n_tokens))
        assert backend.memory.cpu.graph == max(sizes) > min(sizes)


def test_layers_for_unknown_gpus_stay_on_the_cpu(stories):
    layout = [GPULayers(DeviceID("GPU-does-not-exist", "CUDA"), [0, 1, 2, 3, 4, 5])]
    with Backend(stories, layout, allocate=False, tensor_groups=GROUPS) as backend:
        assert all(device.kind == "CPU" for device in backend.layer_devices)
        assert all(w > 0 for w in backend.memory.cpu.weights)


def test_placement_by_name(stories):
    with Backend(stories, allocate=False, tensor_groups=GROUPS) as backend:
        n = backend.block_count
        assert [(p.name, p.layer) for p in backend.placements("token_embd.weight")] == [("token_embd.weight", None)]
        assert [(p.name, p.layer) for p in backend.placements("output_norm.weight")] == [("output_norm.weight", n)]
        assert [(p.name, p.layer) for p in backend.placements("blk.3.ffn_up.weight")] == [("blk.3.ffn_up.weight", 3)]
        assert [p.name for p in backend.placements("rope_freqs.weight")] == [
            f"blk.{i}.rope_freqs.weight" for i in range(n)
        ]
        with pytest.raises(ValueError, match="layer 99"):
            backend.placements("blk.99.attn_q.weight")


def test_placement_without_groups_knows_no_names(stories):
    """The Backend knows no tensor names: without the model's groups every tensor of no layer is an input
    weight, nothing is copied per layer, and no output head is made from token_embd."""
    with Backend(stories, allocate=False) as backend:
        assert [(p.name, p.layer) for p in backend.placements("output_norm.weight")] == [("output_norm.weight", None)]
        assert [(p.name, p.layer) for p in backend.placements("rope_freqs.weight")] == [("rope_freqs.weight", None)]
        assert [(p.name, p.layer) for p in backend.placements("blk.3.ffn_up.weight")] == [("blk.3.ffn_up.weight", 3)]
    groups = GROUPS.extended(outputs=("token_embd",))
    with Backend(stories, allocate=False, tensor_groups=groups) as backend:
        assert [(p.name, p.layer) for p in backend.placements("token_embd.weight")] == [
            ("token_embd.weight", backend.block_count)]


def test_too_small_a_budget_reports_what_was_needed(stories):
    with pytest.raises(NoMemory) as failure:
        Backend(stories, tensor_groups=GROUPS, allocate=True, memory_limits={"CPU": 1000})
    report = failure.value.memory
    assert report.input_weights > 0 and all(w > 0 for w in report.cpu.weights)  # every weight was sized first
    assert report.cpu.cache == [0] * len(report.cpu.cache) and report.cpu.graph == 0
    assert "insufficient memory - required allocations" in str(failure.value)

    with Backend(stories, tensor_groups=GROUPS, allocate=False) as fit:
        weights_only = fit.memory.input_weights + sum(fit.memory.cpu.weights)
    limit = weights_only + 3 * 2 * 32 * 4 * CACHE_CELLS  # room for 3 cache tensors, not 4
    with (Backend(stories, tensor_groups=GROUPS, allocate=True, memory_limits={"CPU": limit}) as backend,
          backend.new_context() as ctx):
        with pytest.raises(NoMemory) as failure:
            for layer in range(backend.block_count):
                ctx.layer(layer).zeros(DType.F16, 32, 4, CACHE_CELLS)
        cache = failure.value.memory.cpu.cache
        assert cache[:4] == [2 * 32 * 4 * CACHE_CELLS] * 4  # the failed request is in the report
        assert cache[4:] == [0] * (len(cache) - 4)


def test_load_is_byte_exact_with_monotonic_progress(stories):
    seen: list[float] = []
    with Backend(stories, tensor_groups=GROUPS, allocate=True) as backend:
        backend.load(seen.append)
        raw = stories.path.read_bytes()
        for info in stories.tensors.values():
            stored = backend.get(info.name).numpy().tobytes()
            assert stored == raw[info.offset : info.offset + info.n_bytes], info.name
    assert seen == sorted(seen) and seen[-1] == 1.0 and seen[0] > 0


def test_fit_backend_cannot_load(stories):
    with (Backend(stories, tensor_groups=GROUPS, allocate=False) as backend,
          pytest.raises(RuntimeError, match="without memory allocation")):
        backend.load()


def test_time_ops_sums_seconds_per_kind_of_node_and_leaves_results_unchanged(stories):
    with Backend(stories, tensor_groups=GROUPS, allocate=True, num_threads=2) as backend:
        backend.load()

        def run() -> np.ndarray:
            with backend.new_context() as ctx:
                logits = build_graph(backend, ctx, 8)
                ctx.compute(logits)
                return logits.numpy()

        plain = run()
        with backend.time_ops() as times:
            timed = run()
        assert np.array_equal(timed, plain)
        weight = backend.get("blk.0.attn_q.weight")
        width = "x".join(str(d) for d in weight.shape)
        assert times[f"MUL_MAT {weight.dtype.name.lower()} {width}"] > 0
        assert {"GET_ROWS", "RMS_NORM"} <= set(times) and all(t >= 0 for t in times.values())
        before = dict(times)
        run()  # after the block nodes run as whole graphs again, untimed
        assert times == before


def test_a_failing_op_timer_is_logged_and_the_graph_still_computes(stories, caplog):
    with Backend(stories, tensor_groups=GROUPS, allocate=True, num_threads=2) as backend:
        backend.load()
        timed: list[str] = []

        def fails_once(node, seconds: float) -> None:
            timed.append(ggml.node_kind(node))
            if len(timed) == 1:
                raise KeyError("boom")

        backend.scheduler.set_eval_callback(ggml_backend.NodeTimer(fails_once))
        try:
            with backend.new_context() as ctx:
                ctx.compute(build_graph(backend, ctx, 4))
        finally:
            backend.scheduler.set_eval_callback(None)
        assert "node timer failed" in caplog.text
        assert timed[-1].startswith("MUL_MAT") and len(timed) > 2 * backend.block_count  # to the output layer
