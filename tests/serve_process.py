"""A real `ollama-engine serve` subprocess for the client tests (the official clients are synchronous)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log_text = (models.parent / f'serve-{port}.log').read_text()
                    raise RuntimeError(f"serve did not start: {log_text}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
