"""serve keeps its connections to a runner alive (sched/llama_server.py, issue 33).

The runner here is a small aiohttp app speaking the runner's /health and /completion, so that the test sees
which TCP connection (the client's port) carried each request. A real runner process behind serve is
exercised by test_serve.py and test_faults.py (a runner killed mid-stream: the stream ends with its error).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest
from aiohttp import web

from ollama_engine.envconfig import EnvConfig
from ollama_engine.llm.runner_handle import RunnerHandle
from ollama_engine.sched.llama_server import LlamaServer
from ollama_engine.sched.types import ModelInfo, Options, RunnerFailedError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeRunner:
    """/health and a streamed /completion of three lines; records the client port of every request."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.release = asyncio.Event()  # a completion's last line waits for this once `hold` is set
        self.hold = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/completion", self.completion)
        return app

    def _seen(self, request: web.Request) -> None:
        self.ports.append(request.transport.get_extra_info("peername")[1])

    async def health(self, request: web.Request) -> web.Response:
        self._seen(request)
        return web.json_response({"status": 0, "progress": 1.0})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self._seen(request)
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for text in ("a", "b"):
            await response.write(json.dumps({"content": text}).encode() + b"\n")
        if self.hold:
            await self.release.wait()
        await response.write(json.dumps({"done": True, "done_reason": 1, "eval_count": 2}).encode() + b"\n")
        return response


async def _with_server(body) -> None:
    fake = FakeRunner()
    port = _free_port()
    site_runner = web.AppRunner(fake.app(), shutdown_timeout=0.2)  # a held stream is cut, as a killed runner's
    await site_runner.setup()
    await web.TCPSite(site_runner, "127.0.0.1", port).start()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.PIPE)
    llama = LlamaServer(RunnerHandle(process, port), "model.gguf", ModelInfo(), Options(num_ctx=256), 1, EnvConfig())
    try:
        await body(fake, llama, site_runner)
    finally:
        llama.close()
        await asyncio.sleep(0.05)  # the session's close, scheduled by close(), runs
        if site_runner.server is not None:
            await site_runner.cleanup()


def test_ping_and_completions_share_one_connection() -> None:
    async def body(fake: FakeRunner, llama: LlamaServer, _: web.AppRunner) -> None:
        for _ in range(3):
            await llama.ping()
            chunks = [chunk async for chunk in llama.completion("hi", {"num_predict": 2})]
            assert [c.get("content") for c in chunks[:2]] == ["a", "b"] and chunks[-1]["done"]
        assert len(fake.ports) == 6
        assert len(set(fake.ports)) == 1, fake.ports  # one connection, kept alive (was one per request)

    asyncio.run(_with_server(body))


def test_a_runner_that_just_answered_is_not_pinged_again() -> None:
    """ping(fresh=s): a healthy answer or a completion line within s seconds proves the runner alive, with no
    round trip (the scheduler's check before reusing a runner); older, or fresh=0 (the health monitor): asked.
    A runner that has exited fails however recently it answered."""
    async def body(fake: FakeRunner, llama: LlamaServer, _: web.AppRunner) -> None:
        await llama.ping(fresh=60)  # never answered: asked
        await llama.ping(fresh=60)  # just answered: not asked
        assert len(fake.ports) == 1
        await llama.ping()
        assert len(fake.ports) == 2
        assert [c async for c in llama.completion("hi", {"num_predict": 2})][-1]["done"]
        await llama.ping(fresh=60)  # the completion's lines were answers
        assert len(fake.ports) == 3
        await asyncio.sleep(0.2)
        await llama.ping(fresh=0.1)  # older than the window: asked
        assert len(fake.ports) == 4
        llama.close()
        with pytest.raises(RunnerFailedError):
            await llama.ping(fresh=60)

    asyncio.run(_with_server(body))


def test_parallel_completions_each_get_a_connection() -> None:
    async def body(fake: FakeRunner, llama: LlamaServer, _: web.AppRunner) -> None:
        async def one() -> list[dict]:
            return [chunk async for chunk in llama.completion("hi", {"num_predict": 2})]

        results = await asyncio.gather(*(one() for _ in range(4)))
        assert all(r[-1]["done"] for r in results)
        assert len(set(fake.ports)) == 4  # streams in flight at once never share (no limit on the pool)

    asyncio.run(_with_server(body))


def test_a_stream_in_flight_when_the_runner_is_closed_ends_with_an_error() -> None:
    """close() while a completion streams: the stream ends (an error, not a hang), the session is closed
    once it has, and a request after close() fails at once as a stopped runner."""
    async def body(fake: FakeRunner, llama: LlamaServer, site_runner: web.AppRunner) -> None:
        fake.hold = True
        stream = llama.completion("hi", {"num_predict": 2})
        assert (await stream.__anext__())["content"] == "a"
        session = llama._session
        assert session is not None
        llama.close()  # kills the stand-in process; the fake server still holds the stream open
        await asyncio.sleep(0.05)
        assert not session.closed  # not closed under the stream still reading
        await site_runner.cleanup()  # the runner's end of the connection goes away, as a killed runner's does
        with pytest.raises(RunnerFailedError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        await asyncio.sleep(0.05)
        assert session.closed
        with pytest.raises(RunnerFailedError):
            await llama.ping()

    asyncio.run(_with_server(body))
