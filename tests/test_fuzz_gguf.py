"""Damaged GGUF files end in a clear error or a valid load: no abort, no hang, no unbounded allocation.

Two bounded versions of tools/fuzz_gguf.py (whose full run, 10,000 cases, is in RELIABILITY.md):

- a property over the reader alone (hypothesis): byte and field damage to the real TinyStories llama, parsed in
  this process; GGUFFile.open either succeeds or raises GGUFError, and reads no more than the file holds.
  FUZZ_GGUF_EXAMPLES raises the number of examples (CI: 200);
- the fuzzer's own pipeline for 25 cases from the seed corpus (every tiny synthetic preset and TinyStories):
  parse, load as the runner does and compute one token in a worker subprocess, so that an abort in ggml is
  seen as a failure instead of killing pytest.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ollama_engine.fs import GGUFError, GGUFFile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fuzz_gguf  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_GGUF_EXAMPLES", "200"))


@pytest.fixture(scope="module")
def stories_bytes(stories_path: Path) -> bytes:
    return stories_path.read_bytes()


@given(seed=st.integers(0, 2**32 - 1), structural=st.booleans(), rounds=st.integers(1, 3))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
def test_reader_refuses_damaged_files_with_a_gguf_error(stories_bytes: bytes, tmp_path_factory: pytest.TempPathFactory,
                                                        seed: int, structural: bool, rounds: int) -> None:
    rng = random.Random(seed)
    data = stories_bytes
    for _ in range(rounds):
        data = fuzz_gguf.mutate_field(data, rng) if structural else fuzz_gguf.mutate_bytes(data, rng)
    path = tmp_path_factory.getbasetemp() / "case.gguf"
    path.write_bytes(data)
    try:
        parsed = GGUFFile.open(path)
    except GGUFError as err:
        assert str(path) in str(err)
        return
    for tensor in parsed.tensors.values():  # a file that parses describes only bytes it has
        assert tensor.offset + tensor.n_bytes <= len(data)


def test_truncation_at_every_field_boundary(stories_bytes: bytes, tmp_path: Path) -> None:
    fields, end = fuzz_gguf.fields(stories_bytes)
    path = tmp_path / "case.gguf"
    for cut in sorted({f.offset for f in fields} | {f.offset + f.width // 2 for f in fields} | {end}):
        path.write_bytes(stories_bytes[:cut])
        with pytest.raises(GGUFError, match="truncated|past the end|cannot fit"):
            GGUFFile.open(path)


def test_fuzzer_pipeline_on_the_seed_corpus(stories_path: Path, tmp_path: Path) -> None:
    """25 cases through parse, load and one token; none may abort, hang, or fail with an unclear error."""
    report = fuzz_gguf.run(cases=25, seed=123, seeds_dir=tmp_path / "seeds")
    assert report.cases == 25
    assert report.failures == [], "\n".join(fuzz_gguf.cases_of(report))
    assert report.outcomes["refused"] > 0 and report.max_rss_mib < fuzz_gguf.MEMORY_LIMIT / 2**20
