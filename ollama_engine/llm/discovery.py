"""What the layout planner needs to know about the machine: its GPUs (from a runner) and its system memory.

GPUs come from the runner's /info, i.e. what ggml enumerates in that process. ggml's free-memory figure for
CUDA devices is taken when the runner asks; NVML (pynvml) gives a current one, so it is preferred when present.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from ollama_engine.ml.memory import DeviceInfo, SystemInfo

from .runner_handle import RunnerHandle

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def discover_gpus(runner: RunnerHandle) -> list[DeviceInfo]:
    """The runner's GPUs, with NVIDIA free memory refreshed from NVML where it can be."""
    return [_nvml_refreshed(gpu) if gpu.device_id.library == "CUDA" else gpu for gpu in runner.info()]


def _nvml_refreshed(gpu: DeviceInfo) -> DeviceInfo:
    try:
        import pynvml
    except ImportError:
        return gpu
    try:
        pynvml.nvmlInit()
        try:
            # ggml names CUDA devices by PCI bus id when it knows it, otherwise by ordinal
            if ":" in gpu.device_id.id:
                handle = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.device_id.id)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu.device_id.id))
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        finally:
            pynvml.nvmlShutdown()
    except (pynvml.NVMLError, ValueError) as err:
        log.debug("nvml could not refresh gpu %s: %s", gpu.device_id.id, err)
        return gpu
    return dataclasses.replace(gpu, total_memory=int(info.total), free_memory=int(info.free))


def system_info(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP_ROOT) -> SystemInfo:
    """Total and available RAM (a cgroup v2 memory limit wins), free swap, and the CPU count."""
    fields = _meminfo(meminfo)
    total = fields.get("MemTotal", 0)
    free = fields.get("MemAvailable")
    if free is None:
        free = fields.get("MemFree", 0) + fields.get("Buffers", 0) + fields.get("Cached", 0)
    limit, current = _cgroup_value(cgroup / "memory.max"), _cgroup_value(cgroup / "memory.current")
    if limit is not None and current is not None and limit < total:
        total, free = limit, max(limit - current, 0)
    return SystemInfo(
        thread_count=os.cpu_count() or 1, total_memory=total, free_memory=free, free_swap=fields.get("SwapFree", 0)
    )


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo in bytes; empty where there is no such file (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def _cgroup_value(path: Path) -> int | None:
    """A cgroup v2 byte count; None when absent or "max" (unlimited)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
