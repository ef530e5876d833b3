"""Damaged GGUF files end in a clear error or a valid load: no abort, no hang, no unbounded allocation.

Bounded versions of tools/fuzz_gguf.py (whose full run, 10,000 cases, is in RELIABILITY.md):

- a property over the reader alone (hypothesis): byte and field damage to the real TinyStories llama, parsed in
  this process; GGUFFile.open either succeeds or raises GGUFError, and reads no more than the file holds.
  FUZZ_GGUF_EXAMPLES raises the number of examples (CI: 200);
- the fuzzer's own pipeline for 25 cases from the seed corpus (every tiny synthetic preset and TinyStories):
  parse, load as the runner does and compute one token in a worker subprocess, so that an abort in ggml is
  seen as a failure instead of killing pytest;
- the full run's failures in gpt-oss, gemma2, gemma3, qwen3moe and llama4, rebuilt minimally, each refused at load.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
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


# The full run's failures in the architectures added while it ran (RELIABILITY.md), rebuilt minimally: the seed,
# one hyper-parameter or tensor shape changed as in that case. Each aborted ggml, hung or overflowed int32.
OPEN_CASES = {
    "562 gpt-oss rope dims 0": ("tiny-gpt-oss", "rope.dimension_count", 0, "rope.dimension_count 0"),
    "5382 gemma2 rope dims 0": ("tiny-gemma2", "rope.dimension_count", 0, "rope.dimension_count 0"),
    "8455 gpt-oss window 2^40": ("tiny-gpt-oss", "attention.sliding_window", 2**40, "sliding_window must be in"),
    "9155 gemma3 window 2^40": ("tiny-gemma3", "attention.sliding_window", 2**40, "sliding_window must be in"),
    "802 gpt-oss bias of one expert": ("tiny-gpt-oss", "blk.0.ffn_down_exps.bias", [64], "expected [64, 8]"),
    "2828 gpt-oss 2 of 8 experts": ("tiny-gpt-oss", "blk.1.ffn_up_exps.weight", [64, 64, 2], "expected [64, 64, 8]"),
    "2568 qwen3moe 2-d experts": ("tiny-qwen3moe", "blk.1.ffn_gate_exps.weight", [64, 64], "expected [64, 64, 8]"),
    "725 llama4 2-d experts": ("tiny-llama4", "blk.3.ffn_up_exps.weight", [64, 64], "expected [64, 64, 4]"),
}


@pytest.fixture(scope="module")
def case_worker() -> Iterator[fuzz_gguf.Worker]:
    worker = fuzz_gguf.Worker()
    yield worker
    worker.close()


@pytest.mark.parametrize("case", OPEN_CASES)
def test_fuzz_failures_in_new_architectures_are_refused_at_load(case: str, case_worker: fuzz_gguf.Worker,
                                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    preset, name, value, message = OPEN_CASES[case]
    seeds = tmp_path_factory.getbasetemp() / "seeds"
    model = fuzz_gguf.Model.read(next(p for p in fuzz_gguf.write_seeds(seeds) if p.stem == preset))
    if isinstance(value, list):  # a tensor's shape, its data left as they were (longer than the shape needs)
        tensor = next(t for t in model.tensors if t.name == name)
        tensor.shape = value
    else:
        key = f"{model.metadata['general.architecture'][2]}.{name}"
        model.metadata[key] = (10, None, value)  # UINT64
    path = tmp_path_factory.mktemp("case") / "case.gguf"
    path.write_bytes(model.to_bytes())
    result = case_worker.check(path, timeout=60)
    assert (result["outcome"], result.get("stage"), result.get("error")) == ("refused", "load", "ModelError"), result
    assert message in result["message"], result
