"""lfm2's output norm (token_embd_norm.weight, llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2) goes with the output
layer, as llama.cpp places it, not with the input weights on the CPU: by name, in the memory the Backend
measures, and in a plan whose simulated GPU takes every layer (the output layer with it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic.models import write_synthetic

from ollama_engine.fs import GGUFFile
from ollama_engine.llm.load import LoadOptions
from ollama_engine.llm.plan import make_plan, parse_gpus
from ollama_engine.ml import Backend
from ollama_engine.ml.memory import GIB, SystemInfo
from ollama_engine.models.base import Model
from ollama_engine.models.lfm2 import Lfm2

N_LAYER = 4  # tiny-lfm2's


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("lfm2") / "lfm2.gguf", "tiny-lfm2")


def test_the_output_norm_is_placed_with_the_output_layer(lfm2: Path) -> None:
    model = GGUFFile.open(lfm2)
    with Backend(model, allocate=False, tensor_groups=Lfm2.tensor_groups) as backend:
        assert [(p.name, p.layer) for p in backend.placements("token_embd_norm.weight")] == [
            ("token_embd_norm.weight", N_LAYER)]
        assert [(p.name, p.layer) for p in backend.placements("token_embd.weight")] == [
            ("token_embd.weight", None), ("output.weight", N_LAYER)]  # tied: the output head is its copy
        placed = backend.memory
    with Backend(model, allocate=False, tensor_groups=Model.tensor_groups) as backend:  # without lfm2's entry
        as_input = backend.memory
    moved = as_input.input_weights - placed.input_weights
    assert moved >= model.tensors["token_embd_norm.weight"].n_bytes
    assert placed.cpu.weights[-1] - as_input.cpu.weights[-1] == moved
    assert placed.cpu.weights[:-1] == as_input.cpu.weights[:-1]


def test_a_gpu_with_every_layer_holds_the_output_norm(lfm2: Path) -> None:
    system = SystemInfo(total_memory=64 * GIB, free_memory=32 * GIB)
    options = LoadOptions(num_ctx=256, batch_size=32, flash_attention=1)
    cpu = make_plan(str(lfm2), options, [], False, system)
    gpu = make_plan(str(lfm2), options, parse_gpus(["CUDA:GPU-0:8GiB"]), True, system)
    assert gpu.fits and gpu.layout.sum() == N_LAYER + 1
    with Backend(GGUFFile.open(lfm2), allocate=False, tensor_groups=Lfm2.tensor_groups) as backend:
        assert gpu.memory.input_weights == cpu.memory.input_weights == backend.memory.input_weights
        assert gpu.memory.gpus[0].weights[-1] == cpu.memory.cpu.weights[-1] == backend.memory.cpu.weights[-1]
    assert not any(gpu.memory.cpu.weights)
