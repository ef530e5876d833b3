"""What serve is doing, for people and for Prometheus: GET /metrics, the status page (GET /status) and the JSON
it reads (GET /api/status, GET /api/status/plan?model=NAME).

`GET /` keeps answering "Ollama is running" (clients check it). The page is one static file with a small
inline script: no build step, nothing fetched from elsewhere, and it is served like every route (the host
check, no CORS opening). A model's memory picture is drawn by the same code as `plan --svg`
(llm/memory_svg.py) from the report its runner gave at load; a model not loaded is planned by
`ollama-engine plan --json` in a subprocess (serve never opens model weights itself), one at a time, with a
time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from importlib import resources
from typing import Any

from aiohttp import web

from ollama_engine.envconfig import EnvConfig
from ollama_engine.llm.memory_svg import device_bars, memory_svg, totals
from ollama_engine.ml.memory import BackendMemory
from ollama_engine.sched import RunnerRef, Scheduler
from ollama_engine.store import InvalidName, StoreError

from .catalog import Catalog, ModelNotFoundError
from .metrics import Metrics
from .native import ApiError, json_response

log = logging.getLogger(__name__)

PLAN_TIMEOUT = 120.0  # seconds for one `plan` of a model not loaded
PAGE_HEADERS = {
    # the page's own inline script and style only; it talks to this server alone
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'",
    "Cache-Control": "no-store",
}


def _page() -> bytes:
    return resources.files(__package__).joinpath("status.html").read_bytes()


def runner_status(scheduler: Scheduler, runner: RunnerRef) -> dict[str, Any]:
    """One loaded model: its state, queues, and the memory report its runner gave, per device and per layer."""
    report = getattr(runner.llama, "memory", None) or BackendMemory()
    assert runner.model is not None
    name = runner.model.name
    return {
        "name": name,
        "state": runner.state,
        "queue_depth": scheduler.queue_depth(runner),
        "in_flight": runner.active,
        "parallel": runner.num_parallel,
        "context_length": runner.options.num_ctx if runner.options is not None else 0,
        "size": runner.total_size,
        "size_vram": runner.vram_size,
        "memory": report.to_json(),
        "devices": totals(device_bars(report)),
        "svg": memory_svg(report),  # the page titles it
    }


class StatusRoutes:
    def __init__(self, scheduler: Scheduler, catalog: Catalog, metrics: Metrics, config: EnvConfig) -> None:
        self.scheduler = scheduler
        self.catalog = catalog
        self.metrics = metrics
        self.config = config
        self._planning = asyncio.Semaphore(1)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=_page(), content_type="text/html", charset="utf-8", headers=PAGE_HEADERS)

    async def status(self, request: web.Request) -> web.Response:
        models = [runner_status(self.scheduler, r) for r in self.scheduler.loaded_models() if r.model is not None]
        return json_response({
            "models": models,
            "pending": self.scheduler.pending_reqs.qsize() + len(self.scheduler.parked),
            "recent": self.metrics.recent_requests(),
        })

    async def plan(self, request: web.Request) -> web.Response:
        """`plan --json` of a model (loaded or not) with serve's settings, and its picture."""
        name = request.query.get("model", "")
        if not name:
            return ApiError(400, "model is required").response()
        try:
            entry = self.catalog.resolve(name)
        except (ModelNotFoundError, InvalidName, StoreError):
            return ApiError(404, f"model '{name}' not found").response()
        if self._planning.locked():
            return ApiError(503, "a plan is already being made; try again shortly").response()
        async with self._planning:
            try:
                plan = await self._run_plan(entry.model.model_path)
            except ApiError as err:
                return err.response()
        memory = BackendMemory.from_json(plan["memory"])
        plan["svg"] = memory_svg(memory, f"{name}: plan, {plan['offloaded_layers']} of {plan['total_layers']} "
                                 "layers on GPUs")
        plan["devices"] = totals(device_bars(memory))
        return json_response(plan)

    async def _run_plan(self, path: str) -> dict[str, Any]:
        ctx = self.config.context_length or 4096
        argv = [sys.executable, "-m", "ollama_engine", "plan", path, "--json", "--ctx", str(ctx),
                "--parallel", str(self.config.num_parallel)]
        process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), PLAN_TIMEOUT)
        except TimeoutError:
            await _kill(process)
            raise ApiError(504, f"plan took longer than {PLAN_TIMEOUT:.0f} s") from None
        except asyncio.CancelledError:  # the client went away: no plan left running
            await _kill(process)
            raise
        try:
            result: dict[str, Any] = json.loads(out)
        except json.JSONDecodeError:
            message = err.decode(errors="replace").strip().splitlines()[-1:] or ["plan failed"]
            raise ApiError(500, message[0].removeprefix("error: ")) from None
        return result


async def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()


def status_routes(app: web.Application, scheduler: Scheduler, catalog: Catalog, metrics: Metrics,
                  config: EnvConfig) -> None:
    routes = StatusRoutes(scheduler, catalog, metrics, config)
    app.router.add_get("/metrics", metrics.handle)
    app.router.add_get("/status", routes.page)
    app.router.add_get("/api/status", routes.status)
    app.router.add_get("/api/status/plan", routes.plan)
