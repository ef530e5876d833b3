"""Ollama's native routes on the scheduler alone: /, /api/ps, /api/version and /api/stop, and the helpers every
route shares (errors, JSON bodies, keep_alive, options, scheduling). /api/generate and /api/chat are in chat.py.

Bodies, status codes and error texts follow Ollama (reference §3.1, §3.2). Streams are NDJSON by default;
an error before the first byte has its real status, after it one `{"error": ...}` line ends the stream.
Each handler holds its scheduler reference in a Context that it cancels when it ends or its client goes away
(aiohttp cancels the handler then), which is how the scheduler learns that the request finished.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from aiohttp import web

from ollama_engine.envconfig import MAX_DURATION, DurationError, keep_alive_seconds, parse_duration
from ollama_engine.sample.penalties import PenaltySettings
from ollama_engine.sched import (
    Context,
    Model,
    Options,
    RunnerRef,
    Scheduler,
    ServerBusyError,
    StatusError,
)
from ollama_engine.sched.types import RUNNER_OPTIONS
from ollama_engine.server.wire import MAX_THREADS, WireError, encode, go_loads

from .catalog import ModelNotFoundError

log = logging.getLogger(__name__)

Resolver = Callable[[str], Model]

# api.DefaultOptions() (HEAD) for what the runner samples with; the runner reads absent keys as zero.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "num_predict": -1, "num_keep": 4, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "seed": -1,
}
_INT_OPTIONS = {"num_predict", "num_keep", "top_k", "repeat_last_n", "seed", "num_ctx", "num_batch", "num_gpu",
                "main_gpu", "num_thread"}
_FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                  "frequency_penalty"}
DONE_REASONS = {0: "stop", 1: "length", 2: "connection_closed"}
RETRY_AFTER_SECONDS = 1
NDJSON = "application/x-ndjson"


class ApiError(Exception):
    """An error response: Ollama's {"error": message} with its status."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return json_response({"error": str(self)}, status=self.status, headers=self.headers)


def json_response(value: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=encode(value), status=status, headers=headers,
                        content_type="application/json", charset="utf-8")


_last_stamp: tuple[int, str] = (-1, "")


def created_at(now_ns: int | None = None) -> str:
    """RFC 3339 in UTC with nanoseconds, trailing zeros trimmed (Go's RFC3339Nano)."""
    global _last_stamp
    now_ns = time.time_ns() if now_ns is None else now_ns
    seconds, nanos = divmod(now_ns, 1_000_000_000)
    last_seconds, stamp = _last_stamp
    if seconds != last_seconds:  # every streamed chunk has one: format the seconds once per second
        stamp = datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        _last_stamp = (seconds, stamp)
    fraction = f"{nanos:09d}".rstrip("0")
    return f"{stamp}.{fraction}Z" if fraction else f"{stamp}Z"


def _time_at(when: float) -> str:
    """A wall-clock time for expires_at; "forever" (or anything past Go's longest duration) saturates like Go's
    (about 292 years ahead), so /api/ps never fails on a runner's deadline."""
    if not when - time.time() < MAX_DURATION:
        return (datetime.now(timezone.utc).astimezone() + timedelta(days=292 * 365)).isoformat()
    return datetime.fromtimestamp(when, timezone.utc).astimezone().isoformat()


async def read_json(request: web.Request) -> dict[str, Any]:
    body = await request.read()
    if not body.strip():
        raise ApiError(400, "missing request body")
    try:
        data = go_loads(body)
    except WireError as err:
        raise ApiError(400, str(err)) from err
    if not isinstance(data, dict):
        raise ApiError(400, f"json: cannot unmarshal {type(data).__name__} into Go value of type api.GenerateRequest")
    return data


def parse_keep_alive(value: Any) -> float | None:
    """api.Duration: a number is seconds, a string a Go duration; negative is forever; None: not given."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ApiError(400, "json: cannot unmarshal bool into Go value of type api.Duration")
    if isinstance(value, (int, float)):
        return keep_alive_seconds(value if abs(value) < MAX_DURATION else (math.inf if value > 0 else -math.inf))
    if isinstance(value, str):
        try:
            return keep_alive_seconds(parse_duration(value))
        except DurationError as err:
            raise ApiError(400, str(err)) from err
    raise ApiError(400, "json: unsupported type for api.Duration")


def split_options(options: Any) -> tuple[Options, dict[str, Any]]:
    """(runner options the request gives, sampling options for the runner with Ollama's defaults)."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError(400, "json: cannot unmarshal options into Go value of type map[string]interface {}")
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
            # Go's decoder reads every number as a float64: a longer integer literal is not one (10^400)
            raise ApiError(400, f'option "{key}" is out of range: a number of {len(str(abs(value)))} digits '
                                "does not fit a float64")
        if key in _INT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))
                                    or int(value) != value):
            raise ApiError(400, f'option "{key}" must be of type integer')
        if key in _FLOAT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ApiError(400, f'option "{key}" must be of type float')
        if key == "use_mmap" and not isinstance(value, bool):
            raise ApiError(400, f'option "{key}" must be of type boolean')
        if key == "stop" and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise ApiError(400, f'option "{key}" must be of type array')
        if key in _INT_OPTIONS and not -(2**63) <= value < 2**63:  # Go's int
            raise ApiError(400, f'option "{key}" is out of range: {value}')
        if key == "num_thread" and value > MAX_THREADS:
            raise ApiError(400, f'option "num_thread" must be at most {MAX_THREADS}, got {value}')
        if key == "num_batch" and value < 1:  # the runner could not size its batches (Ollama fails the load)
            raise ApiError(400, f'option "num_batch" must be at least 1, got {value}')
    clean = {key: (int(value) if key in _INT_OPTIONS else value) for key, value in options.items()
             if value is not None}
    if clean.get("num_predict") == 0:  # the runner reads 0 as no limit: capped at 10 * num_ctx like -1, not endless
        clean["num_predict"] = -1
    sampling = {**SAMPLING_DEFAULTS, **{k: v for k, v in clean.items() if k not in RUNNER_OPTIONS}}
    try:
        PenaltySettings.from_options(sampling)  # the runner applies them; a bad one is the request's fault
    except TypeError as err:
        raise ApiError(400, str(err)) from err
    return Options.from_request(clean), sampling


async def schedule(scheduler: Scheduler, ctx: Context, model: Model, opts: Options,
                   keep_alive: float | None) -> RunnerRef:
    """A ready runner for the request, or the ApiError Ollama's handleScheduleError would answer."""
    req = await scheduler.get_runner(ctx, model, opts, keep_alive)
    try:
        # shielded: a client that goes away must not cancel a load that others may attach to
        return await asyncio.shield(req.future)
    except ServerBusyError as err:
        raise ApiError(503, str(err), {"Retry-After": str(err.retry_after)}) from err
    except FileNotFoundError as err:
        raise ApiError(404, f'model "{model.name}" not found, try pulling it first') from err
    except StatusError as err:
        raise ApiError(err.status, str(err)) from err
    except Exception as err:
        raise ApiError(500, str(err) or type(err).__name__) from err


class NativeRoutes:
    """The handlers, bound to one scheduler and one model resolver."""

    def __init__(self, scheduler: Scheduler, resolve: Resolver) -> None:
        self.scheduler = scheduler
        self.resolve = resolve

    def _model(self, body: Mapping[str, Any]) -> tuple[str, Model]:
        name = body.get("model")
        if name is None:
            name = body.get("name", "")
        if not isinstance(name, str):
            raise ApiError(400, "json: cannot unmarshal model into Go struct field of type string")
        try:
            return name, self.resolve(name)
        except ModelNotFoundError as err:
            raise ApiError(404, f"model '{name}' not found") from err

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        try:
            version = importlib.metadata.version("ollama-engine")
        except importlib.metadata.PackageNotFoundError:
            version = "0.0.0"
        return json_response({"version": version})

    async def ps(self, request: web.Request) -> web.Response:
        now = time.time()
        rows = []
        for runner in self.scheduler.loaded_models():
            if runner.model is None:
                continue
            expires = runner.expires_at
            if expires is None or runner.loading or runner.ref_count > 0:
                expires = now + runner.session_duration
            arch = runner.info.architecture if runner.info is not None else ""
            rows.append((expires, {
                "name": runner.model.name, "model": runner.model.name, "size": runner.total_size,
                "size_vram": runner.vram_size, "digest": runner.model.digest,
                "details": {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
                            "parameter_size": "", "quantization_level": ""},
                "expires_at": _time_at(expires),
                "context_length": runner.options.num_ctx if runner.options is not None else 0,
                "state": runner.state, "in_flight": runner.active, "queue_depth": self.scheduler.queue_depth(runner),
            }))
        rows.sort(key=lambda row: row[0], reverse=True)
        return json_response({"models": [row for _, row in rows]})

    async def stop(self, request: web.Request) -> web.Response:
        """Our extension: unload a model now; `force` also fails its in-flight requests."""
        try:
            body = await read_json(request)
            name, model = self._model(body)
        except ApiError as err:
            return err.response()
        stopped = self.scheduler.expire_runner(model, force=bool(body.get("force")))
        return json_response({"model": name, "stopped": stopped})


def native_routes(app: web.Application, scheduler: Scheduler, resolve: Resolver) -> None:
    """Register the scheduler-facing native routes on `app`."""
    routes = NativeRoutes(scheduler, resolve)
    app.router.add_get("/", routes.root)  # GET also answers HEAD
    app.router.add_get("/api/version", routes.version)
    app.router.add_get("/api/ps", routes.ps)
    app.router.add_post("/api/stop", routes.stop)
