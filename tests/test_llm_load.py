"""The parent side: the runner handle, discovery, and the fit → alloc → commit loop against a real runner.

This machine has no GPU, so GPUs are simulated around the real runner: the layers a request puts on a fake
GPU land on the runner's CPU, and `SimulatedGPUs` moves their measured sizes (and a compute graph) from the
CPU entry of the runner's report to the fake GPU's entry, then fails the allocation when a device holds more
than it really has. The loop's decisions therefore rest on the runner's real measurements.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.llm.discovery import discover_gpus, system_info
from ollama_engine.llm.layout import create_layout
from ollama_engine.llm.load import LoadError, LoadOptions, load
from ollama_engine.llm.runner_handle import RunnerError, RunnerHandle, StatusWriter, visible_devices_env
from ollama_engine.ml import gpu_devices
from ollama_engine.ml.memory import MIB, BackendMemory, DeviceID, DeviceInfo, DeviceMemory, GPULayersList, SystemInfo
from ollama_engine.server.wire import LoadOperation, ServerStatus

N_LAYER = 6
TOTAL_LAYERS = N_LAYER + 1
OPTIONS = LoadOptions(num_ctx=256, batch_size=32, num_threads=2)
SYSTEM = SystemInfo(thread_count=2, total_memory=64 << 30, free_memory=32 << 30, free_swap=0)


def fake_gpu(index: int, free: int) -> DeviceInfo:
    return DeviceInfo(device_id=DeviceID(str(index), "CUDA"), name=f"CUDA{index}", total_memory=free,
                      free_memory=free)


class SimulatedGPUs:
    """A real runner seen through fake GPUs with a real capacity each (and optionally a CPU capacity)."""

    def __init__(self, runner: RunnerHandle, capacities: dict[DeviceID, int], cpu_capacity: int | None = None):
        self.runner = runner
        self.capacities = capacities
        self.cpu_capacity = cpu_capacity
        self.requests: list[tuple[LoadOperation, GPULayersList]] = []

    def load(self, request: dict[str, Any]) -> tuple[bool, BackendMemory]:
        operation, layers = LoadOperation(request["Operation"]), GPULayersList.from_json(request["GPULayers"])
        self.requests.append((operation, layers))
        success, memory = self.runner.load(request)
        if operation == LoadOperation.CLOSE:
            return success, memory
        memory = copy.deepcopy(memory)
        for device_id, capacity in self.capacities.items():
            gpu = DeviceMemory(device_id, f"{device_id.library}{device_id.id}", [0] * TOTAL_LAYERS, [0] * TOTAL_LAYERS)
            for entry in layers:
                if entry.device_id == device_id:
                    for layer in entry.layers:
                        gpu.weights[layer], memory.cpu.weights[layer] = memory.cpu.weights[layer], 0
                        gpu.cache[layer], memory.cpu.cache[layer] = memory.cpu.cache[layer], 0
                    gpu.graph = memory.cpu.graph if entry.layers else 0
            memory.gpus.append(gpu)
            if operation != LoadOperation.FIT and gpu.size() > capacity:
                success = False
        cpu_size = memory.input_weights + memory.cpu.size()
        if operation != LoadOperation.FIT and self.cpu_capacity is not None and cpu_size > self.cpu_capacity:
            success = False
        return success, memory

    def layer_counts(self, operation: LoadOperation) -> list[int]:
        return [layers.sum() for op, layers in self.requests if op == operation]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("load") / "llama.gguf", "tiny-llama", n_layer=N_LAYER)


@pytest.fixture(scope="module")
def runner(model):
    with RunnerHandle.start(str(model)) as handle:
        handle.wait_launched()
        yield handle


@pytest.fixture(scope="module")
def report(runner) -> BackendMemory:
    """What the runner measures with everything on the CPU."""
    success, memory = runner.load(OPTIONS.request(LoadOperation.FIT, GPULayersList()))
    assert success
    return memory


def layer_size(report: BackendMemory, layer: int) -> int:
    return report.cpu.weights[layer] + report.cpu.cache[layer]


def gpu_free(report: BackendMemory, layers: int) -> int:
    """Free memory in which exactly `layers` repeating layers and a graph fit, after the minimum reserve."""
    return 457 * MIB + report.cpu.graph + sum(layer_size(report, i) for i in range(layers)) + 1


def test_everything_fits_first_guess_is_kept(runner, report):
    gpu = fake_gpu(0, gpu_free(report, TOTAL_LAYERS) + 10 * MIB)
    sim = SimulatedGPUs(runner, {gpu.device_id: gpu.free_memory})
    result = load(sim, SYSTEM, [gpu], TOTAL_LAYERS, OPTIONS)
    assert [op for op, _ in sim.requests] == [LoadOperation.FIT, LoadOperation.ALLOC, LoadOperation.COMMIT]
    assert result.gpu_layers.sum() == TOTAL_LAYERS and result.device_ids() == [gpu.device_id]
    assert result.memory.gpus[0].size() > 0 and not any(result.memory.cpu.weights)
    runner.wait_until_running()  # commit really loads the weights
    assert runner.health()[0] == ServerStatus.READY


@pytest.fixture
def fresh_runner(model):
    with RunnerHandle.start(str(model)) as handle:
        handle.wait_launched()
        yield handle


def test_first_guess_is_everything_on_the_largest_gpu(fresh_runner, report):
    small, large = fake_gpu(0, 600 * MIB), fake_gpu(1, 900 * MIB)
    sim = SimulatedGPUs(fresh_runner, {small.device_id: small.free_memory, large.device_id: large.free_memory})
    result = load(sim, SYSTEM, [small, large], TOTAL_LAYERS, OPTIONS)
    first = sim.requests[0][1]
    assert [entry.device_id for entry in first if entry.layers] == [large.device_id]
    assert first.sum() == TOTAL_LAYERS
    assert result.gpu_layers.sum() == TOTAL_LAYERS


def test_partial_offload_converges_on_the_runner_report(fresh_runner, report):
    gpu = fake_gpu(0, gpu_free(report, 3))
    sim = SimulatedGPUs(fresh_runner, {gpu.device_id: gpu.free_memory})
    result = load(sim, SYSTEM, [gpu], TOTAL_LAYERS, OPTIONS)
    # the first guess had every layer; the report showed what they cost and the plan shrank to what fits
    assert sim.layer_counts(LoadOperation.FIT)[0] == TOTAL_LAYERS
    assert result.gpu_layers.sum() == 3
    assert result.gpu_layers[0].layers == [3, 4, 5]  # the last repeating layers; the output layer stays behind
    assert result.memory.gpus[0].size() <= gpu.free_memory - 457 * MIB
    assert create_layout(SYSTEM, [gpu], result.memory, False, 0).hash() == result.gpu_layers.hash()
    assert all(a.backoff == 0 for a in result.attempts)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> tuple[Path, BackendMemory]:
    """Layers of ~30 MiB, so that holding back 10% of a GPU's memory costs whole layers."""
    path = write_synthetic(tmp_path_factory.mktemp("load") / "big.gguf", "tiny-llama", n_layer=N_LAYER,
                           n_embd=512, n_ff=4096, n_head=8, n_head_kv=4)
    with RunnerHandle.start(str(path)) as handle:
        handle.wait_launched()
        success, memory = handle.load(OPTIONS.request(LoadOperation.FIT, GPULayersList()))
    assert success and layer_size(memory, 0) > 25 * MIB
    return path, memory


def test_failed_allocation_backs_off(big_model):
    """The GPU advertises room for every layer but really holds 3: each failure holds back 10% more."""
    path, report = big_model
    gpu = fake_gpu(0, gpu_free(report, TOTAL_LAYERS))
    real = gpu_free(report, 3) - 457 * MIB
    with RunnerHandle.start(str(path)) as runner:
        runner.wait_launched()
        sim = SimulatedGPUs(runner, {gpu.device_id: real})
        result = load(sim, SYSTEM, [gpu], TOTAL_LAYERS, OPTIONS)
    allocs = [(a.gpu_layers.sum(), a.success, a.backoff) for a in result.attempts if a.operation == LoadOperation.ALLOC]
    # every failure gives fewer layers, until the 3 that really fit; backoff grows in float32 steps of 0.1
    assert [n for n, _, _ in allocs] == sorted((n for n, _, _ in allocs), reverse=True)
    assert [ok for _, ok, _ in allocs] == [False] * (len(allocs) - 1) + [True]
    assert len(allocs) >= 3 and len({n for n, _, _ in allocs}) == len(allocs)
    assert result.gpu_layers.sum() == 3 and result.memory.gpus[0].size() <= real
    steps = [np.float32(0)]
    while steps[-1] < 1:
        steps.append(steps[-1] + np.float32(0.1))
    assert allocs[0][2] == 0 and all(np.float32(b) in steps for _, _, b in allocs) and allocs[-1][2] > 0
    assert [layers.sum() for op, layers in sim.requests if op == LoadOperation.COMMIT] == [3]


def test_num_gpu_that_cannot_be_allocated_fails_and_closes(fresh_runner, report):
    gpu = fake_gpu(0, gpu_free(report, TOTAL_LAYERS))
    sim = SimulatedGPUs(fresh_runner, {gpu.device_id: layer_size(report, 0)})
    options = LoadOptions(**{**vars(OPTIONS), "num_gpu": 3})
    with pytest.raises(LoadError, match=r"^memory layout cannot be allocated with num_gpu = 3$"):
        load(sim, SYSTEM, [gpu], TOTAL_LAYERS, options)
    assert sim.requests[-1][0] == LoadOperation.CLOSE
    assert sim.layer_counts(LoadOperation.ALLOC) == [3]
    assert fresh_runner.health()[0] == ServerStatus.LAUNCHED  # nothing held; a new load may follow
    assert load(SimulatedGPUs(fresh_runner, {}), SYSTEM, [], TOTAL_LAYERS, OPTIONS).gpu_layers.sum() == 0


def test_backoff_gives_up_after_eleven_failures(fresh_runner, report):
    """Neither the GPU (which lies about its room) nor the CPU can take the layers: backoff runs out."""
    gpu = fake_gpu(0, gpu_free(report, TOTAL_LAYERS) + 100 * MIB)
    cpu_capacity = report.input_weights + report.cpu.graph  # no layer fits on the CPU
    sim = SimulatedGPUs(fresh_runner, {gpu.device_id: 0}, cpu_capacity=cpu_capacity)
    seen = []
    with pytest.raises(LoadError, match=r"^memory layout cannot be allocated$"):
        load(sim, SYSTEM, [gpu], TOTAL_LAYERS, OPTIONS, on_attempt=seen.append)
    backoffs = sorted({a.backoff for a in seen if a.operation == LoadOperation.ALLOC})
    assert backoffs[0] == 0 and np.float32(backoffs[-1]) <= np.float32(1.0000001)
    assert not any(a.success for a in seen if a.operation == LoadOperation.ALLOC)
    assert sim.requests[-1][0] == LoadOperation.CLOSE
    assert LoadOperation.COMMIT not in [op for op, _ in sim.requests]


def test_runner_http_errors_are_passed_on(fresh_runner):
    with pytest.raises(RunnerError, match="loras are not yet implemented"):
        fresh_runner.load({**OPTIONS.request(LoadOperation.FIT, GPULayersList()), "LoraPath": ["x"]})


def test_discovery_asks_the_runner_which_gpus_ggml_sees(runner):
    """The runner's ggml sees what this process's ggml sees (none on a CPU-only machine)."""
    assert [gpu.device_id for gpu in discover_gpus(runner)] == [device.device_id for device in gpu_devices()]


class FakeInfo:
    """A runner handle whose /info lists the given GPUs."""

    def __init__(self, gpus: list[DeviceInfo]) -> None:
        self.gpus = gpus

    def info(self) -> list[DeviceInfo]:
        return list(self.gpus)


GPUS = [
    DeviceInfo(device_id=DeviceID("0000:01:00.0", "CUDA"), name="CUDA0", total_memory=80 << 30, free_memory=10 << 30),
    DeviceInfo(device_id=DeviceID("1", "CUDA"), name="CUDA1", total_memory=24 << 30, free_memory=1 << 30),
    DeviceInfo(device_id=DeviceID("0", "Vulkan"), name="Vulkan0", total_memory=8 << 30, free_memory=4 << 30),
]


def test_discovery_refreshes_cuda_memory_from_nvml(monkeypatch):
    import pynvml

    handles = {("bus", "0000:01:00.0"): (80 << 30, 70 << 30), ("index", 1): (24 << 30, 20 << 30)}
    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByPciBusId", lambda bus: ("bus", bus))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: ("index", index))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda handle: SimpleNamespace(total=handles[handle][0], free=handles[handle][1]))
    found = discover_gpus(FakeInfo(GPUS))
    assert [(g.device_id, g.total_memory, g.free_memory) for g in found] == [
        (GPUS[0].device_id, 80 << 30, 70 << 30),  # by PCI bus id
        (GPUS[1].device_id, 24 << 30, 20 << 30),  # by ordinal
        (GPUS[2].device_id, 8 << 30, 4 << 30),  # not NVIDIA: as the runner said
    ]
    assert calls == ["init", "shutdown"] * 2


def test_discovery_keeps_the_runner_figures_when_nvml_fails(monkeypatch):
    import pynvml

    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    assert discover_gpus(FakeInfo(GPUS)) == GPUS


def test_system_info_reads_meminfo_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 600 kB\nSwapFree: 50 kB\n")
    info = system_info(meminfo, tmp_path / "no-cgroup")
    assert (info.total_memory, info.free_memory, info.free_swap) == (1000 * 1024, 600 * 1024, 50 * 1024)
    meminfo.write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 10 kB\nCached: 20 kB\n")
    assert system_info(meminfo, tmp_path / "no-cgroup").free_memory == 130 * 1024
    (tmp_path / "memory.max").write_text("512000\n")
    (tmp_path / "memory.current").write_text("112000\n")
    info = system_info(meminfo, tmp_path)
    assert (info.total_memory, info.free_memory) == (512000, 400000)
    (tmp_path / "memory.max").write_text("max\n")
    assert system_info(meminfo, tmp_path).total_memory == 1000 * 1024
    assert system_info().total_memory > 0


def test_status_writer_keeps_error_lines():
    status = StatusWriter()
    for line in ["loading model", "error: failed to initialize the Metal library\n", "all good",
                 "GGML_ASSERT([rsets->data count] == 0) failed"]:
        status.write_line(line)
    assert status.last_error == (
        "error: failed to initialize the Metal library\nGGML_ASSERT([rsets->data count] == 0) failed"
    )
    status.write_line("llama_init_from_model: failed to initialize the context")
    assert status.last_error.endswith("\nllama_init_from_model: failed to initialize the context")
    for _ in range(200):
        status.write_line("Error: " + "x" * 100)
    assert len(status.last_error.encode()) <= 8 * 1024


def test_runner_that_dies_is_reported_with_its_error(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        handle = RunnerHandle.start(str(model), port=taken.getsockname()[1])
        with handle, pytest.raises(RunnerError, match=r"^llama runner process has terminated: error: "):
            handle.wait_launched()


def test_close_kills_the_runner(model):
    handle = RunnerHandle.start(str(model))
    handle.wait_launched()
    handle.close()
    assert handle.exited() and handle.process.returncode != 0
    with pytest.raises(OSError):
        handle.health()


def test_visible_devices_env():
    rocm = [DeviceInfo(device_id=DeviceID("0", "ROCm")), DeviceInfo(device_id=DeviceID("1", "ROCm"), filter_id="3")]
    assert visible_devices_env(rocm) == {"ROCR_VISIBLE_DEVICES": "0,3"}
    cuda = [DeviceInfo(device_id=DeviceID("GPU-1", "CUDA"))]
    assert visible_devices_env(cuda) == {}
    assert visible_devices_env(cuda, must_filter=True) == {"CUDA_VISIBLE_DEVICES": "GPU-1"}
    assert visible_devices_env([DeviceInfo(device_id=DeviceID("0", "Vulkan"))], must_filter=True) == {}
