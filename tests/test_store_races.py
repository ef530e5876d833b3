"""Concurrent and hostile store operations (issue 38, items 7-10): two creates of one name, a delete during a create,
two pulls of one model, an error inside a streamed answer, a name too long to be a file name.

Each test failed before its fix: the second create's clean-up deleted the first one's GGUF (a model listed but
unusable), two pulls shared one temp file (500 FileNotFoundError), an error after the first line was a second raw
HTTP response inside the chunked body, and a 300-character host part was a 500 quoting the server's path.
Rerun: .venv/bin/python -m pytest -q tests/test_store_races.py
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from synthetic.models import write_synthetic
from test_faults import disk_full_after

from ollama_engine.store import InvalidName, Store

HOST300 = "h" * 300  # a valid host part (Ollama allows 350) that cannot be a file name (255)


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def assert_consistent(store: Store) -> None:
    """Every manifest's blobs exist (the break of item 7: a model listed whose GGUF is gone)."""
    for name, manifest in store.manifests().items():
        for digest in manifest.all_digests():
            assert store.blob_path(digest).is_file(), f"{name} lists {digest}, which is missing"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("races")
    return (write_synthetic(folder / "g.gguf", "tiny-llama", seed=1),
            write_synthetic(folder / "h.gguf", "tiny-llama", seed=2))


class Gate:
    """A create's progress callback that stops at one status until released (the slow part of a real create)."""

    def __init__(self, status: str) -> None:
        self.status, self.reached, self.release = status, threading.Event(), threading.Event()

    def __call__(self, line: dict) -> None:
        if line.get("status") == self.status:
            self.reached.set()
            assert self.release.wait(30)


def in_thread(work) -> tuple[threading.Thread, list]:
    errors: list = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# ---- item 7: two creates of one name ------------------------------------------------------------------------


def test_two_creates_of_one_name_leave_a_usable_model(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    """A creates `race` from G and stops before writing its manifest; B creates `race` from H meanwhile. B's clean-up
    of the manifest it replaces (G's, from round one) must not delete G while A is about to reference it."""
    store = Store(tmp_path / "models")
    g, h = store.add_file(ggufs[0]), store.add_file(ggufs[1])
    store.create("race", files={"g.gguf": g}, license="a license")  # round one: race -> G
    gate = Gate("writing manifest")
    first, first_errors = in_thread(lambda: store.create("race", files={"g.gguf": g}, license="a license",
                                                         progress=gate))
    assert gate.reached.wait(30)
    second, second_errors = in_thread(lambda: store.create("race", files={"h.gguf": h}))
    second.join(1.0)  # before the fix B finished here; now it waits for A
    gate.release.set()
    first.join(30)
    second.join(30)
    assert first_errors == [] and second_errors == []
    assert_consistent(store)
    resolved = store.resolve("race")
    assert resolved.model_path.is_file()
    assert resolved.model_path == store.blob_path(h)  # the creates ran one after the other: B's is the last


def test_a_delete_during_a_create_keeps_the_blobs_the_create_uses(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    """`other` is the only model using G; a create of `new` from G is in progress when `other` is deleted: G is
    pinned by the create, so the delete keeps it and `new` works."""
    store = Store(tmp_path / "models")
    g = store.add_file(ggufs[0])
    store.create("other", files={"g.gguf": g}, system="same system")
    gate = Gate("writing manifest")
    create, errors = in_thread(lambda: store.create("new", files={"g.gguf": g}, system="same system", progress=gate))
    assert gate.reached.wait(30)
    removed = store.delete("other")
    gate.release.set()
    create.join(30)
    assert errors == [] and g not in removed
    assert_consistent(store)
    assert store.resolve("new").model_path.is_file()
    assert store.delete("new")  # with nothing in progress, deleting the last user removes the blobs
    assert not store.has_blob(g)


# ---- item 10: a name part longer than a file name -----------------------------------------------------------


def test_a_name_too_long_for_a_file_is_a_clear_400_in_the_store(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    g = store.add_file(ggufs[0])
    name = f"{HOST300}/library/m:latest"
    for operation in (lambda: store.resolve(name), lambda: store.create(name, files={"g.gguf": g}),
                      lambda: store.copy("m", name), lambda: store.delete(name), lambda: store.show(name)):
        with pytest.raises(InvalidName) as caught:
            operation()
        assert caught.value.status == 400 and str(tmp_path) not in str(caught.value)


# ---- the API: items 8, 9 and 10 ------------------------------------------------------------------------------


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serving(models: Path):
    """serve's app in this process (no model is loaded by these tests)."""
    from ollama_engine.api.serve import create_app
    from ollama_engine.envconfig import EnvConfig
    from ollama_engine.sched import Scheduler

    config = EnvConfig(models=models)
    server = TestServer(create_app(config, Scheduler(config)), handler_cancellation=True)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            yield session, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


class Registry:
    """A registry serving one model whose blob trickles out (so that two pulls overlap); `manifest` may be bad."""

    def __init__(self, blob: bytes, digest: str | None = None) -> None:
        self.blob = blob
        self.config = b'{"model_format":"gguf","model_family":"llama"}\n'
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest or digest_of(blob),
                 "size": len(blob)}
        self.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": digest_of(self.config), "size": len(self.config)},
            "layers": [layer]}).encode()
        self.blob_requests = 0

    async def handler(self, request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/manifests/latest"):
            return web.Response(body=self.manifest)
        if request.path.endswith(digest_of(self.config)):
            return web.Response(body=self.config)
        self.blob_requests += 1
        response = web.StreamResponse(headers={"Content-Length": str(len(self.blob))})
        await response.prepare(request)
        for start in range(0, len(self.blob), 1 << 20):
            await response.write(self.blob[start:start + (1 << 20)])
            await asyncio.sleep(0.02)
        return response

    @contextlib.asynccontextmanager
    async def running(self):
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handler)
        server = TestServer(app)
        await server.start_server()
        try:
            yield f"{server.host}:{server.port}"
        finally:
            await server.close()


async def pull_lines(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, bytes, list[dict]]:
    async with session.post(url + "/api/pull", json={"model": model, "insecure": True}) as response:
        raw = await response.read()
        return response.status, raw, [json.loads(line) for line in raw.splitlines() if line.strip()]


def test_two_concurrent_pulls_of_one_model_both_succeed(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    blob = ggufs[0].read_bytes()
    models = tmp_path / "models"

    registry = Registry(blob)

    async def body() -> None:
        async with registry.running() as host, serving(models) as (session, url):
            name = f"{host}/library/pulled:latest"
            first, second = await asyncio.gather(pull_lines(session, url, name), pull_lines(session, url, name))
            for status, _, lines in (first, second):
                assert status == 200 and lines[-1] == {"status": "success"}, lines[-3:]
                assert {"status": f"pulling {digest_of(blob)[7:19]}", "digest": digest_of(blob), "total": len(blob),
                        "completed": len(blob)} in lines
            assert registry.blob_requests == 1  # one download, shared (as Ollama's pulls share one per digest)
            async with session.post(url + "/api/show", json={"model": name}) as response:
                assert response.status == 200

    run(body())
    store = Store(models)
    assert_consistent(store)
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == sorted(
        d.replace(":", "-") for d in store.manifests()[next(iter(store.manifests()))].all_digests())


def test_a_pull_whose_client_leaves_does_not_stop_the_shared_download(ggufs: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    blob = ggufs[0].read_bytes()
    registry = Registry(blob)

    async def leave_mid_download(session: aiohttp.ClientSession, url: str, model: str) -> None:
        async with session.post(url + "/api/pull", json={"model": model, "insecure": True}) as response:
            async for line in response.content:
                if json.loads(line).get("completed"):
                    return  # hang up while the blob downloads

    async def body() -> None:
        async with registry.running() as host, serving(tmp_path / "models") as (session, url):
            name = f"{host}/library/pulled:latest"
            _, (status, _, lines) = await asyncio.gather(leave_mid_download(session, url, name),
                                                         pull_lines(session, url, name))
            assert status == 200 and lines[-1] == {"status": "success"}, lines[-3:]
            assert registry.blob_requests == 1

    run(body())
    assert_consistent(Store(tmp_path / "models"))


def test_an_error_after_a_pull_started_is_one_error_line(tmp_path: Path) -> None:
    """A manifest whose digest is a path (`sha256:../../…`): the stream has begun ("pulling manifest"), so the
    answer is that line and then Ollama's {"error": …} line, never a second HTTP response in the body."""
    async def body() -> None:
        async with Registry(b"GGUF", digest="sha256:../../../../etc/passwd").running() as host, \
                serving(tmp_path / "models") as (session, url):
            status, raw, lines = await pull_lines(session, url, f"{host}/library/evil:latest")
            assert status == 200 and b"HTTP/1.1" not in raw
            assert lines[0] == {"status": "pulling manifest"} and len(lines) == 2
            assert "invalid digest" in lines[1]["error"]

    run(body())
    assert not (tmp_path / "etc").exists()


def test_a_streamed_create_on_a_full_disk_ends_with_an_error_line(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    g = store.add_file(ggufs[0])

    async def body() -> None:
        async with serving(store.root) as (session, url):
            with disk_full_after(1 << 20):
                async with session.post(url + "/api/create", json={
                        "model": "licensed", "files": {"g.gguf": g}, "license": "x" * (3 << 20)}) as response:
                    raw = await response.read()
            assert response.status == 200 and b"HTTP/1.1" not in raw
            lines = [json.loads(line) for line in raw.splitlines()]
            assert lines[0] == {"status": "parsing GGUF"} and "File too large" in lines[-1]["error"]
            assert str(store.root) not in lines[-1]["error"]

    run(body())
    assert_consistent(store)


def test_any_exception_after_a_stream_started_ends_it_with_an_error_line() -> None:
    """The shared fallback (error_middleware): a handler that fails after its first line, whatever the error."""
    from ollama_engine.api.middleware import error_middleware, remember_started

    async def failing(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        await response.write(b'{"status":"working"}\n')
        raise RuntimeError("something broke")

    async def body() -> None:
        app = web.Application(middlewares=[error_middleware])
        app.on_response_prepare.append(remember_started)
        app.router.add_post("/stream", failing)
        server = TestServer(app)
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session, session.post(server.make_url("/stream")) as response:
                raw = await response.read()
                assert response.status == 200
        finally:
            await server.close()
        assert b"HTTP/1.1" not in raw
        assert [json.loads(line) for line in raw.splitlines()] == [
            {"status": "working"}, {"error": "internal error: RuntimeError: something broke"}]

    run(body())


def test_a_name_too_long_for_a_file_is_a_400_without_a_path(ggufs: tuple[Path, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    g = store.add_file(ggufs[0])
    store.create("m", files={"g.gguf": g})
    name = f"{HOST300}/library/m:latest"

    async def body() -> None:
        async with serving(store.root) as (session, url):
            for method, path, request in (
                    ("POST", "/api/show", {"model": name}),
                    ("POST", "/api/create", {"model": name, "files": {"g.gguf": g}, "stream": False}),
                    ("POST", "/api/copy", {"source": "m", "destination": name}),
                    ("DELETE", "/api/delete", {"model": name}),
                    ("POST", "/api/pull", {"model": name, "stream": False})):
                async with session.request(method, url + path, json=request) as response:
                    text = await response.text()
                    assert response.status == 400, (path, response.status, text)
                    assert "error" in json.loads(text) and str(tmp_path) not in text, (path, text)
            async with session.post(url + "/api/generate", json={"model": name, "prompt": "x"}) as response:
                text = await response.text()
                assert response.status < 500 and str(tmp_path) not in text, text

    run(body())
