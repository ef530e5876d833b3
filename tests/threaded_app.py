"""An aiohttp handler served from a thread of its own, for tests that need a fake server (a registry) beside a
real `serve`: `with Fake() as host:` gives `127.0.0.1:<port>` while it serves."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web
from serve_process import free_port


class ThreadedApp:
    """Subclasses answer every GET in `handler`."""

    async def handler(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    def __enter__(self) -> str:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/{tail:.*}", self.handler)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        started.wait(10)
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
