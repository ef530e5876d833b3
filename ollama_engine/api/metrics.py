"""serve's Prometheus metrics: one registry per app, fed by the scheduler's events and the completion path.

Names follow Prometheus' conventions (`ollama_engine_` prefix, base units in names, `_total` counters). Figures
that describe the present (queue depths, loaded models, their memory per device) are read from the scheduler
when /metrics is scraped; everything else is recorded as it happens, by code that only adds numbers (no I/O,
no lock held across an await). The runner's own figures (prompt tokens, tokens reused from its prompt cache)
come in its last /completion line, so nothing is asked of a runner per token or per scrape.

The registry is the app's own, not prometheus_client's global one: several apps in one process (tests) never
share or collide on a metric.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ollama_engine.sched import RunnerRef, Scheduler
from ollama_engine.sched.scheduler import SchedulerEvents

PREFIX = "ollama_engine_"
# Seconds; decode steps are milliseconds apart, a first token (prompt evaluation, maybe a load) up to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
RECENT_REQUESTS = 20  # completions the status page lists

# Unload reasons as the scheduler words them (sched/scheduler.py), by prefix, as a bounded label.
REASONS = (
    ("reload", "reload"),
    ("max loaded models reached", "max_loaded_models"),
    ("not enough memory", "memory"),
    ("keep-alive expired", "keep_alive"),
    ("expired", "keep_alive"),
    ("stop requested", "stop"),
    ("force stop", "stop"),
    ("runner process exited", "crash"),
    ("runner hung", "hung"),
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def model_name(runner: RunnerRef) -> str:
    """The `model` label: the name requests use (as /api/ps shows it), the same in every metric."""
    return runner.model.name if runner.model is not None and runner.model.name else runner.model_key


def reason_label(reason: str) -> str:
    """The scheduler's free-text unload reason as one of a few label values."""
    return next((label for prefix, label in REASONS if reason.startswith(prefix)), "other")


@dataclass
class RecentRequest:
    """One finished completion, as the status page lists it."""

    model: str
    finished_at: float  # wall-clock seconds
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_seconds: float
    tokens_per_second: float


class CompletionTimer:
    """The timing of one streamed completion: first chunk, the gaps between chunks, and its final counts."""

    def __init__(self, metrics: Metrics, model: str, start: float) -> None:
        self.metrics = metrics
        self.model = model
        self.start = start  # time.monotonic() when the request arrived
        self.first: float | None = None
        self.last = 0.0
        self._itl = metrics.inter_token_latency.labels(model)  # one label lookup per request, not per chunk

    def chunk(self) -> None:
        """A streamed chunk arrived from the runner (a chunk is usually one token)."""
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.time_to_first_token.labels(self.model).observe(now - self.start)
        else:
            self._itl.observe(now - self.last)
        self.last = now

    def done(self, final: Mapping[str, Any]) -> None:
        """The runner's last line: its token counts (prompt_eval_count, eval_count, prompt_cached_count, and
        draft_n / draft_n_accepted when it decoded speculatively)."""
        prompt, generated = int(final.get("prompt_eval_count") or 0), int(final.get("eval_count") or 0)
        cached = int(final.get("prompt_cached_count") or 0)
        m = self.metrics
        m.prompt_tokens.labels(self.model).inc(prompt)
        m.generated_tokens.labels(self.model).inc(generated)
        m.prompt_cache_hit_tokens.labels(self.model).inc(cached)
        if "draft_n" in final:  # the runner drafted tokens (speculative decoding)
            m.draft_tokens.labels(self.model).inc(int(final["draft_n"] or 0))
            m.draft_accepted_tokens.labels(self.model).inc(int(final.get("draft_n_accepted") or 0))
        eval_ns = int(final.get("eval_duration") or 0)
        m.recent.append(RecentRequest(
            model=self.model, finished_at=time.time(), prompt_tokens=prompt, cached_tokens=cached,
            generated_tokens=generated,
            ttft_seconds=round((self.first or time.monotonic()) - self.start, 4),
            tokens_per_second=round(generated / (eval_ns / 1e9), 2) if eval_ns > 0 else 0.0,
        ))


class Metrics(SchedulerEvents):
    """Every metric of one serve app, and the scheduler's observer."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "http_requests", "HTTP requests answered, by route and status",
                                ["method", "route", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of completions (cached ones included)",
                                     ["model"], registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", ["model"], registry=r)
        self.prompt_cache_hit_tokens = Counter(
            p + "prompt_cache_hit_tokens", "Prompt tokens reused from the runner's prompt cache (not evaluated)",
            ["model"], registry=r)
        self.draft_tokens = Counter(p + "speculative_draft_tokens", "Tokens drafted by speculative decoding",
                                    ["model"], registry=r)
        self.draft_accepted_tokens = Counter(
            p + "speculative_accepted_tokens", "Drafted tokens the model accepted (acceptance rate: this over "
            "speculative_draft_tokens)", ["model"], registry=r)
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds",
            "From the request's arrival to its first streamed chunk (queueing and a load included)",
            ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            p + "inter_token_latency_seconds", "Between two streamed chunks of one completion (usually one token)",
            ["model"], buckets=ITL_BUCKETS, registry=r)
        self.loads = Counter(p + "model_loads", "Model loads, by outcome (ok, error)", ["model", "outcome"],
                             registry=r)
        self.load_duration = Histogram(p + "model_load_duration_seconds",
                                       "From the start of fit/alloc/commit until the runner answers",
                                       ["model"], buckets=LOAD_BUCKETS, registry=r)
        self.unloads = Counter(
            p + "model_unloads", "Models unloaded, by reason: evictions (max_loaded_models, memory), reload, "
            "keep_alive, stop, crash, hung, other", ["model", "reason"], registry=r)
        self.runner_crashes = Counter(p + "runner_crashes", "Runner processes that exited unasked or hung",
                                      ["model"], registry=r)
        self.registry.register(_SchedulerCollector(scheduler))
        self.recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)

    # ------------------------------------------------------------ the scheduler's events

    def model_loaded(self, runner: RunnerRef, seconds: float) -> None:
        self.loads.labels(model_name(runner), "ok").inc()
        self.load_duration.labels(model_name(runner)).observe(seconds)

    def model_load_failed(self, model: str) -> None:
        self.loads.labels(model, "error").inc()

    def model_unloaded(self, runner: RunnerRef, reason: str) -> None:
        self.unloads.labels(model_name(runner), reason_label(reason)).inc()

    def runner_crashed(self, runner: RunnerRef) -> None:
        self.runner_crashes.labels(model_name(runner)).inc()

    # ------------------------------------------------------------ the request path

    def completion(self, model: str, start: float) -> CompletionTimer:
        """A timer for one completion of `model` whose request arrived at `start` (time.monotonic())."""
        return CompletionTimer(self, model, start)

    def recent_requests(self) -> list[dict[str, Any]]:
        return [asdict(entry) for entry in reversed(self.recent)]

    def middleware(self) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        """Count every answer by its route's pattern (bounded: an unknown path is `unmatched`)."""

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            status = "500"
            try:
                response = await handler(request)
                status = str(response.status)
                return response
            except web.HTTPException as err:
                status = str(err.status)
                raise
            except asyncio.CancelledError:  # the client went away before the handler ended
                status = "cancelled"
                raise
            finally:
                route = request.match_info.route.resource
                name = route.canonical if route is not None else "unmatched"
                self.requests.labels(request.method, name, status).inc()

        return count

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics: the text exposition format."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _SchedulerCollector(Collector):
    """The present state, read from the scheduler at scrape time (on the event loop, so it is consistent)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def describe(self) -> list[Metric]:
        return []  # known only at scrape time; an empty description keeps auto_describe from collecting here

    def collect(self) -> Iterator[Metric]:
        p = PREFIX
        loaded = GaugeMetricFamily(p + "loaded_models", "Models with a runner (loading, idle, busy or draining)")
        queue = GaugeMetricFamily(p + "queue_depth", "Requests waiting for a model: for a slot or for its load",
                                  labels=["model"])
        in_flight = GaugeMetricFamily(p + "requests_in_flight", "Requests holding one of a model's slots",
                                      labels=["model"])
        state = GaugeMetricFamily(p + "model_state", "1 for the state a loaded model is in", labels=["model", "state"])
        memory = GaugeMetricFamily(
            p + "model_memory_bytes", "Memory a loaded model holds per device and kind, as its runner reported it",
            labels=["model", "device", "kind"])
        runners = [r for r in self.scheduler.loaded_models() if r.model is not None]
        loaded.add_metric([], len(runners))
        pending = self.scheduler.pending_reqs.qsize() + len(self.scheduler.parked)
        for runner in runners:
            key = model_name(runner)
            queue.add_metric([key], self.scheduler.queue_depth(runner))
            in_flight.add_metric([key], runner.active)
            state.add_metric([key, runner.state], 1)
            for device, kind, size in device_memory(runner):
                memory.add_metric([key, device, kind], size)
        yield from (loaded, queue, in_flight, state, memory)
        yield GaugeMetricFamily(p + "scheduler_pending_requests", "Requests waiting to be scheduled (not yet "
                                "given a runner)", value=pending)


def device_memory(runner: RunnerRef) -> list[tuple[str, str, int]]:
    """(device, kind, bytes) of a loaded runner's memory report: weights (token embeddings on the CPU included),
    kv_cache and graph per device."""
    report = getattr(runner.llama, "memory", None)
    if report is None:
        return []
    out = [("CPU", "weights", report.input_weights + sum(report.cpu.weights)),
           ("CPU", "kv_cache", sum(report.cpu.cache)), ("CPU", "graph", report.cpu.graph)]
    for gpu in report.gpus:
        name = gpu.name or gpu.device_id.id
        out += [(name, "weights", sum(gpu.weights)), (name, "kv_cache", sum(gpu.cache)), (name, "graph", gpu.graph)]
    return out
