"""The parent's handle on one runner subprocess: start it, talk to it over HTTP, notice that it died, kill it.

Mirrors the process side of Ollama's llm/server.go (f63eea3d): the runner is `<python> -m ollama_engine runner
--model PATH --port N` on a free loopback port; its stderr is scanned for error lines so that a failure can be
explained with the runner's own words rather than an exit code.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ollama_engine.envconfig import PARENT_DEATH_SIGNAL_ENV, PARENT_PID_ENV
from ollama_engine.ml.memory import BackendMemory, DeviceInfo
from ollama_engine.server.wire import ServerStatus

log = logging.getLogger(__name__)

# Lines of the runner's stderr that explain a failure (Ollama's StatusWriter prefixes).
ERROR_PREFIXES = (
    "panic:", "error:", "Error:", "CUDA error", "ROCm error", "cudaMalloc failed", "GGML_ASSERT",
    "error loading model", "llama_init_from_model:", "mlx:", "MLX:",
)
MAX_ERROR_BYTES = 8 * 1024
LOAD_FAILED = (
    "model failed to load, this may be due to resource limitations or an internal error, check ollama server "
    "logs for details"
)


class RunnerError(Exception):
    """The runner failed, exited, or answered with an error."""


class StatusWriter:
    """Keeps the runner's error lines (capped at 8 KiB) while the process runs."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def write_line(self, line: str) -> None:
        line = line.rstrip("\n")
        if not line.startswith(ERROR_PREFIXES):
            return
        with self._lock:
            self._lines.append(line)
            while len("\n".join(self._lines).encode()) > MAX_ERROR_BYTES and len(self._lines) > 1:
                self._lines.pop(0)

    @property
    def last_error(self) -> str:
        with self._lock:
            return "\n".join(self._lines)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def visible_devices_env(gpus: Sequence[DeviceInfo], must_filter: bool = False) -> dict[str, str]:
    """Environment that shows the runner only these GPUs (Ollama's GetDevicesEnv).

    ROCm is always filtered; CUDA only on request (ids change under filtering); Vulkan never.
    """
    env: dict[str, str] = {}
    by_variable = {"ROCm": "ROCR_VISIBLE_DEVICES"} | ({"CUDA": "CUDA_VISIBLE_DEVICES"} if must_filter else {})
    for gpu in gpus:
        variable = by_variable.get(gpu.device_id.library)
        if variable is not None:
            ids = [value for value in env.get(variable, "").split(",") if value]
            env[variable] = ",".join([*ids, gpu.filter_id or gpu.device_id.id])
    return env


def parent_env() -> dict[str, str]:
    """What a runner needs to end with this process: its pid, and whether the kernel may signal the runner
    when the spawning thread ends (only the main thread's end is this process's end)."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_PID_ENV: str(os.getpid()), PARENT_DEATH_SIGNAL_ENV: "1" if main else "0"}


def runner_command(model_path: str, port: int, rpc_servers: Sequence[str] = ()) -> list[str]:
    """The runner's command line."""
    command = [sys.executable, "-m", "ollama_engine", "runner", "--model", str(model_path), "--port", str(port)]
    if rpc_servers:
        command += ["--rpc-servers", ",".join(rpc_servers)]
    return command


class RunnerHandle:
    """One running `ollama-engine runner` process and its HTTP API."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port
        self.status = StatusWriter()
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_thread.start()

    @classmethod
    def start(cls, model_path: str, env: Mapping[str, str] | None = None, port: int | None = None,
              rpc_servers: Sequence[str] = ()) -> RunnerHandle:
        """Spawn the runner; `env` is added to this process's environment (e.g. visible devices);
        `rpc_servers`: ggml RPC servers whose devices it uses as GPUs (else its OLLAMA_RPC_SERVERS)."""
        port = port or free_port()
        command = runner_command(model_path, port, rpc_servers)
        log.info("starting runner cmd=%r", command)
        try:
            process = subprocess.Popen(
                command, env={**os.environ, **(env or {}), **parent_env()}, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as err:
            raise RunnerError(f"error starting runner: {err}") from err
        return cls(process, port)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace")
            self.status.write_line(line)
            log.debug("runner: %s", line.rstrip())

    # ------------------------------------------------------------ process state

    def exited(self) -> bool:
        return self.process.poll() is not None

    def exit_reason(self) -> str:
        """The runner's last error lines, or else its exit code."""
        self._stderr_thread.join(timeout=1)  # the last lines arrive just after the exit
        return self.status.last_error or f"exit code {self.process.returncode}"

    def close(self) -> None:
        """Kill the runner and wait for it; safe to call twice."""
        if not self.exited():
            self.process.kill()
        self.process.wait()
        self._stderr_thread.join(timeout=1)

    def __enter__(self) -> RunnerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 600) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def health(self, timeout: float = 0.2) -> tuple[ServerStatus, float]:
        """(status, load progress); raises OSError when the runner does not answer."""
        status, body = self._request("GET", "/health", timeout=timeout)
        if status != 200:
            raise RunnerError(f"health check failed: {body.decode(errors='replace').strip()}")
        data = json.loads(body)
        return ServerStatus(data["status"]), float(data["progress"])

    def wait_launched(self, timeout: float = 60) -> None:
        """Poll /health every 10 ms until the runner answers."""
        deadline = time.monotonic() + timeout
        while True:
            if self.exited():
                raise RunnerError(f"llama runner process has terminated: {self.exit_reason()}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RunnerError("timed out waiting for llama runner to start") from None
                time.sleep(0.01)

    def info(self) -> list[DeviceInfo]:
        """The GPUs the runner's ggml sees."""
        status, body = self._request("GET", "/info", timeout=60)
        if status != 200:
            raise RunnerError(body.decode(errors="replace").strip())
        return [DeviceInfo.from_json(item) for item in json.loads(body) or []]

    def load(self, request: Mapping[str, Any]) -> tuple[bool, BackendMemory]:
        """POST /load; (Success, Memory). An HTTP error raises with the runner's message."""
        try:
            status, body = self._request("POST", "/load", dict(request))
        except OSError as err:
            log.error("do load request: %s", err)
            raise RunnerError(LOAD_FAILED) from err
        if status >= 400:
            raise RunnerError(body.decode(errors="replace").strip())
        data = json.loads(body)
        return bool(data["Success"]), BackendMemory.from_json(data.get("Memory") or {})

    def wait_until_running(
        self, stall_timeout: float = 300, on_progress: Callable[[float], None] | None = None
    ) -> None:
        """Wait for the weights to load; the stall timer restarts whenever progress moves."""
        start = time.monotonic()
        last_progress, stalled_since = -1.0, start
        while True:
            if self.exited():
                raise RunnerError(f"llama runner process has terminated: {self.exit_reason()}")
            try:
                status, progress = self.health()
            except OSError:
                status, progress = ServerStatus.NOT_RESPONDING, last_progress
            if status == ServerStatus.READY:
                log.info("llama runner started in %0.2f seconds", time.monotonic() - start)
                if on_progress is not None and last_progress < 1:
                    on_progress(1.0)
                return
            if progress != last_progress:
                last_progress, stalled_since = progress, time.monotonic()
                if on_progress is not None and progress >= 0:
                    on_progress(progress)
            elif time.monotonic() - stalled_since > stall_timeout:
                message = f"timed out waiting for llama runner to start - progress {last_progress:0.2f}"
                raise RunnerError(f"{message} - {self.status.last_error}" if self.status.last_error else message)
            time.sleep(0.25)

    def completion(self, prompt: str, options: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """Stream /completion: one dict per line, the last with done=True."""
        return completion_lines(self.port, prompt, options)


def completion_lines(port: int, prompt: str, options: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """/completion of the runner on loopback `port`: one dict per line, the last with done=True."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        body = {"Prompt": prompt, "Options": dict(options), "Shift": True, "Truncate": True}
        connection.request("POST", "/completion", body=json.dumps(body).encode())
        response = connection.getresponse()
        if response.status != 200:
            raise RunnerError(response.read().decode(errors="replace").strip())
        while line := response.readline():
            yield json.loads(line)
    finally:
        connection.close()
