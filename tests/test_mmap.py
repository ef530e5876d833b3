"""Weights mapped from the file (use_mmap, llama.cpp's default): the CPU's weights in ggml's plain layout are
the page cache's bytes, not a copy read into memory of the process's own.

What must hold: the logits are bitwise those of a read model (mapping changes where the bytes are, not
what they are), the memory report is the same (fit == alloc), converted and repacked tensors still get
memory of their own, a file shorter than its tensors is an error (not a SIGBUS at the first token), the
mapping goes with the model, and `use_mmap` reaches the runner through serve.
Rerun: .venv/bin/python -m pytest -q tests/test_mmap.py
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import ollama
import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic

from ollama_engine import ggml
from ollama_engine.generate import prefill
from ollama_engine.llm.load import mmap_weights
from ollama_engine.ml import DType
from ollama_engine.ml.memory import DeviceInfo
from ollama_engine.models import load_model

THREADS = 2
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 200, 40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("mmap")
    written: dict[str, Path] = {}

    def write(weight_type: str) -> Path:
        if weight_type not in written:
            written[weight_type] = write_synthetic(folder / f"llama-{weight_type}.gguf", "llama",
                                                   weight_type=weight_type)
        return written[weight_type]

    return write


@contextlib.contextmanager
def opened(path: Path, use_mmap: bool):
    model = load_model(path, num_threads=THREADS, use_mmap=use_mmap)
    try:
        model.backend.load()
        model.cache.init(model.backend, DType.F16, 1, 128, 64)
        yield model
    finally:
        model.close()


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0", "Q4_0"])  # Q4_0: repacked where the CPU can
def test_mapped_weights_give_the_read_model_logits_bitwise(models, weight_type):
    path = models(weight_type)
    with opened(path, use_mmap=False) as read:
        expected = prefill(read, PROMPT, batch_size=16)
        report, allocated = read.backend.memory.to_json(), read.backend.allocated()
    with opened(path, use_mmap=True) as mapped:
        assert file_ranges(path)
        np.testing.assert_array_equal(prefill(mapped, PROMPT, batch_size=16), expected)
        assert mapped.backend.memory.to_json() == report  # what fit says is what either way takes
        assert mapped.backend.allocated() == allocated
    assert not file_ranges(path)  # unmapped with the model


def file_ranges(path: Path) -> list[range]:
    """The address ranges of this process's mappings of a file."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append(range(low, high))
    return ranges


@pytest.mark.parametrize("use_mmap", [True, False])
def test_mapped_weights_are_the_files_pages(models, use_mmap):
    """The token embeddings (never repacked) of a mapped model lie in the file's mapping; read, they do not."""
    path = models("F16")
    with opened(path, use_mmap=use_mmap) as model:
        address = np.frombuffer(ggml.host_bytes(model.backend.get("token_embd.weight").handle), np.uint8).ctypes.data
        assert any(address in span for span in file_ranges(path)) == use_mmap


def test_a_file_shorter_than_its_tensors_is_an_error(models, tmp_path):
    short = tmp_path / "short.gguf"
    shutil.copy(models("F16"), short)
    with open(short, "r+b") as f:
        f.truncate(short.stat().st_size - 4096)
    with pytest.raises(Exception, match="ends at byte|shorter|truncated"):
        with opened(short, use_mmap=True):
            pass


def test_the_default_follows_ollama():
    gpu = DeviceInfo.__new__(DeviceInfo)
    assert mmap_weights(None, [], free_memory=1 << 40, file_size=1 << 20) is False  # CPU only: memory of its own
    assert mmap_weights(None, [gpu], free_memory=1 << 40, file_size=1 << 20) is True
    assert mmap_weights(None, [gpu], free_memory=1 << 20, file_size=1 << 30) is False  # would thrash
    assert mmap_weights(True, [], free_memory=0, file_size=1 << 30) is True  # the option decides where set
    assert mmap_weights(False, [gpu], free_memory=1 << 40, file_size=1) is False


def runner_maps(model: Path) -> bool:
    """Whether a runner process serving this file has it mapped."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and str(model).encode() in (proc / "cmdline").read_bytes():
                return str(model) in (proc / "maps").read_text()
    raise AssertionError(f"no runner serves {model}")


def test_use_mmap_reaches_the_runner_through_serve(models, tmp_path):
    model = models("Q8_0")
    with serve_process(tmp_path / "store") as url:
        client = ollama.Client(host=url)
        options = {"temperature": 0, "num_predict": 8, "num_ctx": 256}
        read = client.generate(model=str(model), prompt="one two three", options=options)
        assert not runner_maps(model)  # a CPU-only load reads, as Ollama's
        mapped = client.generate(model=str(model), prompt="one two three", options={**options, "use_mmap": True})
        assert runner_maps(model)
        assert mapped.response == read.response and mapped.eval_count == read.eval_count
