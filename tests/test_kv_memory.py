"""KV cache memory at long contexts equals llama.cpp's own report (its default, swa_full off).

Sliding-window and chunked layers keep a ring of n_swa + batch cells (padded to 256), not the whole
context: at num_ctx 32 768, Gemma 3 270M's 15 sliding layers hold 1 024 cells each instead of 32 768.
What `fit` reports is what llama.cpp allocates for the same file and settings, cache by cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_reference import llama_kv_report
from synthetic.models import write_synthetic

from ollama_engine.runner.allocate import LoadParams, open_model

pytestmark = pytest.mark.reference

MIB = 1 << 20
NUM_CTX, BATCH = 32768, 512


def our_report(path: Path, **params) -> tuple[list[int], int]:
    """Cells per cache (every sequence's) and the KV bytes fit reports over all layers, allocating nothing."""
    loaded = open_model(str(path), LoadParams(kv_size=NUM_CTX, batch_size=BATCH, num_threads=2, **params),
                        allocate=False)
    try:
        caches = getattr(loaded.model.cache, "caches", (loaded.model.cache,))
        return sorted(cache.cells for cache in caches), sum(loaded.memory.cpu.cache)
    finally:
        loaded.close()


def assert_same_as_llama_cpp(path: Path, expected_cells: list[int]) -> float:
    cells, size = our_report(path)
    theirs = llama_kv_report(path, n_ctx=NUM_CTX, n_batch=BATCH)
    assert cells == sorted(c for _, c, _ in theirs) == sorted(expected_cells)
    their_mib = sum(m for m, _, _ in theirs)
    assert abs(size / MIB - their_mib) < 0.01 * len(theirs), f"ours {size / MIB:.2f} MiB, llama.cpp {their_mib} MiB"
    return their_mib


def test_real_gemma3_270m_at_32k(gemma3_path):
    """15 sliding layers (window 512) in rings of 512 + 512 cells, 3 global layers of 32 768."""
    mib = assert_same_as_llama_cpp(gemma3_path, [1024, NUM_CTX])
    assert mib == pytest.approx(15 * 1024 * 1024 / MIB + 3 * NUM_CTX * 1024 / MIB)  # 1 KiB per cell and layer


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("kv-memory")
    return lambda name, arch, **spec: write_synthetic(folder / f"{name}.gguf", arch, weight_type="F16", **spec)


def test_gemma3_4b_attention_at_32k(synthetic):
    """Gemma 3 4B's attention (34 layers, 4 KV heads of 256, window 1 024, every 6th layer global) on a
    narrow model: the KV cache depends on nothing else. 29 rings of 1 024 + 512 cells, 5 global layers."""
    path = synthetic("gemma3-4b-attention", "gemma3", n_layer=34, n_embd=256, n_head=8, n_head_kv=4, head_dim=256,
                     n_ff=256, sliding_window=1024, sliding_window_pattern=6, context_length=131072)
    mib = assert_same_as_llama_cpp(path, [1536, NUM_CTX])
    per_cell = 2 * 4 * 256 * 2  # keys and values, 4 heads of 256, f16
    assert mib == pytest.approx((29 * 1536 + 5 * NUM_CTX) * per_cell / MIB)


@pytest.mark.parametrize(("arch", "cells"), [
    ("gemma2", [768, NUM_CTX]), ("gpt-oss", [768, NUM_CTX]), ("llama4", [8704, NUM_CTX]),
])
def test_other_windowed_architectures_at_32k(synthetic, arch, cells):
    """Gemma 2's and gpt-oss's windows of 8 (their presets), Llama 4's chunks of 8 192: rings of window + batch."""
    assert_same_as_llama_cpp(synthetic(arch, arch, context_length=131072), cells)
