"""A real `ollama-engine serve` subprocess for the client tests (the official clients are synchronous)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from ollama_engine.api.serve import create_app
from ollama_engine.envconfig import EnvConfig
from ollama_engine.sched import Scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, process: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    """Until serve at `url` answers; RuntimeError with its log if it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {log.read_text()}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def serve_process(models: Path, **env: str) -> Iterator[str]:
    """Start serve on a free port with OLLAMA_MODELS=models (model names may also be GGUF paths); yield its
    URL; stop it (and its runners)."""
    port = free_port()
    full_env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(models),
                "OLLAMA_ENGINE_MODEL_PATHS": "1", **env}
    log = open(models.parent / f"serve-{port}.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=full_env,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, process, models.parent / f"serve-{port}.log")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@contextlib.asynccontextmanager
async def serving(config: EnvConfig) -> AsyncIterator[tuple[aiohttp.ClientSession, str, Scheduler]]:
    """The serve app in this process (so the test can look at the scheduler), its runners real subprocesses."""
    scheduler = Scheduler(config)
    server = TestServer(create_app(config, scheduler), handler_cancellation=True)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            yield session, str(server.make_url("")), scheduler
    finally:
        await server.close()


async def generate(session: aiohttp.ClientSession, url: str, **body) -> tuple[int, list[dict]]:
    """POST /api/generate; the status and every NDJSON line."""
    async with session.post(url + "/api/generate", json=body) as response:
        text = await response.text()
        return response.status, [json.loads(line) for line in text.splitlines() if line.strip()]


async def eventually(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
