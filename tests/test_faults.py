"""Faults injected into serve: what the machine does to it, not what clients send.

A runner that stops answering mid-stream, a load that cannot get its memory, a disk that fills during an upload
or a create, a blob whose digest does not match, serve itself killed during an upload or a pull. Each time the
client gets a clear error, nothing half-written is ever used (every blob's name is its sha256, every manifest's
layers exist), and the next request works. A runner killed with SIGKILL mid-stream is tests/test_serve.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from serve_process import eventually, free_port, generate, pid_alive, serving
from synthetic.models import write_synthetic
from threaded_app import ThreadedApp

from ollama_engine.envconfig import EnvConfig
from ollama_engine.sched import scheduler as scheduler_module
from ollama_engine.store import Store
from ollama_engine.store.disk import DIGEST_RE

FEW = {"num_predict": 2, "temperature": 0}


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def assert_consistent(root: Path) -> list[str]:
    """The store's invariant: a blob's name is its content's sha256, every manifest's layers are there.
    Returns the names of leftover temporary files (never read: no digest name)."""
    store = Store(root)
    leftovers = []
    for path in store.blobs_dir.iterdir() if store.blobs_dir.is_dir() else ():
        if DIGEST_RE.fullmatch(path.name):
            assert digest_of(path.read_bytes()) == "sha256:" + path.name[7:].lower(), f"{path.name} is not its digest"
        else:
            leftovers.append(path.name)
    for name, manifest in store.manifests().items():
        for digest in manifest.all_digests():
            assert store.blob_path(digest).is_file(), f"{name} lists {digest}, which is missing"
    return leftovers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("faults") / "tiny.gguf", "tiny-llama", seed=1)


def new_store(root: Path, gguf: Path) -> Path:
    """A store holding `tiny` (its blob copied in, a manifest written)."""
    store = Store(root / "models")
    digest = store.add_file(gguf)
    store.create("tiny", files={"tiny.gguf": digest})
    return store.root


# ------------------------------------------------------------------------------------------ runners


def test_a_runner_that_stops_answering_mid_stream(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """SIGSTOP the runner while it streams: the health check gives up on it, the stream ends with an error line,
    the runner is killed (not left behind), and the next request loads a fresh one."""
    monkeypatch.setattr(scheduler_module, "PING_TIMEOUT", 0.5)
    store = new_store(tmp_path, tiny)

    async def body() -> None:
        async with serving(EnvConfig(models=store)) as (session, url, scheduler):
            scheduler.health_interval, scheduler.health_failures = 0.2, 2
            request = {"model": "tiny", "prompt": "Once upon a time", "options": {"num_predict": 100_000}}
            async with session.post(url + "/api/generate", json=request) as response:
                assert not json.loads(await response.content.readline())["done"]
                [runner] = scheduler.loaded.values()
                pid = runner.pid
                os.kill(pid, signal.SIGSTOP)
                lines = [json.loads(line) async for line in response.content if line.strip()]
            assert "error" in lines[-1], lines[-1]
            await eventually(lambda: not scheduler.loaded)
            await eventually(lambda: not pid_alive(pid))  # killed, even though it was stopped
            status, lines = await generate(session, url, model="tiny", prompt="Once", options=FEW)
            assert status == 200 and lines[-1]["done"]
            [fresh] = scheduler.loaded.values()
            assert fresh.pid != pid

    run(body())


def test_a_load_that_cannot_get_its_memory(tiny: Path, tmp_path: Path):
    """A model whose KV cache alone needs far more than the machine has (context 2^28 cells): a clear error
    that says so, no runner left behind, and the next model loads."""
    huge = write_synthetic(tmp_path / "huge.gguf", "tiny-llama", seed=1, context_length=2**28)
    store = Store(new_store(tmp_path, tiny))
    store.create("huge", files={"huge.gguf": store.add_file(huge)})

    async def body() -> None:
        async with serving(EnvConfig(models=store.root)) as (session, url, scheduler):
            status, lines = await generate(session, url, model="huge", prompt="Once",
                                           options={**FEW, "num_ctx": 2**28}, stream=False)
            error = lines[-1]["error"]  # the fit's "requires more system memory", or the allocation that failed
            assert status >= 400 and ("memory" in error or "allocate" in error), lines
            await eventually(lambda: not scheduler.loaded)
            status, lines = await generate(session, url, model="tiny", prompt="Once", options=FEW, stream=False)
            assert status == 200 and lines[-1]["done"]

    run(body())


# ------------------------------------------------------------------------------------------ the disk


@contextlib.contextmanager
def disk_full_after(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes in any file fail (EFBIG), as on a full disk; the process's own limit, restored."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_disk_that_fills_during_an_upload_and_a_create(tiny: Path, tmp_path: Path):
    store = new_store(tmp_path, tiny)
    big = os.urandom(3 << 20)
    license_text = "x" * (3 << 20)

    async def body() -> None:
        async with serving(EnvConfig(models=store)) as (session, url, _):
            with disk_full_after(1 << 20):
                async with session.post(f"{url}/api/blobs/{digest_of(big)}", data=big) as response:
                    assert response.status == 500
                    upload_error = (await response.json())["error"]
                async with session.post(url + "/api/create", json={"model": "licensed", "from": "tiny",
                                                                   "license": license_text, "stream": False}) as r:
                    assert r.status == 500
                    create_error = (await r.json())["error"]
            assert "File too large" in upload_error and "File too large" in create_error
            async with session.head(f"{url}/api/blobs/{digest_of(big)}") as response:
                assert response.status == 404
            async with session.get(url + "/api/tags") as response:
                assert [m["name"] for m in (await response.json())["models"]] == ["tiny:latest"]
            # with room again, both work
            async with session.post(f"{url}/api/blobs/{digest_of(big)}", data=big) as response:
                assert response.status == 201
            async with session.post(url + "/api/create", json={"model": "licensed", "from": "tiny",
                                                               "license": license_text, "stream": False}) as r:
                assert r.status == 200
            status, lines = await generate(session, url, model="licensed", prompt="Once", options=FEW, stream=False)
            assert status == 200 and lines[-1]["done"]

    run(body())
    assert assert_consistent(store) == []


def test_a_blob_whose_digest_does_not_match(tiny: Path, tmp_path: Path):
    store = new_store(tmp_path, tiny)

    async def body() -> None:
        async with serving(EnvConfig(models=store)) as (session, url, _):
            claimed = digest_of(b"something else")
            async with session.post(f"{url}/api/blobs/{claimed}", data=b"GGUF and some bytes") as response:
                assert response.status == 400
                assert (await response.json())["error"].startswith("digest mismatch")
            async with session.head(f"{url}/api/blobs/{claimed}") as response:
                assert response.status == 404
            async with session.post(url + "/api/create", json={"model": "bad", "files": {"bad.gguf": claimed},
                                                               "stream": False}) as response:
                assert response.status >= 400 and (await response.json())["error"]

    run(body())
    assert assert_consistent(store) == []


# ------------------------------------------------------------------------------------------ serve killed


@contextlib.contextmanager
def serve_subprocess(models: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(models)}
    process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.2)
        yield url, process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # serve and any runner it started
        process.wait()


class SlowRegistry(ThreadedApp):
    """A registry whose blob trickles out the first time (64 KiB every 50 ms), in a thread; `host:port` while open."""

    def __init__(self, gguf: bytes) -> None:
        config = b'{"model_format":"gguf","model_family":"llama"}\n'
        self.blob, self.config = gguf, config
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest_of(gguf), "size": len(gguf)}
        self.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": digest_of(config),
                       "size": len(config)}, "layers": [layer]}).encode()
        self.sent = threading.Event()

    async def handler(self, request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/manifests/latest"):
            return web.Response(body=self.manifest)
        if request.path.endswith(digest_of(self.config)):
            return web.Response(body=self.config)
        if self.sent.is_set():  # only the first download trickles
            return web.Response(body=self.blob)
        response = web.StreamResponse(headers={"Content-Length": str(len(self.blob))})
        await response.prepare(request)
        for start in range(0, len(self.blob), 1 << 16):
            await response.write(self.blob[start:start + (1 << 16)])
            self.sent.set()
            await asyncio.sleep(0.05)
        return response


def test_serve_killed_during_a_pull_and_an_upload(tiny: Path, tmp_path: Path):
    """SIGKILL serve while a pull streams a blob and while a client uploads one; serve again on the same store:
    neither model nor blob exists half-written, the store is consistent, and both operations then succeed."""
    store = new_store(tmp_path, tiny)
    gguf = tiny.read_bytes()
    with SlowRegistry(gguf + bytes(32)) as host:  # not a blob the store has (trailing bytes: still the model)
        name = f"{host}/library/pulled:latest"
        with serve_subprocess(store) as (url, process):
            pull = threading.Thread(target=lambda: _quietly(lambda: httpx.post(
                url + "/api/pull", json={"model": name, "insecure": True}, timeout=60)), daemon=True)
            pull.start()
            _quietly(lambda: httpx.post(f"{url}/api/blobs/{digest_of(gguf + b'x')}", timeout=60,
                                        content=_trickle(gguf + b"x", process)))
            os.killpg(process.pid, signal.SIGKILL)  # (the upload generator kills it too, mid-body)
            pull.join(30)
        leftovers = assert_consistent(store)
        assert not Store(store).has_blob(digest_of(gguf + b"x"))
        with serve_subprocess(store) as (url, _):
            assert [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]] == ["tiny:latest"]
            response = httpx.post(url + "/api/pull", json={"model": name, "insecure": True, "stream": False},
                                  timeout=120)
            assert response.status_code == 200 and response.json()["status"] == "success"
            reply = httpx.post(url + "/api/generate", timeout=120, json={
                "model": name, "prompt": "Once", "options": FEW, "stream": False}).json()
            assert reply["done"]
    assert all(not DIGEST_RE.fullmatch(name) for name in leftovers)
    assert_consistent(store)


def _trickle(data: bytes, process: subprocess.Popen) -> Iterator[bytes]:
    """An upload body that stops coming after half, when serve is killed under it."""
    half = len(data) // 2
    for start in range(0, half, 1 << 16):
        yield data[start:start + (1 << 16)]
    time.sleep(0.5)  # the pull is streaming by now
    os.killpg(process.pid, signal.SIGKILL)
    yield data[half:half + (1 << 16)]


def _quietly(call) -> None:
    with contextlib.suppress(httpx.HTTPError):
        call()
