"""The compute devices ggml enumerates, described the way the runner reports them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ollama_engine.ggml import backend as ggml_backend

from .memory import DeviceID


@dataclass(frozen=True)
class Device:
    """A ggml device: the CPU, a GPU, an integrated GPU or an accelerator."""

    handle: object
    id: str
    library: str
    name: str
    description: str
    kind: str  # "CPU", "GPU", "IGPU" or "ACCEL"
    total_memory: int

    @property
    def device_id(self) -> DeviceID:
        return DeviceID(id=self.id, library=self.library)

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("GPU", "IGPU")

    @property
    def buffer_type(self):
        return ggml_backend.default_buffer_type(self.handle)

    def free_memory(self) -> int:
        return ggml_backend.device_memory(self.handle)[0]

    def matches(self, device_id: DeviceID) -> bool:
        return self.id == device_id.id and self.library == device_id.library


@cache
def devices() -> tuple[Device, ...]:
    """All devices, once per process; ids are the ggml device id, or the ordinal within the library."""
    found: list[Device] = []
    per_library: dict[str, int] = {}
    for props in ggml_backend.devices():
        ordinal = per_library.get(props.library, 0)
        per_library[props.library] = ordinal + 1
        found.append(
            Device(
                handle=props.handle,
                id=props.device_id or str(ordinal),
                library=props.library,
                name=props.name,
                description=props.description,
                kind=props.type,
                total_memory=props.total,
            )
        )
    return tuple(found)


def cpu_device() -> Device:
    return next(d for d in devices() if d.kind == "CPU")


def gpu_devices() -> list[Device]:
    return [d for d in devices() if d.is_gpu]
