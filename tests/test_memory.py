"""Memory report and layout data model: Ollama's wire format (ml/device.go, f63eea3d) and string forms."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from ollama_engine.ml.memory import (
    GIB,
    MIB,
    BackendMemory,
    DeviceID,
    DeviceInfo,
    DeviceMemory,
    GPULayers,
    GPULayersList,
    NoMemory,
    SystemInfo,
    group_by_library,
    group_by_performance,
    human_bytes2,
    sort_by_free_memory,
)


def go_json(value: object) -> str:
    """Compact JSON as Go's encoding/json writes it."""
    return json.dumps(value, separators=(",", ":"))


def sample_memory() -> BackendMemory:
    return BackendMemory(
        input_weights=10,
        cpu=DeviceMemory(name="CPU", weights=[1, 2], cache=[0, 0], graph=3),
        gpus=[DeviceMemory(DeviceID("GPU-1", "CUDA"), "CUDA0", weights=[4, 5], cache=[6, 7], graph=8)],
    )


# --- wire format ---


def test_device_id_omits_empty_backend() -> None:
    assert DeviceID("0").to_json() == {"id": "0"}
    assert DeviceID("GPU-1", "CUDA").to_json() == {"id": "GPU-1", "backend": "CUDA"}
    assert DeviceID.from_json({"id": "0"}) == DeviceID("0", "")


def test_empty_backend_memory_matches_the_close_response() -> None:
    # What Ollama's runner answers to a close operation, byte for byte.
    wire = '{"InputWeights":0,"CPU":{"id":"","Name":"","Weights":null,"Cache":null,"Graph":0},"GPUs":null}'
    assert go_json(BackendMemory().to_json()) == wire
    assert BackendMemory.from_json(json.loads(wire)) == BackendMemory()


def test_backend_memory_wire_keys_and_round_trip() -> None:
    memory = sample_memory()
    assert go_json(memory.to_json()) == (
        '{"InputWeights":10,'
        '"CPU":{"id":"","Name":"CPU","Weights":[1,2],"Cache":[0,0],"Graph":3},'
        '"GPUs":[{"id":"GPU-1","backend":"CUDA","Name":"CUDA0","Weights":[4,5],"Cache":[6,7],"Graph":8}]}'
    )
    assert BackendMemory.from_json(json.loads(go_json(memory.to_json()))) == memory


def test_missing_and_null_fields_decode_to_zero() -> None:
    """Go leaves a missing key at its zero value and decodes null into a struct as nothing."""
    assert BackendMemory.from_json({}) == BackendMemory()
    assert BackendMemory.from_json({"CPU": None, "GPUs": None}) == BackendMemory()
    assert DeviceMemory.from_json({"id": "GPU-1"}) == DeviceMemory(DeviceID("GPU-1"))


def test_gpu_layers_list_wire_format() -> None:
    wire = '[{"id":"GPU-1","backend":"CUDA","Layers":[0,1,2]},{"id":"0","Layers":null}]'
    layout = GPULayersList.from_json(json.loads(wire))
    assert layout == [GPULayers(DeviceID("GPU-1", "CUDA"), [0, 1, 2]), GPULayers(DeviceID("0"), [])]
    assert isinstance(layout, GPULayersList)
    assert go_json(layout.to_json()) == wire
    assert GPULayersList.from_json(None) == GPULayersList()


def test_device_info_wire_format() -> None:
    wire = (
        '{"id":"GPU-5c8c","backend":"CUDA","name":"CUDA0","description":"NVIDIA H100 80GB HBM3",'
        '"pci_id":"0000:01:00.0","total_memory":85029158912,"free_memory":84401192960,'
        '"ComputeMajor":9,"ComputeMinor":0,"driver_major":12,"driver_minor":8,'
        '"LibraryPath":["/usr/lib/ollama","/usr/lib/ollama/cuda_v12"]}'
    )
    info = DeviceInfo.from_json(json.loads(wire))
    assert info.device_id == DeviceID("GPU-5c8c", "CUDA")
    assert (info.total_memory, info.free_memory, info.compute_major, info.driver_minor) == (
        85029158912, 84401192960, 9, 8)
    assert not info.integrated
    assert go_json(info.to_json()) == wire

    integrated = DeviceInfo(DeviceID("0", "Vulkan"), name="Vulkan0", integrated=True, filter_id="1")
    assert integrated.to_json() == {
        "id": "0", "backend": "Vulkan", "name": "Vulkan0", "description": "", "filter_id": "1",
        "integration": True, "total_memory": 0, "ComputeMajor": 0, "ComputeMinor": 0, "LibraryPath": None,
    }
    assert DeviceInfo.from_json(integrated.to_json()) == integrated


def test_system_info_omits_zero_fields() -> None:
    info = SystemInfo(thread_count=8, total_memory=GIB, free_memory=512 * MIB)
    assert info.to_json() == {"threads": 8, "total_memory": GIB, "free_memory": 512 * MIB}
    assert SystemInfo.from_json(info.to_json()) == info
    assert SystemInfo() == SystemInfo.from_json({}) == SystemInfo(0, 0, 0, 0)
    assert SystemInfo().to_json() == {}


def test_device_info_zero_value_is_an_empty_object() -> None:
    assert DeviceInfo() == DeviceInfo.from_json({"id": ""})
    assert DeviceInfo().to_json() == {
        "id": "", "name": "", "description": "", "total_memory": 0, "ComputeMajor": 0, "ComputeMinor": 0,
        "LibraryPath": None,
    }


# --- sizes ---


def test_device_memory_size() -> None:
    assert sample_memory().cpu.size() == 1 + 2 + 3
    assert sample_memory().gpus[0].size() == 4 + 5 + 6 + 7 + 8


def test_memory_size_counts_cpu_parts_as_vram_only_on_full_offload() -> None:
    memory = sample_memory()
    assert memory.memory_size() == (10 + 6 + 30, 30)
    memory.cpu.weights = [0, 0]
    assert memory.memory_size() == (10 + 3 + 30, 30 + 10 + 3)
    memory.cpu.cache = [0, 5]  # every weight on the GPU, but a layer's KV cache on the CPU: partial offload
    assert memory.memory_size() == (10 + 8 + 30, 30)


def test_minimum_memory() -> None:
    assert DeviceInfo(DeviceID("0", "Metal")).minimum_memory() == 512 * MIB
    assert DeviceInfo(DeviceID("GPU-1", "CUDA")).minimum_memory() == 457 * MIB


@pytest.mark.parametrize(
    "size, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (MIB, "1.0 MiB"),
     (1000 * 1024, "1000.0 KiB"), (MIB - 1, "1024.0 KiB"),
     (768 * MIB, "768.0 MiB"), (GIB - 1, "1024.0 MiB"), (7 * GIB + GIB // 2, "7.5 GiB")],
)
def test_human_bytes2(size: int, text: str) -> None:
    assert human_bytes2(size) == text


# --- string forms and identity of layouts ---


@pytest.mark.parametrize(
    "layers, text",
    [([], ""), ([0, 1, 2], "ID:gpu0 Layers:3(0..2)"), ([5], "ID:gpu0 Layers:1(5..5)"),
     ([2, 0, 1], "ID:gpu0 Layers:3(0..2)"), ([0, 2, 5], "ID:gpu0 Layers:3[0 2 5]")],
)
def test_gpu_layers_string(layers: list[int], text: str) -> None:
    assert str(GPULayers(DeviceID("gpu0", "CUDA"), layers)) == text


def test_gpu_layers_list_string_and_sum() -> None:
    layout = GPULayersList([GPULayers(DeviceID("gpu1"), [0]), GPULayers(DeviceID("gpu0"), [1, 2])])
    assert layout.sum() == 3
    assert str(layout) == "3[ID:gpu1 Layers:1(0..0) ID:gpu0 Layers:2(1..2)]"
    assert str(GPULayersList()) == "[]"
    assert str(GPULayersList([GPULayers(DeviceID("gpu0"), [5])])) == "1[ID:gpu0 Layers:1(5..5)]"
    assert GPULayersList().sum() == 0


def test_first_layer() -> None:
    assert GPULayers(DeviceID("gpu0"), [7, 3, 5]).first_layer() == 3
    assert GPULayers(DeviceID("gpu0")).first_layer() == sys.maxsize
    layout = [GPULayers(DeviceID("a")), GPULayers(DeviceID("b"), [4]), GPULayers(DeviceID("c"), [1])]
    assert [g.device_id.id for g in sorted(layout, key=GPULayers.first_layer)] == ["c", "b", "a"]


def test_hash_ignores_empty_entries_but_not_order() -> None:
    def layout(*entries: tuple[str, str, list[int]]) -> GPULayersList:
        return GPULayersList(GPULayers(DeviceID(name, lib), layers) for name, lib, layers in entries)

    base = layout(("gpu1", "", [0]), ("gpu0", "", [1, 2]))
    assert base.hash() == layout(("gpu1", "", [0]), ("x", "", []), ("gpu0", "", [1, 2])).hash()
    assert base.hash() != layout(("gpu0", "", [1, 2]), ("gpu1", "", [0])).hash()
    assert base.hash() != layout(("gpu1", "", [0]), ("gpu0", "", [2, 1])).hash()
    assert base.hash() != layout(("gpu1", "CUDA", [0]), ("gpu0", "", [1, 2])).hash()
    assert GPULayersList().hash() == layout(("gpu0", "", [])).hash()


def test_device_ids_in_order_of_first_appearance() -> None:
    layout = GPULayersList([GPULayers(DeviceID("b"), [0]), GPULayers(DeviceID("a"), [1]),
                            GPULayers(DeviceID("b", "CUDA"), [2]), GPULayers(DeviceID("a"), [3])])
    assert layout.device_ids() == [DeviceID("b"), DeviceID("a"), DeviceID("b", "CUDA")]


# --- errors and logs ---


def test_no_memory_message_is_gos_struct_form() -> None:
    err = NoMemory(sample_memory())
    assert str(err) == (
        "insufficient memory - required allocations: {InputWeights:10 "
        "CPU:{DeviceID:{ID: Library:} Name:CPU Weights:[1 2] Cache:[0 0] Graph:3} "
        "GPUs:[{DeviceID:{ID:GPU-1 Library:CUDA} Name:CUDA0 Weights:[4 5] Cache:[6 7] Graph:8}]}"
    )
    assert err.memory == sample_memory()
    assert str(NoMemory(BackendMemory())).endswith(
        "{InputWeights:0 CPU:{DeviceID:{ID: Library:} Name: Weights:[] Cache:[] Graph:0} GPUs:[]}")


def test_summary_follows_ollamas_log_order() -> None:
    memory = sample_memory()
    memory.gpus.append(DeviceMemory(DeviceID("GPU-2", "CUDA"), "CUDA1", weights=[0, 0], cache=[0, 0]))
    assert memory.summary() == [
        ("model weights", "CUDA0", 9),
        ("model weights", "CPU", 13),
        ("kv cache", "CUDA0", 13),
        ("compute graph", "CUDA0", 8),
        ("compute graph", "CPU", 3),
        ("total memory", "", 46),
    ]
    assert BackendMemory().summary() == []
    one_byte = BackendMemory(cpu=DeviceMemory(name="CPU", graph=1))
    assert one_byte.summary() == [("compute graph", "CPU", 1), ("total memory", "", 1)]


def test_table_and_log(caplog: pytest.LogCaptureFixture) -> None:
    memory = BackendMemory(
        input_weights=GIB,
        cpu=DeviceMemory(name="CPU", weights=[0], cache=[0]),
        gpus=[DeviceMemory(DeviceID("GPU-1", "CUDA"), "CUDA0", [2 * GIB], [512 * MIB], graph=MIB)],
    )
    assert memory.table().splitlines() == [
        "model weights  CUDA0  2.0 GiB",
        "model weights  CPU    1.0 GiB",
        "kv cache       CUDA0  512.0 MiB",
        "compute graph  CUDA0  1.0 MiB",
        "total memory          3.5 GiB",
    ]
    logger = logging.getLogger("test_memory")
    with caplog.at_level(logging.INFO, logger="test_memory"):
        memory.log(logger)
    assert caplog.messages[0] == 'model weights device=CUDA0 size="2.0 GiB"'
    assert caplog.messages[-1] == 'total memory size="3.5 GiB"'


# --- device ordering helpers ---


def test_sort_by_free_memory_puts_discrete_first() -> None:
    gpus = [
        DeviceInfo(DeviceID("i-big"), free_memory=64 * GIB, integrated=True),
        DeviceInfo(DeviceID("small"), free_memory=2 * GIB),
        DeviceInfo(DeviceID("i-small"), free_memory=GIB, integrated=True),
        DeviceInfo(DeviceID("big"), free_memory=8 * GIB),
    ]
    assert [g.device_id.id for g in sort_by_free_memory(gpus)] == ["big", "small", "i-big", "i-small"]


def test_grouping_keeps_order_of_first_appearance() -> None:
    gpus = [
        DeviceInfo(DeviceID("a", "ROCm")),
        DeviceInfo(DeviceID("b", "CUDA"), integrated=True),
        DeviceInfo(DeviceID("c", "ROCm"), integrated=True),
        DeviceInfo(DeviceID("d", "CUDA")),
    ]
    def ids(groups: list[list[DeviceInfo]]) -> list[list[str]]:
        return [[g.device_id.id for g in group] for group in groups]

    assert ids(group_by_library(gpus)) == [["a", "c"], ["b", "d"]]
    assert ids(group_by_performance(gpus)) == [["a", "d"], ["b", "c"]]
