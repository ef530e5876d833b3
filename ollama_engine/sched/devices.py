"""get_gpu_fn for serve: the GPUs ggml sees, asked once of a model-less runner (serve holds no GPU context).

Ollama discovers GPUs the same way. Free memory is refreshed through NVML for NVIDIA GPUs on every call; for
the others the scheduler subtracts what loaded runners report (update_free_space).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from ollama_engine.llm.discovery import _nvml_refreshed, discover_gpus
from ollama_engine.llm.runner_handle import RunnerHandle
from ollama_engine.ml.memory import DeviceInfo

from .types import RunnerRef

log = logging.getLogger(__name__)

GGML_LIB_DIR = Path(__file__).resolve().parent.parent / "ggml" / "lib"  # where build_ggml.py installs ggml
_GPU_BACKEND = re.compile(r"libggml-(cuda|hip|vulkan|metal|sycl|opencl|musa|cann)\b")


def gpu_backends_built() -> bool:
    """Whether ggml was built with any GPU backend; without one there is nothing to ask a runner."""
    try:
        return any(_GPU_BACKEND.match(path.name) for path in GGML_LIB_DIR.iterdir())
    except OSError:
        return False


class GpuDiscovery:
    def __init__(self, rpc_servers: Sequence[str] = ()) -> None:
        self.rpc_servers = tuple(rpc_servers)  # their devices count as GPUs
        self._gpus: list[DeviceInfo] | None = None
        self._lock = asyncio.Lock()

    async def __call__(self, runners: list[RunnerRef]) -> list[DeviceInfo]:
        async with self._lock:
            if self._gpus is None:
                asked = gpu_backends_built() or bool(self.rpc_servers)
                self._gpus = await asyncio.to_thread(self._discover) if asked else []
                log.info("discovered gpus count=%d", len(self._gpus))
        return [
            _nvml_refreshed(gpu) if gpu.device_id.library == "CUDA" else dataclasses.replace(gpu)
            for gpu in self._gpus
        ]

    def _discover(self) -> list[DeviceInfo]:
        with RunnerHandle.start("", rpc_servers=self.rpc_servers) as runner:
            runner.wait_launched()
            return discover_gpus(runner)
