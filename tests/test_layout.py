"""Layer layout: Ollama's TestLLMServerFitGPU table (llm/server_test.go, f63eea3d) and the rules around it."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ollama_engine.llm.layout import (
    InsufficientSystemMemoryError,
    LoadRequiredFullError,
    create_layout,
)
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

MIN = 457 * MIB
SYSTEM = SystemInfo(total_memory=GIB, free_memory=512 * MIB, free_swap=256 * MIB)


def gpu(name: str, free: int, library: str = "", integrated: bool = False) -> DeviceInfo:
    return DeviceInfo(device_id=DeviceID(name, library), free_memory=free, integrated=integrated)


def layout(*entries: tuple[str, list[int]], library: str = "") -> GPULayersList:
    return GPULayersList(GPULayers(DeviceID(name, library), list(layers)) for name, layers in entries)


def report(gpus: list[DeviceInfo], layers: list[int]) -> BackendMemory:
    """The harness of TestLLMServerFitGPU: every layer measured on the CPU, the GPUs reported empty."""
    n = len(layers)
    return BackendMemory(
        cpu=DeviceMemory(weights=list(layers), cache=[0] * n),
        gpus=[DeviceMemory(device_id=g.device_id, weights=[0] * n, cache=[0] * n) for g in gpus],
    )


def placed(result: GPULayersList) -> list[tuple[DeviceID, list[int]]]:
    """What Ollama's Hash compares: entries in order, layers in order, empty entries ignored."""
    return [(g.device_id, g.layers) for g in result if g.layers]


ONE = [gpu("gpu0", 256 * MIB + MIN)]
TWO = [gpu("gpu0", 128 * MIB + MIN), gpu("gpu1", 256 * MIB + MIN)]
TWO_LIBS = [gpu("gpu0", 128 * MIB + MIN, "CUDA"), gpu("gpu1", 256 * MIB + MIN, "ROCm")]
IGPU = [gpu("gpu0", 256 * MIB + MIN, integrated=True)]
MIXED = [gpu("gpu0", 128 * MIB + MIN), gpu("gpu1", 256 * MIB + MIN, integrated=True)]

FIT_GPU_CASES = [
    # name, gpus, layers (MiB), num_gpu, require_full, expected layout or error
    ("No GPU", [], [50, 50, 50], -1, True, layout()),
    ("Full single GPU", ONE, [50, 50, 50], -1, False, layout(("gpu0", [0, 1, 2]))),
    ("Partial single GPU", ONE, [100] * 4, -1, False, layout(("gpu0", [1, 2]))),
    ("Single GPU with numGPU 1", ONE, [50, 50, 50], 1, False, layout(("gpu0", [1]))),
    ("Single GPU with numGPU 0", ONE, [50, 50, 50], 0, False, layout()),
    ("Single GPU with numGPU 999", ONE, [100] * 4, 999, False, layout(("gpu0", [0, 1, 2, 3]))),
    ("Multi GPU fits on one", TWO, [50, 50, 50], -1, False, layout(("gpu1", [0, 1, 2]))),
    ("Multi GPU split", TWO, [256, 50, 50], -1, False, layout(("gpu1", [0]), ("gpu0", [1, 2]))),
    ("Multi GPU partial", TWO, [256, 256, 50], -1, False, layout(("gpu1", [1]))),
    ("Multi GPU numGPU 1", TWO, [50, 50, 50], 1, False, layout(("gpu1", [1]))),
    ("Multi GPU numGPU 2", TWO, [256, 50, 50], 2, False, layout(("gpu1", [0]), ("gpu0", [1]))),
    ("Multi GPU numGPU 999", TWO, [256, 256, 50], 999, False, layout(("gpu1", [0, 1]), ("gpu0", [2]))),
    ("Multi GPU different libraries", TWO_LIBS, [128, 128, 50], -1, False,
     layout(("gpu1", [0, 1]), library="ROCm")),
    ("requireFull", ONE, [100] * 4, -1, True, LoadRequiredFullError),
    ("requireFull numGPU", [gpu("gpu0", 256 * MIB)], [100] * 4, 4, True, LoadRequiredFullError),
    ("iGPU", IGPU, [50, 50, 50], -1, False, layout(("gpu0", [0, 1, 2]))),
    ("iGPU + dGPU", MIXED, [50, 50, 50], -1, False, layout(("gpu1", [0]), ("gpu0", [1, 2]))),
    ("iGPU + dGPU fits on one", MIXED, [50, 50], -1, False, layout(("gpu0", [0, 1]))),
    ("iGPU + dGPU partial", MIXED, [100] * 4, -1, False, layout(("gpu1", [0, 1]), ("gpu0", [2]))),
    ("iGPU + dGPU numGPU 1", MIXED, [100] * 4, 1, False, layout(("gpu0", [2]))),
    ("iGPU + dGPU numGPU 999", MIXED, [100] * 4, 999, False, layout(("gpu0", [0]), ("gpu1", [1, 2, 3]))),
]


def test_fit_gpu_table_has_all_21_cases() -> None:
    assert len(FIT_GPU_CASES) == 21
    assert len({case[0] for case in FIT_GPU_CASES}) == 21


@pytest.mark.parametrize(
    "gpus, layers_mib, num_gpu, require_full, expected",
    [case[1:] for case in FIT_GPU_CASES],
    ids=[case[0] for case in FIT_GPU_CASES],
)
def test_llm_server_fit_gpu(gpus, layers_mib, num_gpu, require_full, expected) -> None:
    layers = [size * MIB for size in layers_mib]
    memory = report(gpus, layers)

    def run() -> GPULayersList:
        return create_layout(SYSTEM, gpus, memory, require_full, 0, num_gpu=num_gpu, darwin=False)

    if isinstance(expected, type):
        with pytest.raises(expected) as err:
            run()
        assert str(err.value) == "unable to load full model on GPU"
        return
    result = run()
    assert placed(result) == placed(expected)
    assert result.hash() == expected.hash()


# --- the first guess, before the runner has reported anything (ollamaServer.Load, step 1) ---


@pytest.mark.parametrize(
    "num_gpu, expected",
    [(-1, [0, 1, 2, 3, 4]), (2, [2, 3]), (0, [])],
)
def test_first_guess_uses_the_largest_discrete_gpu(num_gpu: int, expected: list[int]) -> None:
    gpus = [gpu("small", 2 * GIB), gpu("igpu", 64 * GIB, integrated=True), gpu("big", 8 * GIB)]
    result = create_layout(SYSTEM, gpus, BackendMemory.unknown(5), False, 0, num_gpu=num_gpu, darwin=False)
    assert placed(result) == ([(DeviceID("big"), expected)] if expected else [])


# --- what is reserved on each GPU ---


def test_minimum_memory_overhead_and_graph_are_reserved() -> None:
    layers = [100 * MIB] * 3
    gpus = [gpu("gpu0", 300 * MIB + MIN + 50 * MIB)]

    fits = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, darwin=False)
    assert placed(fits) == [(DeviceID("gpu0"), [0, 1, 2])]

    # 50 MiB of OLLAMA_GPU_OVERHEAD is exactly the slack. One byte more still fits, because free memory
    # is rounded to float32 (32-byte steps at this size) as in Go; 64 bytes more cost a layer.
    for overhead, fitted in [(50 * MIB, 3), (50 * MIB + 1, 3), (50 * MIB + 64, 2)]:
        memory = report(gpus, layers)
        result = create_layout(SYSTEM, gpus, memory, False, 0, gpu_overhead=overhead, darwin=False)
        assert result.sum() == fitted, overhead

    # A reported compute graph is reserved the same way (and also counts toward the GPU's VRAM).
    memory = report(gpus, layers)
    memory.gpus[0].graph = 50 * MIB + 64
    assert placed(create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)) == [(DeviceID("gpu0"), [0, 1])]


def test_byte_exact_room_on_small_numbers() -> None:
    """Layers of a few bytes, where float32 is exact: free memory minus the reserve is the room, to the byte."""
    exact = [gpu("gpu0", MIN + 300)]
    assert create_layout(SYSTEM, exact, report(exact, [100] * 3), False, 0, darwin=False).sum() == 3
    assert create_layout(SYSTEM, exact, report(exact, [100] * 3), False, 0, gpu_overhead=1, darwin=False).sum() == 2
    # a GPU with no more than its reserve, or one the runner does not report, has no room at all
    reserve_only = [gpu("gpu0", MIN)]
    assert create_layout(SYSTEM, reserve_only, report(reserve_only, [1] * 3), False, 0, darwin=False).sum() == 0
    unseen = [gpu("seen", MIN + 1), gpu("unseen", 10 * GIB)]
    result = create_layout(SYSTEM, unseen, report(unseen[:1], [1] * 3), False, 0, darwin=False)
    assert placed(result) == [(DeviceID("seen"), [1])]  # not all fit: the output layer stays behind


def test_metal_sets_aside_512_mib() -> None:
    layers = [100 * MIB] * 2
    gpus = [gpu("0", 200 * MIB + MIN, library="Metal")]
    assert create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, darwin=False).sum() == 1
    gpus = [gpu("0", 200 * MIB + 512 * MIB, library="Metal")]
    assert create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, darwin=False).sum() == 2


def test_backoff_holds_back_a_float32_fraction_of_free_memory() -> None:
    free = 1000 * MIB + MIN
    gpus = [gpu("gpu0", free)]
    layers = [100 * MIB] * 10
    # The load loop adds 0.1 per failed attempt in float32: ten steps give 1.0000001.
    backoff = np.float32(0)
    for _ in range(3):
        backoff += np.float32(0.1)
    held_back = int(np.float32(free) * backoff)
    usable = free - held_back - MIN
    result = create_layout(SYSTEM, gpus, report(gpus, layers), False, backoff, darwin=False)
    assert result.sum() == usable // (100 * MIB)
    assert result.sum() == 5  # 1457 MiB * 0.3 = 437 MiB held back; 563 MiB usable


def test_gpu_not_reported_by_runner_gets_nothing() -> None:
    gpus = [gpu("seen", 100 * MIB + MIN), gpu("unseen", 10 * GIB)]
    layers = [50 * MIB] * 4
    memory = report(gpus[:1], layers)
    result = create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)
    assert placed(result) == [(DeviceID("seen"), [1, 2])]


def test_gpu_with_a_graph_keeps_being_used() -> None:
    # Everything fits on gpu1 alone, but gpu0 (sorted after it) already holds a graph from the last
    # attempt, so the layout starts from the two-GPU prefix and balances the layers by free memory.
    gpus = [gpu("gpu1", 4 * GIB + MIN), gpu("gpu0", 2 * GIB + MIN)]
    layers = [100 * MIB] * 4
    memory = report(gpus, layers)
    result = create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)
    assert placed(result) == [(DeviceID("gpu1"), [0, 1, 2, 3])]

    memory.gpus[1].graph = 1
    result = create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)
    assert placed(result) == [(DeviceID("gpu1"), [0, 1, 2]), (DeviceID("gpu0"), [3])]


def test_first_library_wins_a_tie() -> None:
    gpus = [gpu("a", 256 * MIB + MIN, "Vulkan"), gpu("b", 256 * MIB + MIN, "CUDA")]
    result = create_layout(SYSTEM, gpus, report(gpus, [50 * MIB] * 3), False, 0, darwin=False)
    assert placed(result) == [(DeviceID("a", "Vulkan"), [0, 1, 2])]


def test_sched_spread_uses_all_gpus() -> None:
    gpus = [gpu("gpu0", 4 * GIB + MIN), gpu("gpu1", 4 * GIB + MIN)]
    layers = [100 * MIB] * 4
    packed = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, darwin=False)
    assert len(placed(packed)) == 1
    spread = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, sched_spread=True, darwin=False)
    assert placed(spread) == [(DeviceID("gpu0"), [0, 1]), (DeviceID("gpu1"), [2, 3])]


def test_sched_spread_treats_an_integrated_gpu_like_a_discrete_one() -> None:
    # Packed, the discrete GPU takes all four layers; spread, both GPUs are one group and share them.
    gpus = [gpu("d", GIB + MIN), gpu("i", GIB + MIN, integrated=True)]
    layers = [100 * MIB] * 4
    packed = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, darwin=False)
    assert placed(packed) == [(DeviceID("d"), [0, 1, 2, 3])]
    spread = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, sched_spread=True, darwin=False)
    assert spread.sum() == 4 and len(placed(spread)) == 2


def test_sched_spread_forces_an_explicit_num_gpu_unless_full_offload_is_required() -> None:
    gpus = [gpu("gpu0", 100 * MIB + MIN), gpu("gpu1", 100 * MIB + MIN)]
    layers = [100 * MIB] * 4
    forced = create_layout(SYSTEM, gpus, report(gpus, layers), False, 0, num_gpu=999, sched_spread=True,
                           darwin=False)
    assert forced.sum() == 4
    with pytest.raises(LoadRequiredFullError):
        create_layout(SYSTEM, gpus, report(gpus, layers), True, 0, num_gpu=999, sched_spread=True, darwin=False)


def test_forced_request_far_over_capacity_terminates() -> None:
    # num_gpu=999 forces 20 GiB onto 1 GiB: the capacity factor converges near 20, where float32 cannot
    # resolve 1e-6 any more. Ollama's loop would spin; ours stops with the same layout.
    gpus = [gpu("gpu0", GIB + MIN)]
    layers = [GIB] * 20
    system = SystemInfo(total_memory=64 * GIB, free_memory=32 * GIB)
    result = create_layout(system, gpus, report(gpus, layers), False, 0, num_gpu=999, darwin=False)
    assert placed(result) == [(DeviceID("gpu0"), list(range(20)))]


# --- system memory checks (verifyLayout) ---


def test_cpu_part_must_fit_in_free_memory_plus_swap() -> None:
    layers = [300 * MIB, 300 * MIB, 200 * MIB]
    with pytest.raises(InsufficientSystemMemoryError) as err:
        create_layout(SYSTEM, [], report([], layers), False, 0, darwin=False)
    assert str(err.value) == "model requires more system memory (800.0 MiB) than is available (768.0 MiB)"


def test_input_weights_and_cpu_graph_count_as_system_memory() -> None:
    memory = report([], [100 * MIB] * 2)
    memory.input_weights = 468 * MIB
    memory.cpu.graph = 100 * MIB  # 768 MiB in all: exactly free memory plus swap
    assert create_layout(SYSTEM, [], memory, False, 0, darwin=False) == GPULayersList()
    memory.cpu.graph += 1
    with pytest.raises(InsufficientSystemMemoryError, match=r"\(768.0 MiB\) than is available \(768.0 MiB\)"):
        create_layout(SYSTEM, [], memory, False, 0, darwin=False)


def test_darwin_has_no_swap_check() -> None:
    layers = [300 * MIB, 300 * MIB, 200 * MIB]
    assert create_layout(SYSTEM, [], report([], layers), False, 0, darwin=True) == GPULayersList()


def test_darwin_drops_offload_larger_than_system_memory() -> None:
    gpus = [gpu("0", 4 * GIB + 512 * MIB, library="Metal")]
    small = report(gpus, [300 * MIB] * 3)
    assert create_layout(SYSTEM, gpus, small, False, 0, darwin=True).sum() == 3
    large = report(gpus, [400 * MIB] * 3)  # 1.2 GiB on the GPU, more than the 1 GiB of RAM
    assert create_layout(SYSTEM, gpus, large, False, 0, darwin=True) == GPULayersList()


def test_darwin_counts_the_graphs_of_the_gpus_in_use() -> None:
    """Unified memory: the offloaded layers and the GPU's compute graph together must fit in system memory."""
    gpus = [gpu("0", 4 * GIB + 512 * MIB, library="Metal")]
    memory = report(gpus, [300 * MIB] * 3)
    memory.gpus[0].graph = 124 * MIB  # 900 MiB of layers + 124 MiB: exactly the 1 GiB of RAM
    assert create_layout(SYSTEM, gpus, memory, False, 0, darwin=True).sum() == 3
    memory.gpus[0].graph += 1
    assert create_layout(SYSTEM, gpus, memory, False, 0, darwin=True) == GPULayersList()
    # the CPU's graph stays in system memory either way: it is not part of the offload
    memory.gpus[0].graph, memory.cpu.graph = 0, 200 * MIB
    assert create_layout(SYSTEM, gpus, memory, False, 0, darwin=True).sum() == 3


def test_require_full_rejects_cpu_part_over_free_memory() -> None:
    gpus = [gpu("gpu0", 4 * GIB + MIN)]
    memory = report(gpus, [100 * MIB] * 3)
    memory.input_weights = 512 * MIB + 1
    with pytest.raises(LoadRequiredFullError) as err:
        create_layout(SYSTEM, gpus, memory, True, 0, darwin=False)
    assert str(err.value) == (
        "model requires more system memory than is currently available unable to load full model on GPU"
    )
    # Without require_full only free memory plus swap matters.
    assert create_layout(SYSTEM, gpus, memory, False, 0, darwin=False).sum() == 3
    memory.input_weights = 512 * MIB  # exactly the free memory: that still fits
    assert create_layout(SYSTEM, gpus, memory, True, 0, darwin=False).sum() == 3


def test_require_full_accepts_explicit_num_gpu_when_met() -> None:
    gpus = [gpu("gpu0", 256 * MIB + MIN)]
    memory = report(gpus, [100 * MIB] * 4)
    result = create_layout(SYSTEM, gpus, memory, True, 0, num_gpu=2, darwin=False)
    assert placed(result) == [(DeviceID("gpu0"), [1, 2])]
    with pytest.raises(LoadRequiredFullError):
        create_layout(SYSTEM, gpus, memory, True, 0, num_gpu=3, darwin=False)


def test_require_full_with_num_gpu_zero_runs_on_the_cpu() -> None:
    """num_gpu = 0 asks for no layer on a GPU, so an empty layout meets it, even when full offload is required."""
    gpus = [gpu("gpu0", 4 * GIB + MIN)]
    assert create_layout(SYSTEM, gpus, report(gpus, [100 * MIB] * 3), True, 0, num_gpu=0, darwin=False) == []


def test_the_platform_decides_the_system_memory_check_by_default() -> None:
    memory = report([], [300 * MIB, 300 * MIB, 200 * MIB])  # over free memory plus swap
    if sys.platform == "darwin":
        assert create_layout(SYSTEM, [], memory, False, 0) == GPULayersList()
    else:
        with pytest.raises(InsufficientSystemMemoryError):
            create_layout(SYSTEM, [], memory, False, 0)


def test_mismatched_report_is_a_clear_error() -> None:
    gpus = [gpu("gpu0", GIB)]
    memory = report(gpus, [MIB] * 3)
    memory.gpus[0].weights = [0]
    memory.gpus[0].name = "CUDA0"
    with pytest.raises(ValueError, match="'CUDA0' has 1 weights and 3 cache entries, want 3"):
        create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)
    memory.gpus[0].weights, memory.gpus[0].cache = [0] * 3, [0] * 4
    with pytest.raises(ValueError, match="'CUDA0' has 3 weights and 4 cache entries, want 3"):
        create_layout(SYSTEM, gpus, memory, False, 0, darwin=False)
