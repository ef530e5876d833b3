"""A vision model's memory report: the text model's with its vision tower's folded in, device by device.

Ollama's Go engine placed a tower's tensors with the output layer (ml/backend/ggml: `v.*`, `mm.*` on the output
layer's buffer type) and reserved the image graph in the same scheduler as the text graph, so one buffer per
device holds the larger of the two. We report it the same way, so that every parent's arithmetic holds: the
tower's weights in the output layer's entry of the device the tower is on, and per device the larger graph.
The runner computes the image graphs on the text model's scheduler (VisionModel.compute_with), so that is true
of the buffers too. Beside that, each device says which part is the tower's (`vision_weights`, `vision_graph`):
`plan` and the memory log show them as rows of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ollama_engine.ml import BackendMemory, DeviceID, GPULayers
from ollama_engine.ml.memory import DeviceMemory


def with_tower(text: BackendMemory, tower: BackendMemory, image_graph: Mapping[DeviceID, int],
               shared: bool) -> BackendMemory:
    """The text model's report (not changed) with the tower's weights and its image graph (`image_graph`: what the
    worst-case image graph needs per device) on their devices. shared: the image graph runs on the text model's
    scheduler, whose buffers the text report already sizes for the larger of the two; else it has buffers of its
    own, added to the device's graph."""
    combined = dataclasses.replace(text, cpu=_copy(text.cpu), gpus=[_copy(gpu) for gpu in text.gpus])
    devices = {device.device_id: device for device in [combined.cpu, *combined.gpus]}
    for part in [tower.cpu, *tower.gpus]:
        weights = sum(part.weights) + (tower.input_weights if part is tower.cpu else 0)
        if weights:
            device = _device(devices, part.device_id)
            device.weights[-1] += weights
            device.vision_weights += weights
    for device_id, size in image_graph.items():
        device = _device(devices, device_id)
        device.vision_graph = size
        device.graph = max(device.graph, size) if shared else device.graph + size
    return combined


def _device(devices: Mapping[DeviceID, DeviceMemory], device_id: DeviceID) -> DeviceMemory:
    if device_id not in devices:  # both backends enumerate the same devices in one process
        raise ValueError(f"the vision tower is on {device_id}, which the text model's report does not list")
    return devices[device_id]


def _copy(device: DeviceMemory) -> DeviceMemory:
    return dataclasses.replace(device, weights=list(device.weights), cache=list(device.cache))


def output_device(gpu_layers: Sequence[GPULayers], block_count: int) -> DeviceID | None:
    """The GPU holding the text model's output layer (index block_count), where the tower goes; None: the CPU."""
    return next((entry.device_id for entry in gpu_layers if block_count in entry.layers), None)
