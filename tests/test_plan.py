"""`ollama-engine plan` against a real synthetic model, fitted in-process, with simulated GPUs of chosen sizes.

GPU capacities are derived from what a CPU-only plan measures, so each case puts a known number of layers on
the GPU only if the planner really does its arithmetic on the measured sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_cli import MINIMUM, N_LAYER, run, tiny_llama
from synthetic.models import write_synthetic

from ollama_engine.llm.load import LoadOptions
from ollama_engine.llm.plan import make_plan, parse_gpus, parse_size, plan_json, plan_text
from ollama_engine.ml.memory import GIB, MIB, BackendMemory, DeviceID, GPULayersList, SystemInfo

TOTAL_LAYERS = N_LAYER + 1


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("plan"))


def run_json(model: Path, capsys, *argv: str) -> dict:
    rc, out = run(model, capsys, "--json", *argv)
    assert rc == 0
    return json.loads(out)


@pytest.fixture(scope="module")
def cpu_memory(model) -> BackendMemory:
    """What fit measures with no GPU: every layer on the CPU, with flash attention (the default there)."""
    plan = make_plan(str(model), LoadOptions(num_ctx=256, batch_size=32, flash_attention=1), [], False,
                     SystemInfo(total_memory=64 * GIB, free_memory=32 * GIB))
    assert plan.layout.sum() == 0 and plan.fits
    return plan.memory


def layer_size(memory: BackendMemory, layer: int) -> int:
    return memory.cpu.weights[layer] + memory.cpu.cache[layer]


def gpu_for(memory: BackendMemory, layers: int) -> str:
    """A --gpu value whose free memory holds exactly the last `layers` repeating layers and a graph."""
    free = MINIMUM + memory.cpu.graph + sum(layer_size(memory, i) for i in range(layers)) + 1
    return f"CUDA:GPU-0:{free}"


def test_parse_size():
    assert parse_size("8GiB") == 8 * GIB
    assert parse_size("512MiB") == 512 * MIB
    assert parse_size("1000000") == 1_000_000
    assert parse_size("1.5gb") == 1_500_000_000
    for bad in ["", "GiB", "8 parsecs", "-1", "8GiB!"]:
        with pytest.raises(ValueError, match="bad size"):
            parse_size(bad)


def test_parse_gpus_names_and_pci_ids():
    gpus = parse_gpus(["CUDA:GPU-0:8GiB", "CUDA:0000:01:00.0:512MiB", "ROCm:0:1000000"])
    assert [g.device_id for g in gpus] == [
        DeviceID("GPU-0", "CUDA"), DeviceID("0000:01:00.0", "CUDA"), DeviceID("0", "ROCm")
    ]
    assert [g.name for g in gpus] == ["CUDA0", "CUDA1", "ROCm0"]
    assert [g.free_memory for g in gpus] == [8 * GIB, 512 * MIB, 1_000_000]


@pytest.mark.parametrize("spec", ["CUDA:8GiB", "CUDA::8GiB", ":0:8GiB", "CUDA:0:lots", "CUDA:0:"])
def test_bad_gpu_value_is_a_clear_error(model, capsys, spec):
    with pytest.raises(ValueError, match=r"bad --gpu '.*'"):
        run(model, capsys, "--gpu", spec)


def test_same_gpu_twice_is_an_error():
    with pytest.raises(ValueError, match="given twice"):
        parse_gpus(["CUDA:0:1GiB", "CUDA:0:2GiB"])


def test_text_output_without_gpus(model, capsys, cpu_memory):
    rc, out = run(model, capsys)
    assert rc == 0
    assert "per layer" in out and "per device" in out
    assert "layout   [] (everything on the CPU)" in out
    assert f"no GPU: all {TOTAL_LAYERS} layers stay on the CPU" in out
    layer_lines = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[1] == "CPU"]
    assert [cells[0] for cells in layer_lines[:TOTAL_LAYERS + 1]] == ["input", *map(str, range(N_LAYER)), "output"]
    assert "simulated" not in out


def test_json_has_the_keys_and_a_memory_that_round_trips(model, capsys, cpu_memory):
    data = run_json(model, capsys, "--gpu", "CUDA:GPU-0:8GiB")
    assert {"memory", "layout", "gpus", "fits", "error"} <= data.keys()
    memory = BackendMemory.from_json(data["memory"])
    assert memory.to_json() == data["memory"]
    assert [gpu.device_id for gpu in memory.gpus] == [DeviceID("GPU-0", "CUDA")]
    assert GPULayersList.from_json(data["layout"]).to_json() == data["layout"]
    assert data["gpus"] == [{"id": "GPU-0", "backend": "CUDA", "name": "CUDA0", "free_memory": 8 * GIB,
                             "simulated": True}]
    assert data["fits"] is True and data["error"] is None
    # the sizes are the CPU measurement, moved: nothing is lost or invented except the GPU's graph
    assert memory.gpus[0].weights == cpu_memory.cpu.weights and memory.gpus[0].cache == cpu_memory.cpu.cache
    assert memory.gpus[0].graph == cpu_memory.cpu.graph and not any(memory.cpu.weights)


def test_big_gpu_takes_every_layer(model, capsys, cpu_memory):
    rc, out = run(model, capsys, "--gpu", "CUDA:GPU-0:8GiB")
    assert rc == 0
    assert f"layout   {TOTAL_LAYERS}[ID:GPU-0 Layers:{TOTAL_LAYERS}(0..{N_LAYER})]" in out
    assert "every layer is on a GPU" in out
    assert "simulated GPUs: per-layer weights and KV cache were measured on the CPU" in out


def test_small_gpu_takes_some_layers(model, capsys, cpu_memory):
    data = run_json(model, capsys, "--gpu", gpu_for(cpu_memory, 3))
    layout = GPULayersList.from_json(data["layout"])
    assert layout.sum() == 3 and layout[0].layers == [3, 4, 5]  # the last repeating layers; output stays
    memory = BackendMemory.from_json(data["memory"])
    assert memory.gpus[0].size() <= data["gpus"][0]["free_memory"] - MINIMUM
    assert [bool(w) for w in memory.cpu.weights] == [True, True, True, False, False, False, True]
    rc, out = run(model, capsys, "--gpu", gpu_for(cpu_memory, 3))
    assert "4 of 7 layers stay on the CPU" in out and "the smallest layer left on the CPU needs" in out


def test_too_small_gpu_takes_nothing_and_says_why(model, capsys, cpu_memory):
    rc, out = run(model, capsys, "--gpu", "CUDA:GPU-0:400MiB")
    assert rc == 0
    assert "layout   [] (everything on the CPU)" in out
    assert "CUDA0: 400.0 MiB free - 457.0 MiB minimum reserve" in out
    assert "= 0 B for layers" in out
    assert f"{TOTAL_LAYERS} of {TOTAL_LAYERS} layers stay on the CPU" in out


def test_num_gpu_is_respected(model, capsys, cpu_memory):
    data = run_json(model, capsys, "--gpu", "CUDA:GPU-0:8GiB", "--num-gpu", "2")
    assert GPULayersList.from_json(data["layout"]).sum() == 2
    rc, out = run(model, capsys, "--gpu", "CUDA:GPU-0:8GiB", "--num-gpu", "2")
    assert "--num-gpu 2 asks for at most 2 layers on GPUs" in out
    assert run_json(model, capsys, "--gpu", "CUDA:GPU-0:8GiB", "--num-gpu", "0")["layout"] == []


def test_options_change_what_is_measured(model, capsys, cpu_memory):
    bigger = BackendMemory.from_json(run_json(model, capsys, "--ctx", "512", "--parallel", "2")["memory"])
    assert sum(bigger.cpu.cache) == 4 * sum(cpu_memory.cpu.cache)  # twice the context for twice the sequences
    flash = BackendMemory.from_json(run_json(model, capsys, "--flash-attention")["memory"])
    assert flash.to_json() == cpu_memory.to_json()  # on is the default
    plain = BackendMemory.from_json(run_json(model, capsys, "--flash-attention", "off")["memory"])
    assert plain.cpu.cache == cpu_memory.cpu.cache and plain.cpu.graph != cpu_memory.cpu.graph


def test_flash_attention_choice_is_shown(model, capsys):
    """Auto (the default, as serve's) is on where every device supports it; the reason is printed."""
    assert "flash attention on (auto: supported by every device)" in run(model, capsys)[1]
    assert "flash attention off (OLLAMA_FLASH_ATTENTION=false)" in run(model, capsys, "--flash-attention", "off")[1]
    chosen = run_json(model, capsys, "--gpu", "CUDA:GPU-0:8GiB")["flash_attention"]
    assert chosen == {"enabled": True, "reason": "on (auto: supported by every device)"}


def test_kv_type_is_measured(tmp_path, capsys):
    """q8_0 needs a head dimension that is a multiple of its block size (32)."""
    model = write_synthetic(tmp_path / "wide.gguf", "tiny-llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2)
    f16 = BackendMemory.from_json(run_json(model, capsys, "--flash-attention")["memory"])
    q8 = BackendMemory.from_json(run_json(model, capsys, "--kv-type", "q8_0", "--flash-attention")["memory"])
    assert 0 < sum(q8.cpu.cache) < sum(f16.cpu.cache)


def test_not_enough_system_memory_is_reported(model):
    gpus = parse_gpus(["CUDA:GPU-0:400MiB"])
    plan = make_plan(str(model), LoadOptions(num_ctx=256, batch_size=32), gpus, True,
                     SystemInfo(total_memory=MIB, free_memory=MIB))
    assert not plan.fits and plan.error.startswith("model requires more system memory")
    assert plan_json(plan)["fits"] is False and plan_json(plan)["error"] == plan.error
    assert f"fits     no: {plan.error}" in plan_text(plan)
    assert plan.memory.cpu.weights  # the last measurement is still shown
