"""The compute devices ggml enumerates, described the way the runner reports them.

The devices of the ggml RPC servers that OLLAMA_RPC_SERVERS (or use_rpc_servers) names join them as GPUs of the
library "RPC", each with the id `host:port` (`host:port#N` for a server's device N > 0) and the memory its server
reports, so that the layout places layers on other hosts as it does on GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from ollama_engine import envconfig
from ollama_engine.ggml import backend as ggml_backend
from ollama_engine.ggml import rpc

from .memory import DeviceID, GPULayers

RPC_LIBRARY = "RPC"


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

    def supports_flash_attention(self) -> bool:
        return self.kind == "CPU" or ggml_backend.supports_flash_attention(self.handle)

    def matches(self, device_id: DeviceID) -> bool:
        return self.id == device_id.id and self.library == device_id.library


_rpc_servers: tuple[str, ...] | None = None  # use_rpc_servers' choice; None: OLLAMA_RPC_SERVERS


def use_rpc_servers(servers: Sequence[str]) -> None:
    """The RPC servers whose devices join this process's (a command's --rpc-servers), instead of
    OLLAMA_RPC_SERVERS. ggml registers them for the whole process, so this must come before devices()."""
    global _rpc_servers
    if devices.cache_info().currsize:
        raise RuntimeError("the devices are already enumerated: choose the RPC servers before")
    _rpc_servers = tuple(servers)


@cache
def devices() -> tuple[Device, ...]:
    """All devices, once per process; ids are the ggml device id, or the ordinal within the library.

    Raises rpc.RpcError (and caches nothing) when one of the RPC servers cannot be used.
    """
    servers = envconfig.rpc_servers() if _rpc_servers is None else _rpc_servers
    for endpoint in rpc.parse_endpoints(",".join(servers)):
        rpc.add_server(endpoint)
    found: list[Device] = []
    per_library: dict[str, int] = {}
    for props in ggml_backend.devices():
        remote = props.library == RPC_LIBRARY  # ggml describes an RPC device by its server's host:port
        key = props.description if remote else props.library
        ordinal = per_library.get(key, 0)
        per_library[key] = ordinal + 1
        device_id, name = props.device_id or str(ordinal), props.name
        if remote:
            device_id = props.description if ordinal == 0 else f"{props.description}#{ordinal}"
            name = f"RPC[{device_id}]"
        found.append(
            Device(
                handle=props.handle,
                id=device_id,
                library=props.library,
                name=name,
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


def on_first_gpu(total_layers: int, count: int | None = None) -> list[GPULayers]:
    """The last `count` of a model's layers (all when None; the output layer counts as one, as Ollama's) on the
    first GPU, as llama.cpp's -ngl places them; empty on a machine without one."""
    gpus = gpu_devices()
    count = total_layers if count is None else count
    return [GPULayers(gpus[0].device_id, list(range(total_layers - count, total_layers)))] if gpus else []


def serve_rpc(host: str, port: int, threads: int = 0) -> None:
    """Serve this machine's GPUs (its CPU when it has none) to other hosts' runners, until interrupted.

    ggml's server has no authentication: anyone who reaches the port can read and write its memory.
    Its loop runs in a daemon thread so that Ctrl-C still reaches Python; it returns only by raising.
    """
    import sys
    import threading


    local = ggml_backend.devices()
    served = [d.handle for d in local if d.type != "CPU"] or [d.handle for d in local if d.type == "CPU"]
    if not host.startswith("127."):  # ggml listens on IPv4 addresses only
        print(f"warning: serving on {host}:{port}: ggml's RPC server has no authentication or encryption, "
              "expose it only to hosts you trust", file=sys.stderr)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            rpc.serve(host, port, served, threads or default_threads())
        except BaseException as err:  # handed to the main thread
            failure.append(err)

    thread = threading.Thread(target=run, name="rpc-server", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    raise failure[0]


def default_threads() -> int:
    """Physical cores are what ggml scales with; without that information use every visible CPU."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
