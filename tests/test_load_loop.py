"""The load loop's decisions against a runner simulated in-process: fast and exact, no subprocess.

`tests/test_llm_load.py` drives the same loop against a real runner; here every layer costs a round number
of bytes on whichever device holds it, so the tests can pin the loop's arithmetic: how many backoff steps
it takes before giving up, and that a layout with as many layers as before but placed differently is tried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ollama_engine.llm import load as load_module
from ollama_engine.llm.load import LoadError, LoadOptions, load
from ollama_engine.ml.memory import (
    GIB,
    MIB,
    BackendMemory,
    DeviceID,
    DeviceInfo,
    DeviceMemory,
    GPULayers,
    GPULayersList,
    SystemInfo,
)
from ollama_engine.server.wire import LoadOperation

MINIMUM = 457 * MIB  # what every CUDA GPU keeps back (DeviceInfo.minimum_memory)
SYSTEM = SystemInfo(thread_count=2, total_memory=64 * GIB, free_memory=32 * GIB, free_swap=0)


def cuda(index: int, free: int) -> DeviceInfo:
    return DeviceInfo(device_id=DeviceID(f"GPU-{index}", "CUDA"), name=f"CUDA{index}", total_memory=free,
                      free_memory=free)


class FakeRunner:
    """Answers /load as a runner would: each layer's bytes land on the device the request puts it on.

    An allocation fails when a GPU gets more than `capacities` says or the CPU more than `cpu_capacity`;
    a fit always succeeds (it allocates nothing).
    """

    def __init__(self, layers: list[int], capacities: dict[DeviceID, int], cpu_capacity: int | None = None,
                 graph: Callable[[int], int] = lambda layers: 0) -> None:
        self.layers = layers
        self.capacities = capacities
        self.cpu_capacity = cpu_capacity
        self.graph = graph  # a GPU's compute graph, by the number of layers it holds
        self.requests: list[tuple[LoadOperation, GPULayersList]] = []

    def load(self, request: dict[str, Any]) -> tuple[bool, BackendMemory]:
        operation = LoadOperation(request["Operation"])
        layout = GPULayersList.from_json(request["GPULayers"])
        self.requests.append((operation, layout))
        if operation == LoadOperation.CLOSE:
            return False, BackendMemory()
        n = len(self.layers)
        cpu = DeviceMemory(name="CPU", weights=list(self.layers), cache=[0] * n)
        gpus = []
        for device_id in self.capacities:
            gpu = DeviceMemory(device_id, device_id.id, [0] * n, [0] * n)
            for entry in layout:
                if entry.device_id == device_id:
                    for layer in entry.layers:
                        gpu.weights[layer], cpu.weights[layer] = cpu.weights[layer], 0
            held = sum(1 for size in gpu.weights if size)
            gpu.graph = self.graph(held) if held else 0
            gpus.append(gpu)
        success = operation == LoadOperation.FIT or (
            all(gpu.size() <= self.capacities[gpu.device_id] for gpu in gpus)
            and (self.cpu_capacity is None or cpu.size() <= self.cpu_capacity)
        )
        if not success:
            for gpu in gpus:
                gpu.graph = 0  # the weights did not fit, so the graph was never reserved
        return success, BackendMemory(cpu=cpu, gpus=gpus)

    def sent(self, operation: LoadOperation) -> list[GPULayersList]:
        return [layout for op, layout in self.requests if op == operation]


def test_backoff_takes_ten_float32_steps_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama sums the backoff in float32: ten steps of 0.1 reach 1.0000001 > 1, so the eleventh failure ends it.

    In float64 the tenth sum is 0.9999999999999999 and the loop would take an eleventh step.
    """
    backoffs: list[np.float32] = []
    create_layout = load_module.create_layout

    def spy(*args: Any, **kwargs: Any) -> GPULayersList:
        backoffs.append(args[4])
        return create_layout(*args, **kwargs)

    monkeypatch.setattr(load_module, "create_layout", spy)
    gpu = cuda(0, MINIMUM + 2 * GIB)  # advertises room for everything, really holds nothing
    runner = FakeRunner([100 * MIB] * 8, {gpu.device_id: 0}, cpu_capacity=0)  # nor can the CPU take a layer
    with pytest.raises(LoadError, match=r"^memory layout cannot be allocated$"):
        load(runner, SYSTEM, [gpu], 8, LoadOptions())

    expected = [np.float32(0)]
    for _ in range(10):
        expected.append(expected[-1] + np.float32(0.1))
    assert expected[-1] == np.float32(1.0000001)
    assert sorted(set(backoffs)) == expected
    assert all(type(b) is np.float32 for b in backoffs)
    assert runner.requests[-1][0] == LoadOperation.CLOSE
    assert not runner.sent(LoadOperation.COMMIT)


def test_backoff_succeeds_at_the_first_step_that_fits() -> None:
    gpu = cuda(0, MINIMUM + 1000 * MIB)
    # really 750 MiB: 10% held back leaves 854 MiB planned (8 layers, fails); 20% leaves 708 MiB (7 layers)
    runner = FakeRunner([100 * MIB] * 10, {gpu.device_id: 750 * MIB})
    result = load(runner, SYSTEM, [gpu], 10, LoadOptions())
    allocs = [(a.gpu_layers.sum(), a.success, a.backoff) for a in result.attempts if a.operation == LoadOperation.ALLOC]
    assert allocs == [(10, False, 0.0), (8, False, float(np.float32(0.1))), (7, True, float(np.float32(0.2)))]
    assert result.gpu_layers.sum() == 7 and runner.sent(LoadOperation.COMMIT) == [result.gpu_layers]


def test_a_layout_with_as_many_layers_placed_differently_is_tried() -> None:
    """The first guess puts every layer on the biggest GPU; the report shows they need both GPUs.

    The new layout has the same number of layers, so only a loop that accepts an equal count rebalances;
    one that waits for fewer layers would allocate the first guess, fail and back off.
    """
    big, small = cuda(0, MINIMUM + 250 * MIB), cuda(1, MINIMUM + 200 * MIB)
    runner = FakeRunner([100 * MIB] * 4, {big.device_id: 250 * MIB, small.device_id: 200 * MIB})
    result = load(runner, SYSTEM, [big, small], 4, LoadOptions())
    first, rebalanced = runner.sent(LoadOperation.FIT)
    assert [(e.device_id, e.layers) for e in first if e.layers] == [(big.device_id, [0, 1, 2, 3])]
    assert rebalanced.sum() == 4 and len([e for e in rebalanced if e.layers]) == 2
    assert runner.sent(LoadOperation.ALLOC) == [rebalanced] and result.gpu_layers == rebalanced
    assert all(a.backoff == 0 for a in result.attempts)


def test_num_gpu_fails_at_once_without_backing_off() -> None:
    gpu = cuda(0, MINIMUM + GIB)
    runner = FakeRunner([100 * MIB] * 4, {gpu.device_id: 150 * MIB})
    with pytest.raises(LoadError, match=r"^memory layout cannot be allocated with num_gpu = 3$"):
        load(runner, SYSTEM, [gpu], 4, LoadOptions(num_gpu=3))
    assert [layout.sum() for layout in runner.sent(LoadOperation.ALLOC)] == [3]
    assert runner.requests[-1][0] == LoadOperation.CLOSE


def test_cpu_only_loads_in_three_requests() -> None:
    runner = FakeRunner([100 * MIB] * 4, {})
    result = load(runner, SYSTEM, [], 4, LoadOptions())
    assert [op for op, _ in runner.requests] == [LoadOperation.FIT, LoadOperation.ALLOC, LoadOperation.COMMIT]
    assert result.gpu_layers.sum() == 0 and result.device_ids() == []


def test_the_load_request_is_the_parents_json() -> None:
    """What Ollama's parent sends with its defaults (llm.LoadRequest; the KV cache holds num_ctx per sequence)."""
    assert LoadOptions().request(LoadOperation.FIT, GPULayersList()) == {
        "Operation": 0, "LoraPath": None, "Parallel": 1, "BatchSize": 512, "FlashAttention": 0, "KvSize": 2048,
        "KvCacheType": "", "NumThreads": 0, "GPULayers": None, "MultiUserCache": False, "ProjectorPath": "",
        "MainGPU": 0, "UseMmap": False,
    }
    options = LoadOptions(num_ctx=256, parallel=2, num_threads=4, flash_attention=1, kv_cache_type="q8_0",
                          multi_user_cache=True)
    layout = GPULayersList([GPULayers(DeviceID("GPU-0", "CUDA"), [1, 2])])
    request = options.request(LoadOperation.ALLOC, layout)
    assert (request["Operation"], request["BatchSize"], request["KvSize"], request["GPULayers"]) == (
        1, 256, 512, [{"id": "GPU-0", "backend": "CUDA", "Layers": [1, 2]}])
    assert (request["NumThreads"], request["FlashAttention"], request["KvCacheType"], request["MultiUserCache"]) == (
        4, 1, "q8_0", True)


def test_default_options_hold_back_nothing_but_the_minimum() -> None:
    gpu = cuda(0, MINIMUM + 300)
    runner = FakeRunner([100] * 3, {gpu.device_id: 300})  # three layers of 100 bytes fill it exactly
    assert load(runner, SYSTEM, [gpu], 3, LoadOptions()).gpu_layers.sum() == 3


def test_num_gpu_zero_that_cannot_be_allocated_fails_at_once() -> None:
    runner = FakeRunner([100 * MIB] * 4, {}, cpu_capacity=100 * MIB)
    with pytest.raises(LoadError, match=r"^memory layout cannot be allocated with num_gpu = 0$"):
        load(runner, SYSTEM, [cuda(0, GIB)], 4, LoadOptions(num_gpu=0))
    assert len(runner.sent(LoadOperation.ALLOC)) == 1


def counts(runner: FakeRunner) -> list[tuple[str, int]]:
    return [(op.name, layout.sum()) for op, layout in runner.requests]


def test_an_oscillating_plan_tries_the_count_in_between() -> None:
    """7 layers leave room for 9, 9 would leave room for 7 only: the loop tries 8, which fits as it is."""
    gpu = cuda(0, MINIMUM + 1000 * MIB)
    runner = FakeRunner([100 * MIB] * 10, {gpu.device_id: 1000 * MIB},
                        graph=lambda n: 300 * MIB if n >= 9 else 150 * MIB if n == 8 else 50 * MIB)
    result = load(runner, SYSTEM, [gpu], 10, LoadOptions())
    assert counts(runner) == [("FIT", 10), ("FIT", 7), ("FIT", 8), ("ALLOC", 8), ("COMMIT", 8)]
    assert result.gpu_layers.sum() == 8


def test_an_oscillating_plan_settles_on_the_smaller_count_when_none_between_holds() -> None:
    """8 layers need the big graph (room for 7 only); 7 leave room for 9. Trying 8 again in the allocation
    phase fails, and that failed report (no graph) must not be taken for room."""
    gpu = cuda(0, MINIMUM + 1000 * MIB)
    runner = FakeRunner([100 * MIB] * 10, {gpu.device_id: 1000 * MIB},
                        graph=lambda n: 300 * MIB if n >= 8 else 50 * MIB)
    result = load(runner, SYSTEM, [gpu], 10, LoadOptions())
    assert counts(runner) == [
        ("FIT", 10), ("FIT", 7), ("FIT", 8), ("FIT", 7),
        ("ALLOC", 7), ("ALLOC", 8), ("ALLOC", 7), ("COMMIT", 7),
    ]
    assert result.gpu_layers.sum() == 7 and all(a.backoff == 0 for a in result.attempts)


def test_an_explicit_num_gpu_never_explores() -> None:
    gpu = cuda(0, MINIMUM + 1000 * MIB)
    runner = FakeRunner([100 * MIB] * 10, {gpu.device_id: 1000 * MIB},
                        graph=lambda n: 300 * MIB if n >= 8 else 50 * MIB)
    result = load(runner, SYSTEM, [gpu], 10, LoadOptions(num_gpu=7))
    assert counts(runner) == [("FIT", 7), ("ALLOC", 7), ("COMMIT", 7)]
    assert result.gpu_layers.sum() == 7


def test_a_plan_one_layer_larger_is_not_explored() -> None:
    """7 layers leave room for 8, 8 would leave room for 7: one more is no oscillation worth a request."""
    gpu = cuda(0, MINIMUM + 1000 * MIB)
    runner = FakeRunner([100 * MIB] * 10, {gpu.device_id: 1000 * MIB},
                        graph=lambda n: 300 * MIB if n >= 8 else 150 * MIB)
    result = load(runner, SYSTEM, [gpu], 10, LoadOptions())
    assert counts(runner) == [("FIT", 10), ("FIT", 7), ("ALLOC", 7), ("COMMIT", 7)]
    assert result.gpu_layers.sum() == 7
