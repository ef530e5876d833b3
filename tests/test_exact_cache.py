"""runner/exact.py: where a prompt resumes so that every row is computed with a cold run's kernels.

The property is checked against a simulation of the batches: a cold run cuts the prompt at multiples of
batch_size from 0; a hit keeps the cached inputs before the resume point and cuts the rest at the same
multiples. Every position must get the kernel class a cold run gives it. (That rows of one class are
computed alike is what tests/test_cache_hits.py shows on real weights.)
"""

from __future__ import annotations

import random

import pytest

from ollama_engine.runner.exact import UNKNOWN, extension_resumes, resume_point, row_kernels
from ollama_engine.runner.prompt_cache import InputCache, InputCacheSlot


def evaluated(begin: int, end: int, batch_size: int) -> bytes:
    """The classes of positions [begin, end) evaluated alone, in batches cut at multiples of batch_size."""
    out = bytearray()
    start = begin
    while start < end:
        stop = min((start // batch_size + 1) * batch_size, end)
        out += row_kernels(range(stop - start), stop - start, stop - start)
        start = stop
    return bytes(out)


def decoded(count: int) -> bytes:
    return b"".join(row_kernels([0], 1, 1) for _ in range(count))


def test_row_classes():
    assert row_kernels(range(11), 11, 11) == bytes([2] * 8 + [4] * 3)  # the last 11 % 4 rows: one-row matmul
    assert row_kernels(range(5), 5, 5) == bytes([1] * 4 + [3])  # under 8 rows: other K-quant kernels
    assert row_kernels([0], 1, 1) == bytes([7])  # a single row: other F16 kernels too
    assert row_kernels(range(64), 64, 64) == bytes([10] * 64)  # tiled flash attention from 64 rows
    assert row_kernels([3, 4], 100, 2) == bytes([2, 2])  # company: the batch decides the matmul, not the sequence


@pytest.mark.parametrize("batch_size", [512, 64, 100, 30])
def test_a_resumed_prompt_gets_the_cold_classes(batch_size: int):
    rng = random.Random(batch_size)
    for _ in range(2000):
        first = rng.randint(1, 1200)
        generated = rng.choice([0, 0, rng.randint(1, 300)])
        kernels = evaluated(0, first, batch_size) + decoded(generated)
        length = rng.randint(1, 1600)
        common = min(rng.choice([length, rng.randint(0, length)]), len(kernels), length)
        if common == length:
            common -= 1  # the runner evaluates the last input again
        resume = resume_point(kernels, common, length, batch_size)
        assert 0 <= resume <= common and resume % 4 == 0 or resume == 0
        cold = evaluated(0, length, batch_size)
        assert kernels[:resume] == cold[:resume], (first, generated, length, common, resume)
        assert evaluated(resume, length, batch_size) == cold[resume:], (first, generated, length, common, resume)


def test_what_is_reused():
    warm = evaluated(0, 43, 512)
    assert resume_point(warm, 42, 43, 512) == 32  # the same prompt: its last 11 inputs again
    assert resume_point(warm, 43, 84, 512) == 0  # 84 rows attend with the tiled kernel, 43 did not
    answer = evaluated(0, 100, 512) + decoded(20)
    assert resume_point(answer, 120, 140, 512) == 76  # 64 rows again, so that they attend tiled as cold
    assert resume_point(answer, 120, 300, 512) == 100  # the answer (decoded) is evaluated again as prompt
    assert resume_point(bytes([UNKNOWN]) + answer[1:], 120, 300, 512) == 0


def test_the_input_cache_records_and_trims_the_classes():
    cache = InputCache(None, 4096, 2, 512, multi_user=False, remove_errors=RuntimeError, exact=True)
    slot: InputCacheSlot = cache.slots[0]
    cache.record_rows(slot, 0, list(range(20)), 20)
    assert bytes(slot.kernels) == evaluated(0, 20, 512)
    cache.record_rows(slot, 25, [0], 1)  # a gap is unknown, a decoded row its own class
    assert bytes(slot.kernels[20:]) == bytes(5) + decoded(1)
    cache.record_rows(slot, 10, [0], 1)  # positions from 10 on were replaced
    assert len(slot.kernels) == 11
    assert cache.chunk_limit(0) == 512 and cache.chunk_limit(500) == 12 and cache.chunk_limit(512) == 512


def hybrid_resume(kernels: bytes, common: int, length: int, batch_size: int, checkpoints: set[int]) -> int:
    """Where InputCache resumes a cache that continues only at `checkpoints` (prompt_cache._resumable)."""
    resume = resume_point(kernels, common, length, batch_size)
    while resume > 0 and resume not in checkpoints:
        earlier = resume_point(kernels, max((c for c in checkpoints if c <= resume), default=0), length, batch_size)
        resume = 0 if earlier >= resume else earlier
    return resume


@pytest.mark.parametrize("batch_size", [512, 256, 100])
def test_a_hybrid_resumes_a_longer_prompt_at_a_checkpoint_extension_resumes_names(batch_size: int):
    """A prompt's last batch (its rows beside other sequences' rows) keeps recurrent checkpoints where
    extension_resumes says: a later prompt extending it (by 0 to 300 inputs: a regenerated turn, short and long
    turns) resumes where a dense cache would, when that is inside the prompt's last batch and the later prompt
    adds 64 inputs or more or goes past that batch's end; at most 64 inputs before it otherwise."""
    rng = random.Random(batch_size)
    for _ in range(3000):
        first = rng.choice([0, rng.randrange(0, 600, 4)])
        length = first + rng.randint(2, batch_size - first % batch_size)
        row = rng.choice([0, 0, rng.randint(0, 40)])
        rows = row + length - first + rng.choice([0, 0, rng.randint(0, 40)])
        kernels = bytearray(evaluated(0, first, batch_size))
        kernels += row_kernels(range(row, row + length - first), rows, length - first)
        kernels += decoded(rng.randint(0, 40))
        added = rng.choice([0, rng.randint(1, 63), rng.randint(64, 300)])
        later = length + added
        common = min(len(kernels), later - 1)
        dense = resume_point(kernels, common, later, batch_size)
        checkpoints = set(extension_resumes(length, batch_size, first, row, rows)) | {length, first}
        resumed = hybrid_resume(bytes(kernels), common, later, batch_size, checkpoints)
        case = (first, length, row, rows, later, dense, resumed)
        assert resumed <= dense, case
        if dense > first and (added >= 64 or later > (first // batch_size + 1) * batch_size):
            assert resumed == dense, case
        elif dense > first:
            assert dense - resumed <= 64, case
