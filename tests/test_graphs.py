"""Graph reuse (models.Graphs), weight repacking and zero-copy outputs: the speed levers must not change
a single logit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, DType
from ollama_engine.models import load_model
from ollama_engine.models.graphs import KEPT_GRAPHS

THREADS = 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("graphs") / "tiny.gguf", "llama", weight_type="F32")


def open_model(path: Path, sequences: int = 1, capacity: int = 512):
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, DType.F16, sequences, capacity, 64)
    return model


def decode(model, steps: int, start_token: int = 5) -> tuple[list[np.ndarray], int]:
    """Greedy decode from position 0, one token per step; the logits of every step and graphs built."""
    built, last = 0, None
    token, rows = start_token, []
    for position in range(steps):
        batch = Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token])
        graph = model.graphs.acquire(batch)
        built += graph is not last
        last = graph
        try:
            graph.bind(batch)
            logits = graph.run()[0].copy()
        finally:
            model.graphs.release(graph)
        rows.append(logits)
        token = int(np.argmax(logits))
    return rows, built


def test_reused_graphs_give_the_logits_of_fresh_ones(tiny):
    steps = 300  # crosses the cache's 256-cell padding: the history grows and a new graph is built
    reused = open_model(tiny)
    fresh = open_model(tiny)
    fresh.reuse_graphs = False
    try:
        ours, built = decode(reused, steps)
        expected, built_fresh = decode(fresh, steps)
    finally:
        reused.close()
        fresh.close()
    assert built_fresh == steps
    assert built == 2  # one graph for histories of 256 cells, one for 512
    for step, (a, b) in enumerate(zip(ours, expected, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


def test_a_reused_graph_keeps_its_compute_buffers(tiny):
    model = open_model(tiny)
    try:
        batch = Batch(positions=[0], sequences=[0], outputs=[0], tokens=[3])
        model.graphs.compute(batch)
        graph = model.graphs.acquire(Batch(positions=[1], sequences=[0], outputs=[0], tokens=[4]))
        allocated = model.backend.allocated_graph
        assert allocated is graph.ctx._build((graph.logits,))
        graph.bind(Batch(positions=[1], sequences=[0], outputs=[0], tokens=[4]))
        graph.run()
        assert model.backend.allocated_graph is allocated  # not reset and allocated again
        model.graphs.release(graph)
    finally:
        model.close()


def test_a_different_shape_builds_a_new_graph_and_keeps_the_old_one_for_its_shape(tiny):
    model = open_model(tiny)
    try:
        first_batch = Batch(positions=[0, 1, 2], sequences=[0] * 3, outputs=[2], tokens=[1, 2, 3])
        first = model.graphs.acquire(first_batch)
        first.bind(first_batch)
        # the next batch is formed while the first is still in flight (the runner's pipeline)
        second = model.graphs.acquire(Batch(positions=[3], sequences=[0], outputs=[0], tokens=[4]))
        assert second is not first
        first.run()
        model.graphs.release(first)
        second.bind(Batch(positions=[3], sequences=[0], outputs=[0], tokens=[4]))
        second.run()
        model.graphs.release(second)
        assert not first.ctx._closed and not second.ctx._closed  # both kept for later batches of their shapes
        model.cache.remove(0, 0)
        again = Batch(positions=[0, 1, 2], sequences=[0] * 3, outputs=[2], tokens=[1, 2, 3])
        assert model.graphs.acquire(again) is first  # a prompt of that shape again: no new build
        model.graphs.release(first)
    finally:
        model.close()
    assert first.ctx._closed and second.ctx._closed


def test_graphs_beyond_the_kept_ones_are_retired_least_recently_used_first_once_released(tiny):
    model = open_model(tiny)
    try:
        in_flight = model.graphs.acquire(Batch(positions=[0], sequences=[0], outputs=[0], tokens=[1]))
        graphs = []
        for rows in range(2, KEPT_GRAPHS + 3):  # prompts of other lengths: a graph each
            model.cache.remove(0, 0)
            graphs.append(model.graphs.acquire(Batch(positions=range(rows), sequences=[0] * rows, outputs=[rows - 1],
                                                     tokens=[1] * rows)))
            model.graphs.release(graphs[-1])
        assert not in_flight.ctx._closed  # retired, but still in use
        model.graphs.release(in_flight)
        assert in_flight.ctx._closed
        assert [graph.ctx._closed for graph in graphs] == [True] + [False] * KEPT_GRAPHS
    finally:
        model.close()


def test_a_kept_graph_computed_after_a_larger_one_grew_the_compute_buffers(tiny):
    """A decode graph, then another sequence's long prompt (its graph needs larger compute buffers: ggml frees and
    makes them anew), then the decode graph again: allocated afresh, not where the old buffers were (ggml keeps a
    tensor that has memory where it is: this crashed), and its logits those of a model that saw no prompt between."""
    busy, quiet = open_model(tiny, sequences=2), open_model(tiny, sequences=2)
    try:
        results = []
        for model in (busy, quiet):
            model.graphs.compute(Batch(positions=range(4), sequences=[0] * 4, outputs=[3], tokens=[5, 6, 7, 8]))
            decode = model.graphs.acquire(Batch(positions=[4], sequences=[0], outputs=[0], tokens=[9]))
            model.graphs.release(decode)
            model.graphs.compute(Batch(positions=[4], sequences=[0], outputs=[0], tokens=[9]))
            if model is busy:
                sizes = model.backend.scheduler.buffer_sizes()
                model.graphs.compute(Batch(positions=range(60), sequences=[1] * 60, outputs=range(60), tokens=[3] * 60))
                assert model.backend.scheduler.buffer_sizes() > sizes  # the buffers grew: made anew
            batch = Batch(positions=[5], sequences=[0], outputs=[0], tokens=[10])
            assert model.graphs.acquire(batch) is decode  # kept
            decode.bind(batch)
            results.append(decode.run())
            model.graphs.release(decode)
        np.testing.assert_array_equal(results[0], results[1])
    finally:
        busy.close()
        quiet.close()


def test_batches_of_several_sequences_reuse_a_graph_with_their_own_masks(tiny):
    """Two sequences decoding together, reusing one graph, match each decoding alone."""
    together = open_model(tiny, sequences=2)
    alone = open_model(tiny, sequences=1)
    try:
        prompts = ([7, 8, 9], [10, 11, 12])
        for seq, prompt in enumerate(prompts):
            together.graphs.compute(Batch(positions=range(3), sequences=[seq] * 3, outputs=[], tokens=prompt))
        tokens, joint = [9, 12], []
        for position in range(3, 8):
            logits = together.graphs.compute(
                Batch(positions=[position, position], sequences=[0, 1], outputs=[0, 1], tokens=tokens))
            joint.append(logits)
            tokens = [int(np.argmax(row)) for row in logits]
        for seq, prompt in enumerate(prompts):
            alone.cache.remove(0, 0)
            alone.graphs.compute(Batch(positions=range(3), sequences=[0] * 3, outputs=[], tokens=prompt))
            token = prompt[-1]
            for step, position in enumerate(range(3, 8)):
                logits = alone.graphs.compute(Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token]))
                # a batch of two rows may take another matmul kernel: rounding, not a wrong mask (~1e-4)
                np.testing.assert_allclose(logits[0], joint[step][seq], atol=1e-3)
                token = int(np.argmax(logits[0]))
    finally:
        together.close()
        alone.close()


def test_compute_returns_a_copy_to_keep_or_a_view_the_next_compute_overwrites(tiny):
    model = open_model(tiny)
    try:
        steps = [Batch(positions=[p], sequences=[0], outputs=[0], tokens=[5 + p]) for p in range(2)]
        kept = model.graphs.compute(steps[0])
        view = model.graphs.compute(steps[1], copy=False)
        assert not np.shares_memory(kept, view)
        first = view.copy()
        model.cache.remove(0, 1)  # recompute step 1 with another token: the view follows the graph's output
        model.graphs.compute(Batch(positions=[1], sequences=[0], outputs=[0], tokens=[9]), copy=False)
        assert not np.array_equal(view, first)
        assert np.isfinite(kept).all() and not np.array_equal(kept, first)
    finally:
        model.close()


def test_set_input_by_name_and_host_views():
    with Backend(None) as backend, backend.new_context() as ctx:
        values = ctx.input().from_numpy(np.arange(4, dtype=np.float32)).set_name("values")
        doubled = values.scale(2.0)
        ctx.compute(doubled)
        view = doubled.numpy(copy=False)
        np.testing.assert_array_equal(view, [0, 2, 4, 6])
        ctx.set_input("values", np.full(4, 5, dtype=np.float32))
        ctx.compute(doubled)
        np.testing.assert_array_equal(view, [10, 10, 10, 10])  # a view: the next compute shows through
        with pytest.raises(KeyError, match="no graph input named"):
            ctx.set_input("missing", np.zeros(4, dtype=np.float32))
        with pytest.raises(ValueError, match="bytes of data"):
            ctx.set_input("values", np.zeros(3, dtype=np.float32))


def test_computed_tensors_start_on_cache_lines():
    """ggml's CPU buffers align to 32 bytes; ours to 64, so no two threads' chunks share a cache line."""
    with Backend(None) as backend, backend.new_context() as ctx:
        odd = [ctx.input().from_numpy(np.arange(n, dtype=np.float32)) for n in (1, 3, 5, 7)]
        nodes = [x.scale(2.0) for x in odd]
        nodes += [a.add(a) for a in nodes]
        ctx.forward(*nodes)
        ctx.compute()
        addresses = [node.numpy(copy=False).ctypes.data for node in nodes]
        assert all(address % 64 == 0 for address in addresses), [address % 64 for address in addresses]
        np.testing.assert_array_equal(nodes[-1].numpy(), 4 * np.arange(7, dtype=np.float32))


def test_q4_0_weights_are_repacked_for_the_cpu_and_match_the_plain_layout(tmp_path):
    path = write_synthetic(tmp_path / "q4.gguf", "llama", weight_type="Q4_0", n_embd=256, n_ff=512, n_head=4,
                           n_head_kv=4)
    tokens = list(range(3, 40))
    batch = Batch(positions=range(len(tokens)), sequences=[0] * len(tokens), outputs=range(len(tokens)),
                  tokens=tokens)
    results = {}
    for repack in (True, False):
        model = load_model(path, num_threads=THREADS, repack_weights=repack)
        try:
            repacked = model.backend.repacked_weights()
            model.backend.load()
            model.cache.init(model.backend, DType.F16, 1, 256, 64)
            results[repack] = (repacked, model.graphs.compute(batch))
        finally:
            model.close()
    repacked, logits = results[True]
    assert "blk.0.attn_q.weight" in repacked and "output.weight" in repacked
    assert "token_embd.weight" not in repacked  # read by rows, not multiplied
    assert results[False][0] == set()
    # different kernels round differently (llama.cpp's repacked rows move the same way)
    np.testing.assert_allclose(logits, results[False][1], atol=0.1)
    assert (np.argmax(logits, axis=1) == np.argmax(results[False][1], axis=1)).mean() > 0.9


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields (VmFlags, AnonHugePages, ...) of the mapping that holds `address`."""
    inside, fields = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                break
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    if not inside:
        raise LookupError(f"no mapping holds {address:#x}")
    return fields


@pytest.mark.parametrize("mode", ["collapse", "fault"])
def test_cpu_weight_buffers_repacked_ones_included_end_up_on_huge_pages(tmp_path, monkeypatch, mode):
    """By default (collapse) weights are loaded on 4 KiB pages, the fast way, and moved onto 2 MiB pages
    in the background afterwards; "fault" advises them before loading, as before."""
    from ollama_engine.ggml import backend as ggml_backend

    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("no transparent huge pages on this machine")
    monkeypatch.setenv("OLLAMA_ENGINE_HUGE_PAGES", mode)
    path = write_synthetic(tmp_path / "q4.gguf", "llama", weight_type="Q4_0", n_embd=1024, n_ff=4096, n_head=8,
                           n_head_kv=8)
    model = load_model(path, num_threads=THREADS)
    try:
        assert model.backend.repacked_weights()
        buffers = [buffer for _, buffer in model.backend._buffers]
        assert all(ggml_backend.in_host_memory(b) for b in buffers)  # the repacked ones too
        large = [b for b in buffers if ggml_backend.buffer_size(b) >= 4 * ggml_backend.HUGE_PAGE]
        assert len(large) == 2  # the repacked matrices, and the rest (token embeddings, norms)
        inner = [-(-ggml_backend.buffer_base(b) // ggml_backend.HUGE_PAGE) * ggml_backend.HUGE_PAGE for b in large]
        if mode == "fault":
            assert all("hg" in mapping_fields(address)["VmFlags"].split() for address in inner)
        model.backend.load()
        if mode == "collapse":
            model.backend._collapser.join()
        for address in inner:
            fields = mapping_fields(address)
            assert "hg" in fields["VmFlags"].split()
            if not (mode == "collapse" and platform_lacks_collapse()):
                assert int(fields["AnonHugePages"].split()[0]) >= 2048
    finally:
        model.close()


def platform_lacks_collapse() -> bool:
    """MADV_COLLAPSE came with Linux 6.1."""
    import platform

    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) < (6, 1)


def test_weights_move_onto_huge_pages_only_while_no_graph_computes(tmp_path, monkeypatch):
    """The move runs beside requests: it waits until no graph has been computed for a while, and close()
    stops it even while it waits."""
    import time

    from ollama_engine.ggml import backend as ggml_backend

    monkeypatch.setenv("OLLAMA_ENGINE_HUGE_PAGES", "collapse")
    moved: list[int] = []
    monkeypatch.setattr(ggml_backend, "collapse_huge_pages", lambda address, size: moved.append(address) or True)
    path = write_synthetic(tmp_path / "q4.gguf", "llama", weight_type="Q4_0", n_embd=1024, n_ff=4096, n_head=8,
                           n_head_kv=8)
    model = load_model(path, num_threads=THREADS)
    try:
        model.backend.last_compute = time.monotonic() + 3600  # as if a graph had just been computed, for an hour
        model.backend.load()
        time.sleep(0.3)
        assert moved == []
        model.backend.last_compute = 0.0
        deadline = time.monotonic() + 10
        while not moved and time.monotonic() < deadline:
            time.sleep(0.01)
        assert moved
        model.backend.last_compute = time.monotonic() + 3600
    finally:
        started = time.monotonic()
        model.close()
        assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0"])
def test_a_tied_output_weight_shares_the_embeddings_unless_repacked(tmp_path, weight_type):
    """As llama.cpp: one tensor for both (SmolLM2's peak RSS 357 -> 328 MiB); a repacked output (Q4_0)
    is a copy in the CPU's faster layout, and the memory report counts what is allocated either way."""
    path = write_synthetic(tmp_path / "tied.gguf", "llama", weight_type=weight_type, tied_embeddings=True,
                           rope_freqs=False)
    model = load_model(path, num_threads=THREADS)
    try:
        weights = model.backend.weights
        repacked = "output.weight" in model.backend.repacked_weights()
        assert (weights["output.weight"] is weights["token_embd.weight"]) == (not repacked)
        assert model.backend.allocated()["CPU"] == model.backend.memory.cpu.size() + model.backend.memory.input_weights
    finally:
        model.close()
