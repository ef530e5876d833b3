"""No runner outlives its serve (issues 30 and 38 item 2): a serve killed with SIGKILL cannot stop its runners, so
each runner watches its parent (Linux's parent-death signal, and os.getppid() as the fallback) and exits by itself.

Before the fix both runners were alive, re-parented to PID 1, 10 s after the kill, every time.
Rerun: .venv/bin/python -m pytest -q tests/test_runner_orphans.py
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import free_port, pid_alive, wait_until_serving
from synthetic.models import write_synthetic

from ollama_engine.envconfig import PARENT_DEATH_SIGNAL_ENV, PARENT_PID_ENV

EXIT_WITHIN = 5.0  # seconds


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after `timeout` seconds (polling)."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@contextlib.contextmanager
def killed_afterwards(pids: list[int]) -> Iterator[None]:
    """Whatever the test finds, no process it started survives it."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_runners_exit_when_serve_is_killed(tmp_path: Path) -> None:
    """A real serve loads two models (two runners), then gets SIGKILL: both runners are gone within seconds."""
    models = [write_synthetic(tmp_path / f"m{i}.gguf", "tiny-llama", seed=i) for i in (1, 2)]
    port = free_port()
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(tmp_path / "store"),
           "OLLAMA_ENGINE_MODEL_PATHS": "1", "OLLAMA_MAX_LOADED_MODELS": "2"}
    env.pop(PARENT_PID_ENV, None)
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
    runners: list[int] = []
    with killed_afterwards(runners), killed_afterwards([serve.pid]):
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, serve, tmp_path / "serve.log")
        for model in models:
            reply = post(url + "/api/generate", {"model": str(model), "prompt": "Once", "stream": False,
                                                 "options": {"num_predict": 1, "num_ctx": 256}})
            assert reply["done"]
        runners += children(serve.pid)
        assert len(runners) == 2, f"expected two runners, found {runners}"
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        assert wait_gone(runners, EXIT_WITHIN) == [], "a runner outlived its SIGKILLed serve"


WATCHER = """
import os, sys, time
from ollama_engine.server.parent import watch_parent
watch_parent(interval=0.1)
print(os.getpid(), flush=True)
time.sleep(60)
"""

MIDDLE = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout,
                         env={**os.environ, "OLLAMA_ENGINE_PARENT_PID": str(os.getpid())})
time_to_die = sys.stdin.readline()
"""


def test_the_parent_watch_without_the_death_signal() -> None:
    """The fallback alone (PR_SET_PDEATHSIG off, as on a system without it): a parent that dies is noticed by
    polling os.getppid()."""
    env = {**os.environ, PARENT_DEATH_SIGNAL_ENV: "0"}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True)
    assert middle.stdout is not None
    ready, _, _ = select.select([middle.stdout], [], [], 60)
    line = middle.stdout.readline() if ready else ""
    if not line.strip():
        middle.kill()
        pytest.fail("the watching process did not start")
    watcher = int(line)
    with killed_afterwards([watcher, middle.pid]):
        assert pid_alive(watcher)
        middle.kill()
        middle.wait()
        assert wait_gone([watcher], EXIT_WITHIN) == []


def test_a_runner_started_by_hand_watches_nothing() -> None:
    """Without the parent's pid in its environment (`ollama-engine runner` typed in a shell) nothing is watched."""
    code = "from ollama_engine.server.parent import watch_parent; import threading; watch_parent(); " \
           "print(sorted(t.name for t in threading.enumerate()))"
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "parent-watch" not in out
