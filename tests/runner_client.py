"""An in-process runner (server/app.py's RunnerServer) on a free loopback port, and an aiohttp client for it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp

from ollama_engine.server.app import RunnerServer


@contextlib.asynccontextmanager
async def runner_client(server: RunnerServer) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session whose relative paths reach `server`, listening until the block ends."""
    listening = await server.start("127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        listening.close()
        await listening.wait_closed()
