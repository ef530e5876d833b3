"""KV cache: a port of Ollama's kvcache/causal_test.go (f63eea3d) on real ggml tensors, plus shift,
padding, graph reuse, the Wrapper and the attention helper.

Every Ollama case runs with and without permuted V; like the Go harness it puts the same tensor as key
and value and checks the key history, its shape and the mask (x = -inf), and here the value too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.fs import GGUFFile
from ollama_engine.kvcache import (
    Batch,
    CacheConfig,
    CacheFullError,
    Causal,
    ShiftError,
    Wrapper,
    attention,
    cache_dtype,
)
from ollama_engine.ml import Backend, DType, ShapeError

PERMUTED = pytest.mark.parametrize("permuted_v", [False, True], ids=["plain-v", "permuted-v"])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return write_synthetic(tmp_path_factory.mktemp("kvcache") / "tiny-llama.gguf", "llama")


@pytest.fixture(scope="module")
def backend(model_path):
    with Backend(GGUFFile.open(model_path)) as b:
        yield b


@pytest.fixture(scope="module")
def fa_backend(model_path):
    with Backend(GGUFFile.open(model_path), flash_attention=True) as b:
        yield b


def add_shift(ctx, layer, key, delta):
    """The Go test's shift function: add the position delta to every element of the key."""
    return key.add(delta.cast(DType.F32).reshape(1, 1, delta.shape[0]))


def identity_shift(ctx, layer, key, delta):
    return key


def new_cache(backend: Backend, cache: Causal, permuted_v: bool, max_sequences: int = 1, max_batch: int = 16,
              capacity: int = 16, padding: int = 1) -> Causal:
    cache.set_config(CacheConfig(permuted_v=permuted_v, padding=padding))
    cache.init(backend, DType.F16, max_sequences, capacity, max_batch)
    return cache


def mask_rows(*rows: str) -> np.ndarray:
    """'0 x x' rows, one per batch token, as the float mask (x = -inf)."""
    return np.array([[-np.inf if c == "x" else 0.0 for c in row.split()] for row in rows], dtype=np.float32)


@dataclass
class Seen:
    """What one sequence of a batch reads back: its key history, the history's shape, its mask."""

    out: list[float]
    out_shape: tuple[int, ...]
    mask: np.ndarray
    value_out: list[float] | None = None  # values are never shifted: differs from `out` after a shift


@dataclass
class Step:
    values: list[float]
    shape: tuple[int, ...]  # ggml order: (head_dim, kv_heads, batch)
    sequences: list[int]
    positions: list[int]
    seen: list[Seen]  # one per sequence of the batch, in batch order


def forward_all(backend: Backend, cache: Causal, values, shape, sequences, positions):
    """One forward pass as the Go harness does it: store the batch, read back each sequence's key,
    value and mask."""
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=positions, sequences=sequences))
        cache.set_layer(0)
        tensor = ctx.input().from_numpy(np.asarray(values, dtype=np.float32).reshape(shape[::-1]))
        cache.put(ctx, tensor, tensor)
        segments = [(s.key.contiguous(), s.value.contiguous(), s.mask) for s in cache.get(ctx)]
        ctx.compute(*(t for segment in segments for t in segment))
        results = []
        for key, packed_value, mask in segments:
            # a segment of several sequences' decode steps (stacked) holds each one's history along dimension 3:
            # read back per sequence, as separate segments would be
            keys, values = key.numpy().reshape(key.ne[::-1]), packed_value.numpy().reshape(packed_value.ne[::-1])
            masks = mask.numpy().reshape(mask.ne[1], -1)
            stacked = key.ne[3] > 1
            for row in range(key.ne[3]):
                value_data = values[row]
                if cache.config.permuted_v:  # (kv_heads, head_dim, history) -> (history, kv_heads, head_dim)
                    value_data = value_data.transpose(2, 0, 1)
                results.append((keys[row], key.shape[:3], value_data, masks[row : row + 1] if stacked else masks))
        return results


def forward(backend: Backend, cache: Causal, values, shape, sequences, positions):
    """forward_all for a batch of one sequence: (key, key shape, value, mask)."""
    (result,) = forward_all(backend, cache, values, shape, sequences, positions)
    return result


def run(backend: Backend, cache: Causal, *steps: Step) -> None:
    for step in steps:
        results = forward_all(backend, cache, step.values, step.shape, step.sequences, step.positions)
        assert len(results) == len(step.seen)
        for (key, shape, value, mask), seen in zip(results, step.seen, strict=True):
            assert shape == seen.out_shape
            np.testing.assert_array_equal(key.reshape(-1), np.asarray(seen.out, dtype=np.float16))
            value_out = seen.out if seen.value_out is None else seen.value_out
            np.testing.assert_array_equal(value.reshape(-1), np.asarray(value_out, dtype=np.float16))
            np.testing.assert_array_equal(mask, seen.mask)


def seen(out: list[float], *mask: str) -> Seen:
    """What a sequence of single-number tokens (shape (1, 1, n)) reads back."""
    return Seen(out, (1, 1, len(out)), mask_rows(*mask))


def vector(values: list[float], sequences: list[int], positions: list[int], out: list[float],
           *mask: str) -> Step:
    """A step of one sequence whose tokens are single numbers (shape (1, 1, n)), as in all but TestStore."""
    return Step(values, (1, 1, len(values)), sequences, positions, [seen(out, *mask)])


def vectors(values: list[float], sequences: list[int], positions: list[int], *seen: Seen) -> Step:
    """A step of several sequences of single-number tokens; `seen` per sequence, in batch order."""
    return Step(values, (1, 1, len(values)), sequences, positions, list(seen))


# ---------------------------------------------------------------- causal_test.go


@PERMUTED
def test_store(backend, permuted_v):
    cache = new_cache(backend, Causal(), permuted_v)
    first = [100 * (d + 1) + 10 * (h + 1) + t + 1 for t in range(4) for h in range(3) for d in range(2)]
    second = [100 * (d + 1) + 10 * (h + 1) + 5 for h in range(3) for d in range(2)]
    assert first[:6] == [111, 211, 121, 221, 131, 231]
    run(
        backend, cache,
        Step(first, (2, 3, 4), [0] * 4, [0, 1, 2, 3],
             [Seen(first, (2, 3, 4), mask_rows("0 x x x", "0 0 x x", "0 0 0 x", "0 0 0 0"))]),
        Step(second, (2, 3, 1), [0], [4], [Seen(first + second, (2, 3, 5), mask_rows("0 0 0 0 0"))]),
    )


@PERMUTED
def test_swa(backend, permuted_v):
    """A sliding-window cache is a ring of memory + batch cells (llama.cpp's n_swa + n_ubatch): position p
    lands in cell p mod 4, over cells whose positions the next token no longer sees."""
    cache = new_cache(backend, Causal(window_size=1), permuted_v, max_batch=2)
    assert cache.cells == 4  # the window and the token (2) plus a batch (2)
    run(
        backend, cache,
        vector([1, 2], [0, 0], [0, 1], [1, 2], "0 x", "0 0"),
        vector([3, 4], [0, 0], [2, 3], [2, 3, 4], "0 0 x", "x 0 0"),
        vector([5, 6], [0, 0], [4, 5], [5, 6, 3, 4], "0 x x 0", "0 0 x x"),
        vector([7], [0], [6], [6, 7], "0 0"),
    )


def test_swa_without_a_ring_keeps_every_position(backend):
    """Memory and a batch as large as the capacity: no ring, nothing overwritten."""
    cache = new_cache(backend, Causal(window_size=1), False)
    assert cache.cells == 16
    run(backend, cache,
        vector([1, 2, 3, 4], [0] * 4, [0, 1, 2, 3], [1, 2, 3, 4], "0 x x x", "0 0 x x", "x 0 0 x", "x x 0 0"),
        vector([5, 6], [0, 0], [4, 5], [4, 5, 6], "0 0 x", "x 0 0"))
    assert cache.can_resume(0, 1)


@PERMUTED
def test_swa_separate_batches(backend, permuted_v):
    cache = new_cache(backend, Causal(window_size=1), permuted_v, max_sequences=2, max_batch=2)
    assert cache.cells == 8  # per sequence: memory 2 (window + 1 with several sequences) plus a batch of 2
    run(
        backend, cache,
        vector([1, 2], [0, 0], [0, 1], [1, 2], "0 x", "0 0"),
        vector([3, 4], [0, 0], [2, 3], [2, 3, 4], "0 0 x", "x 0 0"),
        vector([5, 6], [1, 1], [0, 1], [5, 6], "0 x", "0 0"),
        # Ollama's unified cells would show sequence 0's cells here, masked; each sequence has its own
        vector([7, 8], [1, 1], [2, 3], [6, 7, 8], "0 0 x", "x 0 0"),
        vector([9, 10], [0, 0], [4, 5], [9, 10, 3, 4], "0 x x 0", "0 0 x x"),
    )


@PERMUTED
def test_swa_mem(backend, permuted_v):
    """A memory beyond the window keeps older positions until their cells are needed."""
    cache = new_cache(backend, Causal(window_size=1, memory_size=3), permuted_v, max_batch=2)
    assert cache.cells == 5
    run(
        backend, cache,
        vector([1, 2], [0, 0], [0, 1], [1, 2], "0 x", "0 0"),
        vector([3, 4], [0, 0], [2, 3], [2, 3, 4], "0 0 x", "x 0 0"),
        vector([5, 6], [0, 0], [4, 5], [6, 2, 3, 4, 5], "x x x 0 0", "0 x x x 0"),
    )
    assert cache.can_resume(0, 2) and not cache.can_resume(0, 1)  # position 0 was overwritten


def test_ring_head_after_a_cache_hit_and_after_a_shift(backend):
    """Dropping the tail puts the head after the last position kept (the sequence goes on in the cells a
    cold run uses); a shift puts it at cell 0, as llama.cpp's seq_add (here also the freed cell)."""
    cache = new_cache(backend, Causal(add_shift, window_size=1), False, max_batch=2)
    for p in range(7):
        store(backend, cache, [p])  # positions 4, 5, 6 in cells 0, 1, 2; 3 in cell 3
    cache.remove(0, 5)
    key, _, _, _ = forward(backend, cache, [50.0], (1, 1, 1), [0], [5])
    assert key.reshape(-1).tolist() == [4.0, 50.0]  # cells 0 and 1: position 5 back in cell 5 mod 4
    cache.remove(0, 4, 5)  # drop position 4 (cell 0), position 5 moves down to 4 (its key shifted by -1)
    key, _, _, _ = forward(backend, cache, [60.0], (1, 1, 1), [0], [5])
    assert key.reshape(-1).tolist() == [60.0, 49.0]  # the new position 5 in the freed cell 0, not in cell 2


def test_a_shift_reuses_the_rings_first_cells_before_the_freed_ones(backend):
    """After a shift the search for cells starts at cell 0, as llama.cpp's seq_add leaves its head: a cell
    there that slid out of the window is taken before the cells the shift freed. The same cells in the same
    order as llama.cpp keep the attention's sums bitwise (gemma4 differed by 2e-3 in one step otherwise)."""
    cache = new_cache(backend, Causal(add_shift, window_size=1), False, max_batch=4)
    assert cache.region == 6
    forward(backend, cache, [0.0, 1.0, 2.0, 3.0, 4.0], (1, 1, 5), [0] * 5, [0, 1, 2, 3, 4])  # cells 0-4
    cache.remove(0, 2, 3)  # position 2 (cell 2) dropped; 3 and 4 move down to 2 and 3 (their keys minus 1)
    key, _, _, mask = forward(backend, cache, [40.0], (1, 1, 1), [0], [4])
    # position 4 in cell 0 (position 0 is out of its window), not in the freed cell 2; it sees cells 0 and 4
    assert key.reshape(-1).tolist() == [40.0, 1.0, 2.0, 2.0, 3.0]
    np.testing.assert_array_equal(mask, mask_rows("0 x x x 0"))


def test_a_ring_reuses_a_cell_as_soon_as_the_window_no_longer_reaches_it(backend):
    """llama.cpp's find_slot takes a cell once the next position minus the cell's is n_swa (window + 1): a
    position the next token cannot see. After a shift that can be the cell at the head (one step of a tiny
    gemma4 differed by 6.6e-3 when the ring kept that position one token longer)."""
    cache = new_cache(backend, Causal(add_shift, window_size=1), False, max_batch=4)
    forward(backend, cache, [0.0, 1.0, 2.0, 3.0], (1, 1, 4), [0] * 4, [0, 1, 2, 3])  # cells 0-3
    cache.remove(0, 1, 3)  # positions 1 and 2 dropped, 3 moves down to 1 (cell 3, its key 3 - 2)
    key, _, _, mask = forward(backend, cache, [20.0], (1, 1, 1), [0], [2])
    assert key.reshape(-1).tolist() == [20.0, 1.0, 2.0, 1.0]  # position 2 in cell 0 (position 0 is unseen)
    np.testing.assert_array_equal(mask, mask_rows("0 x x 0"))


@PERMUTED
def test_chunked_attention(backend, permuted_v):
    cache = new_cache(backend, Causal(chunk_size=2), permuted_v)
    run(
        backend, cache,
        vector([1, 2, 3, 4], [0] * 4, [0, 1, 2, 3], [1, 2, 3, 4], "0 x x x", "0 0 x x", "x x 0 x", "x x 0 0"),
        vector([5, 6, 7], [0] * 3, [4, 5, 6], [1, 2, 3, 4, 5, 6, 7],
               "x x x x 0 x x", "x x x x 0 0 x", "x x x x x x 0"),
        vector([8, 9], [0, 0], [7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9],
               "x x x x x x 0 0 x", "x x x x x x x x 0"),
    )


# Ollama's table sees one history of interleaved cells; here each sequence sees its own region.
SEQUENCES_FIRST = vectors([1, 2, 3, 4], [0, 0, 1, 1], [0, 1, 0, 1],
                          seen([1, 2], "0 x", "0 0"), seen([3, 4], "0 x", "0 0"))


@PERMUTED
def test_sequences(backend, permuted_v):
    cache = new_cache(backend, Causal(), permuted_v, max_sequences=2)
    run(
        backend, cache, SEQUENCES_FIRST,
        vectors([5, 6], [0, 1], [2, 2], seen([1, 2, 5], "0 0 0"), seen([3, 4, 6], "0 0 0")),
    )


@PERMUTED
def test_remove(backend, permuted_v):
    cache = new_cache(backend, Causal(add_shift), permuted_v, max_sequences=2)
    run(backend, cache, SEQUENCES_FIRST)
    cache.remove(0, 1)
    run(backend, cache, vectors([5, 6], [0, 1], [1, 2], seen([1, 5], "0 0"), seen([3, 4, 6], "0 0 0")))
    cache.remove(0, 0, 1)  # position 1 (key 5) moves to 0 and is shifted by -1
    middle = vector([7, 8], [0, 0], [1, 2], [7, 4, 8], "0 0 x", "0 0 0")
    middle.seen[0].value_out = [7, 5, 8]
    run(backend, cache, middle)


@PERMUTED
def test_copy(backend, permuted_v):
    cache = new_cache(backend, Causal(identity_shift), permuted_v, max_sequences=2)
    run(backend, cache, vector([1, 2, 3, 4], [0] * 4, [0, 1, 2, 3], [1, 2, 3, 4],
                               "0 x x x", "0 0 x x", "0 0 0 x", "0 0 0 0"))
    cache.copy_prefix(0, 1, 2)  # sequence 1 gets copies of keys 1 and 2 in the same cells of its region
    run(backend, cache, vector([5, 6], [1, 1], [3, 4], [1, 2, 5, 6], "0 0 0 x", "0 0 0 0"))
    run(backend, cache, vector([7], [0], [4], [1, 2, 3, 4, 7], "0 0 0 0 0"))  # sequence 0 keeps its own


def store(backend: Backend, cache: Causal, positions: list[int], seq: int = 0) -> None:
    forward(backend, cache, [float(p) for p in positions], (1, 1, len(positions)), [seq] * len(positions),
            positions)


@PERMUTED
def test_can_resume(backend, permuted_v):
    cache = new_cache(backend, Causal(window_size=4), permuted_v, max_batch=1)
    assert cache.cells == 6
    store(backend, cache, [0, 1, 2, 3, 4])
    store(backend, cache, [5])
    assert all(cache.can_resume(0, p) for p in range(7))
    store(backend, cache, [6])  # overwrites position 0
    assert not any(cache.can_resume(0, p) for p in range(5))
    assert all(cache.can_resume(0, p) for p in (5, 6, 7))


@PERMUTED
def test_can_resume_swa_mem(backend, permuted_v):
    cache = new_cache(backend, Causal(window_size=4, memory_size=5), permuted_v, max_batch=1)
    for p in range(8):
        store(backend, cache, [p])
    assert not any(cache.can_resume(0, p) for p in range(6))
    assert cache.can_resume(0, 6) and cache.can_resume(0, 7)


# ---------------------------------------------------------------- beyond the Go table


def test_can_resume_unlimited_and_unknown(backend):
    assert new_cache(backend, Causal(), False).can_resume(3, 100)
    swa = new_cache(backend, Causal(window_size=4), False)
    assert not swa.can_resume(0, 0)  # nothing stored for the sequence


def test_init_validation(backend):
    with pytest.raises(ValueError, match=r"sliding window memory \(2\) must be at least as large as the window \(3\)"):
        Causal(window_size=3, memory_size=2)
    with pytest.raises(ValueError, match="needs flash attention"):
        Causal().init(backend, DType.Q8_0, 1, 16, 16)  # the CPU backend without FA wants permuted V
    with pytest.raises(ValueError, match="unsupported kv cache type"):
        Causal().init(backend, DType.Q4_K, 1, 16, 16)
    cache = new_cache(backend, Causal(), False)
    with pytest.raises(RuntimeError, match="cannot be changed"):
        cache.set_config(CacheConfig())
    with backend.new_context() as ctx, pytest.raises(RuntimeError, match="start_forward"):
        cache.get(ctx)


def test_cache_dtype_names():
    assert cache_dtype("") == DType.F16
    assert [cache_dtype(n) for n in ("f16", "Q8_0", "q4_0", "f32")] == [DType.F16, DType.Q8_0, DType.Q4_0, DType.F32]
    with pytest.raises(ValueError, match="unsupported kv cache type 'q5_1'"):
        cache_dtype("q5_1")


def test_batch_validation():
    batch = Batch(positions=[0, 1], sequences=[0, 0], outputs=[1], tokens=[5, 6])
    assert len(batch) == 2 and batch.positions.dtype == np.int32 and batch.outputs.tolist() == [1]
    with pytest.raises(ValueError, match="2 positions but 1 sequences"):
        Batch(positions=[0, 1], sequences=[0])
    with pytest.raises(ValueError, match="outputs"):
        Batch(positions=[0], sequences=[0], outputs=[1])
    with pytest.raises(ValueError, match="tokens"):
        Batch(positions=[0], sequences=[0], tokens=[1, 2])


def test_backend_config_and_memory_accounting(backend):
    cache = Causal()
    cache.init(backend, DType.F16, 2, 100, 8)
    assert cache.config == CacheConfig(padding=256, permuted_v=True)
    assert cache.cells == 512  # 2 sequences of 100 cells, each rounded up to the padding
    before = backend.memory.cpu.cache[1]
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[0], sequences=[0]))
        cache.set_layer(1)
        kv = ctx.input().from_numpy(np.ones((1, 2, 8), dtype=np.float32))  # (8, 2, 1): head_dim 8, 2 heads
        cache.put(ctx, kv, kv)
    # key and value of layer 1, each 8 * 2 * 512 F16 values, are charged to layer 1's KV cache
    assert backend.memory.cpu.cache[1] - before >= 2 * 8 * 2 * 512 * 2


def test_cache_full(backend):
    cache = new_cache(backend, Causal(), False, capacity=4, max_batch=4)
    store(backend, cache, [0, 1, 2])
    with pytest.raises(CacheFullError, match=r"could not find a kv cache slot \(cache: 4 batch: 2\)"):
        store(backend, cache, [3, 4])


def test_reserve_leaves_bookkeeping(backend):
    cache = new_cache(backend, Causal(), False)
    store(backend, cache, [0, 1])
    layout = cache.prepare(Batch(positions=list(range(16)), sequences=[0] * 16), reserve=True)
    assert layout == ((16, 0, cache.cells, False, 0),)  # the whole region is the worst-case history
    key, *_ = forward(backend, cache, [5.0], (1, 1, 1), [0], [2])
    np.testing.assert_array_equal(key.reshape(-1), [0, 1, 5])  # the reserve batch stored nothing


def test_remove_errors(backend):
    cache = new_cache(backend, Causal(add_shift), False, max_sequences=2)
    store(backend, cache, [0, 1, 2, 3])
    cache.copy_prefix(0, 1, 4)  # a copy: nothing is shared, so sequence 0 can still shift
    cache.remove(0, 1, 2)
    key, *_ = forward(backend, cache, [9.0], (1, 1, 1), [0], [3])
    np.testing.assert_array_equal(key.reshape(-1), [0, 9, 1, 2])  # keys 2, 3 moved to positions 1, 2
    key, *_ = forward(backend, cache, [8.0], (1, 1, 1), [1], [4])
    np.testing.assert_array_equal(key.reshape(-1), [0, 1, 2, 3, 8])  # sequence 1's copy did not move
    with pytest.raises(ValueError, match="sequence 2 outside the cache's 2 sequences"):
        store(backend, cache, [0], seq=2)

    no_shift = new_cache(backend, Causal(), False)
    store(backend, no_shift, [0, 1, 2])
    with pytest.raises(ShiftError, match="model does not support operation"):
        no_shift.remove(0, 0, 1)
    no_shift.remove(0, 1, 5)  # nothing after the end moves: no shift needed
    key, _, _, mask = forward(backend, no_shift, [7.0], (1, 1, 1), [0], [1])
    np.testing.assert_array_equal(key.reshape(-1), [0, 7])  # cell 1 reused; cell 2 is no longer seq 0's
    np.testing.assert_array_equal(mask, mask_rows("0 0"))


def test_shift_in_chunks_across_layers(backend):
    """Keys of every layer are shifted, max_batch cells per graph; values are left alone."""
    cache = new_cache(backend, Causal(add_shift), False, max_batch=2)
    values = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=range(7), sequences=[0] * 7))
        for layer in range(2):
            cache.set_layer(layer)
            kv = ctx.input().from_numpy(np.asarray(values, dtype=np.float32).reshape(7, 1, 1) * (layer + 1))
            cache.put(ctx, kv, kv)
        ctx.compute()
    cache.remove(0, 1, 3)  # positions 3..6 (cells 3..6) move down by 2
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[5], sequences=[0]))
        outputs = []
        for layer in range(2):
            cache.set_layer(layer)
            kv = ctx.input().from_numpy(np.full((1, 1, 1), 1.0, dtype=np.float32))
            cache.put(ctx, kv, kv)
            (segment,) = cache.get(ctx)
            key, value, mask = segment.key, segment.value, segment.mask
            outputs += [key, value]
        ctx.compute(*outputs, mask)
        for layer in range(2):
            scale = layer + 1
            # cell 1 holds the new token, cell 2 is free (stale, masked), cells 3..6 moved down by 2
            expected_keys = [10 * scale, 1, 30 * scale] + [v * scale - 2 for v in values[3:]]
            np.testing.assert_array_equal(outputs[2 * layer].numpy().reshape(-1), expected_keys)
            np.testing.assert_array_equal(outputs[2 * layer + 1].numpy().reshape(-1),
                                          [10 * scale, 1, 30 * scale] + [v * scale for v in values[3:]])
        np.testing.assert_array_equal(mask.numpy().reshape(1, -1), mask_rows("0 0 x 0 0 0 0"))


def test_rope_shift_matches_new_positions(backend):
    """With a RoPE shift function, shifted keys equal keys rotated at their new positions."""
    head_dim, heads, n = 8, 2, 6

    def rope(key, positions):
        return key.rope(positions, head_dim, 10000.0)

    cache = new_cache(backend, Causal(lambda ctx, layer, key, delta: rope(key, delta)), False)
    cache.set_layer(0)
    raw = np.random.default_rng(0).standard_normal((n, heads, head_dim)).astype(np.float32)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=range(n), sequences=[0] * n))
        key = rope(ctx.input().from_numpy(raw), ctx.input().from_ints(range(n), n))
        cache.put(ctx, key, key)
        ctx.compute()
    cache.remove(0, 1, 3)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[4], sequences=[0]))
        kept = raw[[0, 3, 4, 5]]
        expected = rope(ctx.input().from_numpy(kept), ctx.input().from_ints([0, 1, 2, 3], 4)).contiguous()
        zero = ctx.input().from_numpy(np.zeros((1, heads, head_dim), dtype=np.float32))
        cache.put(ctx, zero, zero)
        stored = cache.get(ctx)[0].key
        ctx.compute(stored, expected)
        np.testing.assert_allclose(stored.numpy()[[0, 3, 4, 5]], expected.numpy(), atol=2e-3)


def test_set_causal_exceptions(backend):
    cache = new_cache(backend, Causal(), False)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[0, 1, 2], sequences=[0, 0, 0]))
        cache.set_causal(ctx, [1])  # e.g. an image token that sees the whole batch
        cache.set_layer(0)
        kv = ctx.input().from_numpy(np.zeros((3, 1, 1), dtype=np.float32))
        cache.put(ctx, kv, kv)
        mask = cache.get(ctx)[0].mask
        ctx.compute(mask)
        np.testing.assert_array_equal(mask.numpy(), mask_rows("0 x x", "0 0 0", "0 0 0"))
        cache.set_causal(ctx, [])  # no exceptions: causal again, in the same graph
        ctx.compute(mask)
        np.testing.assert_array_equal(mask.numpy(), mask_rows("0 x x", "0 0 x", "0 0 0"))
    _, _, _, mask = forward(backend, cache, [9.0], (1, 1, 1), [0], [3])  # a new batch is causal again
    np.testing.assert_array_equal(mask, mask_rows("0 0 0 0"))


def test_padding_and_graph_reuse(backend):
    """A padded history keeps the layout across decode steps, so one built graph serves them all."""
    cache = Causal()
    cache.set_config(CacheConfig(padding=256))
    cache.init(backend, DType.F16, 1, 300, 4)
    assert cache.cells == 512
    store(backend, cache, [0, 1, 2])
    ctx = backend.new_context()
    try:
        layout = cache.prepare(Batch(positions=[3], sequences=[0]))
        assert layout == ((1, 0, 256, False, 0),)
        cache.bind(ctx)
        cache.set_layer(0)
        token = np.full((1, 1, 1), 30.0, dtype=np.float32)
        kv = ctx.input().from_numpy(token)
        cache.put(ctx, kv, kv)
        (segment,) = cache.get(ctx)
        key, mask = segment.key, segment.mask
        ctx.compute(key, mask)
        np.testing.assert_array_equal(key.numpy().reshape(-1)[:5], [0, 1, 2, 30, 0])
        assert key.shape == (1, 1, 256) and mask.ne[:2] == (256, 1)

        # next step: same layout, so only the inputs change and the same graph is computed again
        assert cache.prepare(Batch(positions=[4], sequences=[0])) == layout
        cache.bind(ctx)
        token[...] = 40.0
        ctx.compute(key, mask)
        np.testing.assert_array_equal(key.numpy().reshape(-1)[:6], [0, 1, 2, 30, 40, 0])
        np.testing.assert_array_equal(mask.numpy().reshape(-1)[:6], [0, 0, 0, 0, 0, -np.inf])
    finally:
        ctx.close()


def test_wrapper(backend):
    swa, full = Causal(window_size=1), Causal()
    wrapper = Wrapper(swa, full)
    wrapper.set_config(CacheConfig())
    wrapper.init(backend, DType.F16, 1, 16, 16)
    with backend.new_context() as ctx:
        wrapper.start_forward(ctx, Batch(positions=[0, 1, 2], sequences=[0, 0, 0]))
        outputs = []
        for layer_type in (0, 1):
            wrapper.set_layer(0)
            wrapper.set_layer_type(layer_type)
            assert wrapper.underlying() is (swa, full)[layer_type]
            kv = ctx.input().from_numpy(np.asarray([1.0, 2.0, 3.0], dtype=np.float32).reshape(3, 1, 1))
            wrapper.put(ctx, kv, kv)
            outputs.append(wrapper.get(ctx)[0].mask)
        ctx.compute(*outputs)
        np.testing.assert_array_equal(outputs[0].numpy(), mask_rows("0 x x", "0 0 x", "x 0 0"))
        np.testing.assert_array_equal(outputs[1].numpy(), mask_rows("0 x x", "0 0 x", "0 0 0"))
    assert full.can_resume(0, 5) and not swa.can_resume(0, 5)
    assert wrapper.can_resume(0, 3) and not wrapper.can_resume(0, 5)  # every cache must agree


def test_wrapper_unwinds_on_failure(backend):
    small, large = Causal(), Causal()
    wrapper = Wrapper(large, small)
    large.set_config(CacheConfig())
    small.set_config(CacheConfig())
    large.init(backend, DType.F16, 1, 16, 4)
    small.init(backend, DType.F16, 1, 2, 4)
    with pytest.raises(CacheFullError):
        wrapper.prepare(Batch(positions=[0, 1, 2], sequences=[0, 0, 0]))
    assert large.prepare(Batch(positions=[0], sequences=[0])) == ((1, 0, 1, False, 0),)  # the first cache emptied again


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA attention in numpy; arrays are (tokens, heads, head_dim)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    scores += np.triu(np.full(scores.shape[1:], -np.inf), 1)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize(
    ("flash", "dtype", "max_error", "mean_error"),
    [(False, DType.F16, 3e-3, 5e-4), (True, DType.F16, 3e-3, 5e-4), (True, DType.Q8_0, 3e-2, 1e-2),
     (True, DType.Q4_0, 0.4, 0.1), (False, DType.F32, 1e-5, 1e-6)],
)
def test_attention_against_numpy(backend, fa_backend, flash, dtype, max_error, mean_error):
    """A prompt then two more tokens through attention() over the cache, against numpy; the bounds are
    the rounding of the cache type (4-bit keys and values are coarse)."""
    engine = fa_backend if flash else backend
    head_dim, heads, kv_heads, scale = 32, 4, 2, 32**-0.5
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((7, h, head_dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
    cache = Causal()
    cache.init(engine, dtype, 1, 64, 8)
    assert cache.config.permuted_v is not flash
    got = []
    for batch in (range(0, 5), range(5, 7)):  # a prompt, then two more tokens
        with engine.new_context() as ctx:
            cache.start_forward(ctx, Batch(positions=batch, sequences=[0] * len(batch)))
            cache.set_layer(0)
            tensors = [ctx.input().from_numpy(a[batch.start : batch.stop]) for a in (q, k, v)]
            out = attention(ctx, *tensors, scale, cache)
            ctx.compute(out)
            assert out.shape == (head_dim, heads, len(batch))
            got.append(out.numpy())
    error = np.abs(np.concatenate(got) - reference_attention(q, k, v, scale))
    assert error.max() < max_error and error.mean() < mean_error


@pytest.mark.parametrize("flash", [False, True])
def test_attention_without_cache(backend, fa_backend, flash):
    engine = fa_backend if flash else backend
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 2, 16)).astype(np.float32) for _ in range(3))
    with engine.new_context() as ctx:
        out = attention(ctx, *(ctx.input().from_numpy(a) for a in (q, k, v)), 0.25)
        ctx.compute(out)
        group = np.einsum("qhd,khd->hqk", q, k) * 0.25
        weights = np.exp(group - group.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        np.testing.assert_allclose(out.numpy(), np.einsum("hqk,khd->qhd", weights, v), atol=2e-3)


# ---------------------------------------------------------------- per-sequence regions, rotations, checks


def test_arguments_are_checked(backend):
    with pytest.raises(ValueError, match="window_size must be at least 1"):
        Causal(window_size=0)
    Causal(window_size=2, memory_size=2)  # memory equal to the window is enough
    with pytest.raises(ValueError, match="cache sizes must be positive"):
        Causal().init(backend, DType.F16, 1, 0, 4)
    cache = new_cache(backend, Causal(add_shift), False, max_sequences=2)
    store(backend, cache, [0, 1, 2])
    for begin, end in ((-1, None), (3, 2)):
        with pytest.raises(ValueError, match="cannot remove positions"):
            cache.remove(0, begin, end)
    cache.remove(0, 2, 2)  # an empty range removes nothing
    cache.remove(2, 0)  # a sequence the cache does not have: nothing to do
    key, *_ = forward(backend, cache, [9.0], (1, 1, 1), [0], [3])
    np.testing.assert_array_equal(key.reshape(-1), [0, 1, 2, 9])
    with pytest.raises(ValueError, match="hold each sequence's tokens together"):
        cache.prepare(Batch(positions=[4, 0, 5], sequences=[0, 1, 0]))


def test_put_checks_shapes_and_binding(backend):
    cache = new_cache(backend, Causal(), False)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[0, 1], sequences=[0, 0]))
        cache.set_layer(0)
        two = ctx.input().from_numpy(np.zeros((2, 1, 4), dtype=np.float32))
        with pytest.raises(ShapeError, match="for a batch of 2"):
            cache.put(ctx, two, ctx.input().from_numpy(np.zeros((3, 1, 4), dtype=np.float32)))
        cache.put(ctx, two, two)
        with pytest.raises(ShapeError, match="differ from layer 0"):
            cache.put(ctx, two, ctx.input().from_numpy(np.zeros((2, 2, 2), dtype=np.float32)))
    cache.prepare(Batch(positions=[2], sequences=[0]))
    with backend.new_context() as other, pytest.raises(RuntimeError, match="not bound"):
        cache.get(other)


def test_sequences_with_several_heads_read_their_own_region(backend):
    """Sequence 1's history starts a region in: the views must step over whole cells."""
    cache = new_cache(backend, Causal(), False, max_sequences=2)
    values = [float(100 * t + 10 * h + d) for t in range(4) for h in range(3) for d in range(2)]
    run(backend, cache, Step(values, (2, 3, 4), [0, 0, 1, 1], [0, 1, 0, 1], [
        Seen(values[:12], (2, 3, 2), mask_rows("0 x", "0 0")),
        Seen(values[12:], (2, 3, 2), mask_rows("0 x", "0 0")),
    ]))


def test_copy_prefix_within_a_sequence_truncates(backend):
    cache = new_cache(backend, Causal(), False, max_sequences=2)
    store(backend, cache, [0, 1, 2, 3])
    cache.copy_prefix(0, 0, 2)
    _, _, _, mask = forward(backend, cache, [5.0], (1, 1, 1), [0], [2])
    np.testing.assert_array_equal(mask, mask_rows("0 0 0"))  # cells 2, 3 are free again and cell 2 is reused


@pytest.fixture(scope="module")
def quantized_cache_backend(tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("kv-q") / "qwen2-64.gguf", "qwen2", n_embd=256, n_head=4,
                           n_head_kv=2)
    with Backend(GGUFFile.open(path), flash_attention=True) as b:
        yield b


def test_rotations_only_for_quantized_caches(backend, quantized_cache_backend):
    f16 = new_cache(backend, Causal(), False)
    q8 = Causal()
    q8.set_config(CacheConfig())
    q8.init(quantized_cache_backend, DType.Q8_0, 1, 16, 16)
    with quantized_cache_backend.new_context() as ctx:
        assert f16.rotations(ctx, 128, 128) == (None, None)
        sizes = {dims: tuple(t.ne[0] if t is not None else None for t in q8.rotations(ctx, *dims))
                 for dims in ((128, 128), (192, 64), (96, 80), (64, 32))}
        assert sizes == {(128, 128): (128, 64), (192, 64): (64, 64), (96, 80): (None, None), (64, 32): (64, None)}
        assert q8.rotations(ctx, 64, 64)[0] is q8.rotations(ctx, 64, 64)[0]  # one input per context


def test_shift_of_rotated_quantized_keys(quantized_cache_backend):
    """Quantized keys are stored rotated: a shift dequantizes, rotates back, applies RoPE, rotates again."""
    backend, head_dim, heads, n = quantized_cache_backend, 64, 2, 6

    def rope(key, positions):
        return key.rope(positions, head_dim, 10000.0)

    cache = Causal(lambda ctx, layer, key, delta: rope(key, delta))
    cache.set_config(CacheConfig())
    cache.init(backend, DType.Q8_0, 1, 16, 16)
    cache.set_layer(0)
    raw = np.random.default_rng(1).standard_normal((n, heads, head_dim)).astype(np.float32)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=range(n), sequences=[0] * n))
        rotation, _ = cache.rotations(ctx, head_dim, head_dim)
        key = rope(ctx.input().from_numpy(raw), ctx.input().from_ints(range(n), n)).hadamard(rotation)
        cache.put(ctx, key, key)
        ctx.compute()
    cache.remove(0, 1, 3)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[4], sequences=[0]))
        rotation, _ = cache.rotations(ctx, head_dim, head_dim)
        zero = ctx.input().from_numpy(np.zeros((1, heads, head_dim), dtype=np.float32))
        cache.put(ctx, zero, zero)
        stored = cache.get(ctx)[0].key.cast(DType.F32).hadamard(rotation)
        expected = rope(ctx.input().from_numpy(raw[[0, 3, 4, 5]]), ctx.input().from_ints([0, 1, 2, 3], 4)).contiguous()
        ctx.compute(stored, expected)
        np.testing.assert_allclose(stored.numpy()[[0, 3, 4, 5]], expected.numpy(), atol=0.05)


def test_lifecycle_bindings_and_edges(backend):
    cache = new_cache(backend, Causal(), False)
    store(backend, cache, [0, 1, 2])
    cache.remove(0, 1, 1)  # an empty range: nothing moves, so a model without shift is fine
    cache.close()
    cache.init(backend, DType.F16, 1, 16, 16)  # closed: it can be initialised again
    half = Causal()
    half.set_config(CacheConfig(mask_dtype=DType.F16))
    half.init(backend, DType.F16, 1, 16, 16)
    with backend.new_context() as ctx:
        half.start_forward(ctx, Batch(positions=[0], sequences=[0]))
        half.set_layer(0)
        kv = ctx.input().from_numpy(np.zeros((1, 1, 4), dtype=np.float32))
        half.put(ctx, kv, kv)
        assert half.get(ctx)[0].mask.dtype == DType.F16
        # a second batch of another layout in the same context gets inputs of its own size
        half.prepare(Batch(positions=[1, 2], sequences=[0, 0]))
        half.bind(ctx)
        half.put(ctx, ctx.input().from_numpy(np.zeros((2, 1, 4), dtype=np.float32)),
                 ctx.input().from_numpy(np.zeros((2, 1, 4), dtype=np.float32)))
        mask = half.get(ctx)[0].mask
        ctx.compute(mask)
        np.testing.assert_array_equal(mask.numpy().astype(np.float32), mask_rows("0 0 x", "0 0 0"))
        with pytest.raises(ShapeError, match="differ from layer 0"):
            wider = ctx.input().from_numpy(np.zeros((2, 1, 8), dtype=np.float32))
            half.put(ctx, wider, ctx.input().from_numpy(np.zeros((2, 1, 4), dtype=np.float32)))
    swa = new_cache(backend, Causal(window_size=2), False)
    store(backend, swa, [0, 1, 2, 3, 4])
    assert swa.can_resume(0, 5) and not swa.can_resume(0, 6)  # at most one past the last stored position


# ---------------------------------------------------------------- MLA: the value is the key's first features


def test_value_in_key_stores_keys_only_and_reads_values_from_them(backend):
    """Causal(value_in_key=2): no value tensor; each sequence's values are its keys' first 2 features, even
    when permuted V was asked for; copy_prefix copies them with the keys; a value of another width is refused."""
    cache = Causal(value_in_key=2)
    cache.set_config(CacheConfig(permuted_v=True))
    cache.init(backend, DType.F16, 2, 16, 16)
    assert not cache.config.permuted_v
    keys = np.arange(12, dtype=np.float32).reshape(4, 1, 3)  # numpy order: (tokens, heads, features)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=range(4), sequences=[0] * 4))
        cache.set_layer(0)
        key = ctx.input().from_numpy(keys)
        with pytest.raises(ShapeError, match="first 2 features"):
            cache.put(ctx, key, key)
        cache.put(ctx, key, key.view(0, (2, 1, 4)))
        (segment,) = cache.get(ctx)
        value = segment.value.contiguous()
        ctx.compute(segment.key, value)
        assert segment.value.shape == (2, 1, 4)
        np.testing.assert_array_equal(value.numpy()[:4], keys[:, :, :2])
    assert cache._values[0] is None and cache._keys[0].shape == (3, 1, 32)
    cache.copy_prefix(0, 1, 4)
    with backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[4], sequences=[1]))
        cache.set_layer(0)
        extra = ctx.input().from_numpy(np.full((1, 1, 3), 7, dtype=np.float32))
        cache.put(ctx, extra, extra.view(0, (2, 1, 1)))
        (segment,) = cache.get(ctx)
        value = segment.value.contiguous()
        ctx.compute(value)
        np.testing.assert_array_equal(value.numpy()[:5].reshape(5, 2), np.concatenate([keys[:, 0, :2], [[7, 7]]]))
    cache.close()


def test_value_in_key_quantized_needs_flash_attention(backend, fa_backend):
    """A quantized MLA cache is read through flash attention only (V as a view of K cannot be transposed)."""
    with pytest.raises(ValueError, match="needs flash attention"):
        Causal(value_in_key=32).init(backend, DType.Q8_0, 1, 16, 16)
    cache = Causal(value_in_key=32)
    cache.init(fa_backend, DType.Q8_0, 1, 16, 16)
    with fa_backend.new_context() as ctx:
        cache.start_forward(ctx, Batch(positions=[0], sequences=[0]))
        assert cache.rotations(ctx, 64, 32) == (None, None)  # llama.cpp rotates no MLA cache
    cache.close()


def test_decode_steps_of_several_sequences_stack_into_one_segment(backend, fa_backend):
    """One row of each of several sequences whose histories lie alike in their regions (the same length, at a
    regular distance) is one segment apart, each row's history a region further on; a row whose history differs,
    or is 512 cells or longer under flash attention, keeps its own segment. Values and masks per sequence:
    test_sequences and its neighbours."""
    cache = new_cache(backend, Causal(), False, max_sequences=4, padding=16)  # a history is a whole region
    region = cache.region
    for seq, length in ((0, 2), (1, 3), (2, 1), (3, 9)):
        store(backend, cache, list(range(length)), seq)
    assert cache.prepare(Batch(positions=[2, 3, 1], sequences=[0, 1, 2])) == ((3, 0, region, True, region),)
    # sequences 0 and 2: two regions apart; 3's history is longer (another length): a segment of its own
    layout = cache.prepare(Batch(positions=[3, 2, 9], sequences=[0, 2, 3]))
    assert layout[0] == (2, 0, region, True, 2 * region) and layout[1][0] == 1 and not layout[1][3]
    # a prompt's rows are not stacked
    assert len(cache.prepare(Batch(positions=[4, 5, 4], sequences=[0, 0, 1]))) == 2

    # with flash attention, histories under 512 cells stack; ggml's CPU kernel splits a longer lone row's history
    # between its threads, a stacked row's not, so those keep their segments
    lone = ((1, 0, 512, False, 0), (1, 1024, 512, False, 0))
    for padding, expected in ((16, ((2, 0, 16, True, 1024),)), (512, lone)):
        flash = new_cache(fa_backend, Causal(), False, max_sequences=2, capacity=1024, padding=padding)
        for seq in (0, 1):
            store(fa_backend, flash, [0, 1], seq)
        assert flash.prepare(Batch(positions=[2, 2], sequences=[0, 1])) == expected
