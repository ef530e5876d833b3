"""What a model needs in memory, per device and per layer, and which layers go to which GPU.

These classes mirror Ollama's `ml/device.go` (commit f63eea3d) because they cross the wire between the
parent and the runner: a `/load` request carries a `GPULayersList`, its response a `BackendMemory`, and
`/info` answers with `DeviceInfo`s. `to_json()` returns the exact dict Go's encoder writes (key names, key
order, `omitempty`, nil slices as null); `from_json()` reads it back.

Per-layer lists (`Weights`, `Cache`) have block_count + 1 entries: the last one is the output layer.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

MIB = 1024**2
GIB = 1024**3

JSON = dict[str, Any]


def human_bytes2(n: int) -> str:
    """Ollama's `format.HumanBytes2` (binary units, one decimal), used in logs and error messages."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _nullable(values: list) -> list | None:
    """Go encodes a nil slice as null; an empty Python list stands for a nil slice."""
    return list(values) if values else None


def _go_list(values: list) -> str:
    """Go's `%v` of a slice: `[1 2 3]`."""
    return "[" + " ".join(str(v) for v in values) + "]"


@dataclass(frozen=True)
class DeviceID:
    """A device as ggml names it. The id is only unique within one library, so both fields identify it."""

    id: str = ""
    library: str = ""  # "CUDA", "ROCm", "Metal", "Vulkan", ...; empty for the CPU

    def to_json(self) -> JSON:
        out: JSON = {"id": self.id}
        if self.library:
            out["backend"] = self.library
        return out

    @classmethod
    def from_json(cls, data: JSON) -> DeviceID:
        return cls(id=data.get("id", ""), library=data.get("backend", ""))

    def go_format(self) -> str:
        return f"{{ID:{self.id} Library:{self.library}}}"


@dataclass
class DeviceMemory:
    """Bytes one device needs: weights and KV cache per layer, plus one compute graph buffer."""

    device_id: DeviceID = field(default_factory=DeviceID)
    name: str = ""  # ggml's device name, e.g. "CUDA0" or "CPU"
    weights: list[int] = field(default_factory=list)
    cache: list[int] = field(default_factory=list)
    graph: int = 0
    # A vision tower on this device (ours, sent only when there is one; Ollama's parent ignores them): its
    # weights, already counted in the output layer's as Ollama's engine counts them, and its worst-case image
    # graph, of which `graph` is the larger with the text graph (one buffer serves both).
    vision_weights: int = 0
    vision_graph: int = 0

    def size(self) -> int:
        return sum(self.weights) + sum(self.cache) + self.graph

    def to_json(self) -> JSON:
        out = {
            **self.device_id.to_json(),
            "Name": self.name,
            "Weights": _nullable(self.weights),
            "Cache": _nullable(self.cache),
            "Graph": self.graph,
        }
        if self.vision_weights or self.vision_graph:
            out.update(VisionWeights=self.vision_weights, VisionGraph=self.vision_graph)
        return out

    @classmethod
    def from_json(cls, data: JSON) -> DeviceMemory:
        return cls(
            device_id=DeviceID.from_json(data),
            name=data.get("Name", ""),
            weights=list(data.get("Weights") or []),
            cache=list(data.get("Cache") or []),
            graph=data.get("Graph", 0),
            vision_weights=data.get("VisionWeights", 0),
            vision_graph=data.get("VisionGraph", 0),
        )

    def go_format(self) -> str:
        """Go's `%+v` of the struct, as it appears in Ollama's error messages."""
        return (
            f"{{DeviceID:{self.device_id.go_format()} Name:{self.name} Weights:{_go_list(self.weights)} "
            f"Cache:{_go_list(self.cache)} Graph:{self.graph}}}"
        )


@dataclass
class BackendMemory:
    """The runner's memory report: what `fit` measured, or what `alloc` got before it failed.

    When an allocation fails the report includes at least the size that was attempted, so the parent can
    always make progress by moving layers elsewhere.
    """

    input_weights: int = 0  # token embeddings and other non-layer tensors: always on the CPU
    cpu: DeviceMemory = field(default_factory=DeviceMemory)
    gpus: list[DeviceMemory] = field(default_factory=list)

    @classmethod
    def unknown(cls, total_layers: int) -> BackendMemory:
        """What the parent assumes before the runner has reported anything: every layer costs nothing.

        Ollama's createLayout substitutes this for a nil report; it has no GPU entries at all.
        """
        return cls(cpu=DeviceMemory(weights=[0] * total_layers, cache=[0] * total_layers))

    def to_json(self) -> JSON:
        return {
            "InputWeights": self.input_weights,
            "CPU": self.cpu.to_json(),
            "GPUs": [gpu.to_json() for gpu in self.gpus] or None,
        }

    @classmethod
    def from_json(cls, data: JSON) -> BackendMemory:
        return cls(
            input_weights=data.get("InputWeights", 0),
            cpu=DeviceMemory.from_json(data.get("CPU") or {}),
            gpus=[DeviceMemory.from_json(gpu) for gpu in data.get("GPUs") or []],
        )

    def go_format(self) -> str:
        gpus = "[" + " ".join(gpu.go_format() for gpu in self.gpus) + "]"
        return f"{{InputWeights:{self.input_weights} CPU:{self.cpu.go_format()} GPUs:{gpus}}}"

    def memory_size(self) -> tuple[int, int]:
        """(total, vram) as `ollama ps` shows them.

        With no layer on the CPU the model counts as fully offloaded, so the CPU-only parts (input
        weights, CPU graph) are counted as VRAM too.
        """
        vram = sum(gpu.size() for gpu in self.gpus)
        total = self.input_weights + self.cpu.size() + vram
        if not any(self.cpu.weights) and not any(self.cpu.cache):
            vram += self.input_weights + self.cpu.graph
        return total, vram

    def summary(self) -> list[tuple[str, str, int]]:
        """(what, device name, bytes) rows in the order of Ollama's `BackendMemory.Log`; zero rows omitted."""
        rows: list[tuple[str, str, int]] = []
        for gpu in self.gpus:
            rows.append(("model weights", gpu.name, sum(gpu.weights) - gpu.vision_weights))
        rows.append(("model weights", self.cpu.name, self.input_weights + sum(self.cpu.weights)
                     - self.cpu.vision_weights))
        for device in [*self.gpus, self.cpu]:
            rows.append(("vision weights", device.name, device.vision_weights))
        for gpu in self.gpus:
            rows.append(("kv cache", gpu.name, sum(gpu.cache)))
        rows.append(("kv cache", self.cpu.name, sum(self.cpu.cache)))
        for gpu in self.gpus:
            rows.append(("compute graph", gpu.name, gpu.graph))
        rows.append(("compute graph", self.cpu.name, self.cpu.graph))
        rows = [row for row in rows if row[2] > 0]
        if rows:
            rows.append(("total memory", "", sum(size for _, _, size in rows)))
        return rows

    def table(self) -> str:
        """The summary as aligned text, one row per line."""
        rows = [(what, device, human_bytes2(size)) for what, device, size in self.summary()]
        if not rows:
            return ""
        widths = [max(len(row[col]) for row in rows) for col in range(2)]
        return "\n".join(f"{what:<{widths[0]}}  {device:<{widths[1]}}  {size}" for what, device, size in rows)

    def log(self, logger: logging.Logger, level: int = logging.INFO) -> None:
        for what, device, size in self.summary():
            device_part = f"device={device} " if what != "total memory" else ""
            logger.log(level, '%s %ssize="%s"', what, device_part, human_bytes2(size))


class NoMemory(Exception):
    """An allocation failed; carries the memory report as known at the failure (Ollama's ErrNoMem)."""

    def __init__(self, memory: BackendMemory) -> None:
        super().__init__(f"insufficient memory - required allocations: {memory.go_format()}")
        self.memory = memory


@dataclass
class GPULayers:
    """The layers one GPU holds."""

    device_id: DeviceID = field(default_factory=DeviceID)
    layers: list[int] = field(default_factory=list)

    def first_layer(self) -> int:
        """The lowest layer index, or sys.maxsize when empty (so empty entries sort last)."""
        return min(self.layers, default=sys.maxsize)

    def __str__(self) -> str:
        if not self.layers:
            return ""
        layers = sorted(self.layers)
        if layers == list(range(layers[0], layers[0] + len(layers))):
            return f"ID:{self.device_id.id} Layers:{len(layers)}({layers[0]}..{layers[-1]})"
        return f"ID:{self.device_id.id} Layers:{len(layers)}{_go_list(layers)}"

    def to_json(self) -> JSON:
        return {**self.device_id.to_json(), "Layers": _nullable(self.layers)}

    @classmethod
    def from_json(cls, data: JSON) -> GPULayers:
        return cls(device_id=DeviceID.from_json(data), layers=list(data.get("Layers") or []))


class GPULayersList(list[GPULayers]):
    """A layout: which layers go to which GPU. Layers not listed stay on the CPU."""

    def sum(self) -> int:
        """The number of layers offloaded to GPUs."""
        return sum(len(g.layers) for g in self)

    def hash(self) -> int:
        """Identity of the layout within this process (Python salts string hashes, as Go's maphash is seeded).

        Entry order and layer order count; entries without layers do not.
        """
        return hash(tuple((g.device_id, tuple(g.layers)) for g in self if g.layers))

    def device_ids(self) -> list[DeviceID]:
        """The devices in the layout, in order of first appearance."""
        return list(dict.fromkeys(g.device_id for g in self))

    def __str__(self) -> str:
        entries = _go_list([str(g) for g in self])
        return f"{self.sum()}{entries}" if self.sum() > 0 else entries

    def to_json(self) -> list[JSON]:
        return [g.to_json() for g in self]

    @classmethod
    def from_json(cls, data: list[JSON] | None) -> GPULayersList:
        return cls(GPULayers.from_json(g) for g in data or [])


@dataclass
class DeviceInfo:
    """A GPU as discovered (the runner's `/info`), with its memory as of discovery."""

    device_id: DeviceID = field(default_factory=DeviceID)
    name: str = ""
    description: str = ""
    filter_id: str = ""  # the unfiltered id, when the id is a post-filter ordinal
    integrated: bool = False
    pci_id: str = ""
    total_memory: int = 0
    free_memory: int = 0
    compute_major: int = 0
    compute_minor: int = 0
    driver_major: int = 0
    driver_minor: int = 0
    library_path: list[str] = field(default_factory=list)
    runner_env_overrides: dict[str, str] = field(default_factory=dict)  # never serialized

    def minimum_memory(self) -> int:
        """VRAM set aside per GPU for context structures that no model report accounts for."""
        return 512 * MIB if self.device_id.library == "Metal" else 457 * MIB

    def to_json(self) -> JSON:
        out: JSON = {**self.device_id.to_json(), "name": self.name, "description": self.description}
        if self.filter_id:
            out["filter_id"] = self.filter_id
        if self.integrated:
            out["integration"] = True
        if self.pci_id:
            out["pci_id"] = self.pci_id
        out["total_memory"] = self.total_memory
        if self.free_memory:
            out["free_memory"] = self.free_memory
        out["ComputeMajor"] = self.compute_major
        out["ComputeMinor"] = self.compute_minor
        if self.driver_major:
            out["driver_major"] = self.driver_major
        if self.driver_minor:
            out["driver_minor"] = self.driver_minor
        out["LibraryPath"] = _nullable(self.library_path)
        return out

    @classmethod
    def from_json(cls, data: JSON) -> DeviceInfo:
        return cls(
            device_id=DeviceID.from_json(data),
            name=data.get("name", ""),
            description=data.get("description", ""),
            filter_id=data.get("filter_id", ""),
            integrated=data.get("integration", False),
            pci_id=data.get("pci_id", ""),
            total_memory=data.get("total_memory", 0),
            free_memory=data.get("free_memory", 0),
            compute_major=data.get("ComputeMajor", 0),
            compute_minor=data.get("ComputeMinor", 0),
            driver_major=data.get("driver_major", 0),
            driver_minor=data.get("driver_minor", 0),
            library_path=list(data.get("LibraryPath") or []),
        )


@dataclass
class SystemInfo:
    """Host memory as the layout sees it: free RAM (MemAvailable or the cgroup limit) and free swap."""

    thread_count: int = 0
    total_memory: int = 0
    free_memory: int = 0
    free_swap: int = 0

    def to_json(self) -> JSON:
        pairs = [
            ("threads", self.thread_count),
            ("total_memory", self.total_memory),
            ("free_memory", self.free_memory),
            ("free_swap", self.free_swap),
        ]
        return {key: value for key, value in pairs if value}

    @classmethod
    def from_json(cls, data: JSON) -> SystemInfo:
        return cls(
            thread_count=data.get("threads", 0),
            total_memory=data.get("total_memory", 0),
            free_memory=data.get("free_memory", 0),
            free_swap=data.get("free_swap", 0),
        )


def sort_by_free_memory(gpus: list[DeviceInfo]) -> list[DeviceInfo]:
    """Discrete GPUs first, largest free memory first, then integrated GPUs likewise.

    Go's sort is not stable, so Ollama orders equal GPUs arbitrarily; this sort keeps their input order.
    """
    return sorted(gpus, key=lambda gpu: (gpu.integrated, -gpu.free_memory))


def group_by_library(gpus: list[DeviceInfo]) -> list[list[DeviceInfo]]:
    """GPUs grouped by library, groups in order of first appearance (a model uses one library only)."""
    groups: dict[str, list[DeviceInfo]] = {}
    for gpu in gpus:
        groups.setdefault(gpu.device_id.library, []).append(gpu)
    return list(groups.values())


def group_by_performance(gpus: list[DeviceInfo]) -> list[list[DeviceInfo]]:
    """GPUs grouped into discrete and integrated, groups in order of first appearance."""
    groups: dict[bool, list[DeviceInfo]] = {}
    for gpu in gpus:
        groups.setdefault(gpu.integrated, []).append(gpu)
    return list(groups.values())



# ---------------------------------------------------------------- flash attention


class FlashAttention:
    """The wire's FlashAttention (Ollama's ml.FlashAttentionType): -1 auto, 0 disabled, 1 enabled."""

    AUTO = -1
    DISABLED = 0
    ENABLED = 1


def flash_attention_supported(gpus: list[DeviceInfo] | tuple[DeviceInfo, ...]) -> bool:
    """Ollama's FlashAttentionSupported: every GPU is Metal, ROCm, Vulkan, or CUDA (driver 7+, not compute 7.2)."""
    for gpu in gpus:
        library = gpu.device_id.library
        if library == "CUDA":
            if gpu.driver_major and gpu.driver_major < 7 or (gpu.compute_major, gpu.compute_minor) == (7, 2):
                return False
        elif library not in ("cpu", "CPU", "Metal", "ROCm", "Vulkan", "RPC"):
            return False
    return True


def resolve_flash_attention(setting: bool | None, gpus: list[DeviceInfo] | tuple[DeviceInfo, ...]) -> tuple[int, str]:
    """On or off, and why. setting: OLLAMA_FLASH_ATTENTION (None when unset: auto).

    Auto is on wherever every device supports it: every architecture of models/ attends through
    kvcache.attention, which runs ggml's fused kernel with every cache type. It is also what makes a
    result independent of how a prompt is cut into batches (a prompt-cache hit re-evaluates the last
    token alone): the fused kernel computes each query row by itself, while the matmul path's one-row
    and many-row kernels round differently on some CPUs (README, "Numerics").
    """
    supported = flash_attention_supported(gpus)
    if setting is False:
        return FlashAttention.DISABLED, "off (OLLAMA_FLASH_ATTENTION=false)"
    if not supported:
        return FlashAttention.DISABLED, "off (not supported by every GPU)"
    if setting:
        return FlashAttention.ENABLED, "on (OLLAMA_FLASH_ATTENTION=true)"
    return FlashAttention.ENABLED, "on (auto: supported by every device)"
