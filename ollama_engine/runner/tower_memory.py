"""A vision model's memory report: the text model's with its vision tower's folded in, device by device.

Ollama's Go engine placed a tower's tensors with the output layer (ml/backend/ggml: `v.*`, `mm.*` on the output
layer's buffer type) and reserved the image graph in the same scheduler as the text graph, so one buffer per
device holds the larger of the two. We report it the same way, so that every parent's arithmetic holds: the
tower's weights in the output layer's entry of the device the tower is on, and per device the larger graph.
Beside that, each device says which part is the tower's (`vision_weights`, `vision_graph`): `plan` and the
memory log show them as rows of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ollama_engine.ml import BackendMemory, DeviceID, GPULayers
from ollama_engine.ml.memory import DeviceMemory


def with_tower(text: BackendMemory, tower: BackendMemory) -> BackendMemory:
    """The text model's report (not changed) with the tower's weights and image graph on their devices."""
    combined = dataclasses.replace(text, cpu=_copy(text.cpu), gpus=[_copy(gpu) for gpu in text.gpus])
    devices = {device.device_id: device for device in [combined.cpu, *combined.gpus]}
    for part in [tower.cpu, *tower.gpus]:
        weights = sum(part.weights) + (tower.input_weights if part is tower.cpu else 0)
        if not weights and not part.graph:
            continue
        device = devices.get(part.device_id)
        if device is None:  # a device the text model's backend does not see: cannot happen in one process
            raise ValueError(f"the vision tower is on {part.name or part.device_id}, which the model does not use")
        if device.weights:
            device.weights[-1] += weights
        device.vision_weights += weights
        device.vision_graph = max(device.vision_graph, part.graph)
        device.graph = max(device.graph, part.graph)
    return combined


def _copy(device: DeviceMemory) -> DeviceMemory:
    return dataclasses.replace(device, weights=list(device.weights), cache=list(device.cache))


def output_device(gpu_layers: Sequence[GPULayers], block_count: int) -> DeviceID | None:
    """The GPU holding the text model's output layer (index block_count), where the tower goes; None: the CPU."""
    return next((entry.device_id for entry in gpu_layers if block_count in entry.layers), None)
