"""The scheduler: which runner serves a request, when runners load, and when they unload.

A port of Ollama's server/sched.go (f63eea3d) onto one asyncio event loop, with the same seams
(new_server_fn, get_gpu_fn, get_system_info_fn, load_fn, wait_for_recovery) so that sched_test.go ports
line for line. Where Ollama's users hit trouble (reference §5) it behaves differently:

- a request that leaves a runner option out accepts the loaded runner, and a smaller num_ctx is served by a
  larger loaded context; every reload is logged with its reason;
- requests for a loaded model wait for a slot in a bounded per-model queue (503 when full), like the global one;
- a request that must wait for memory is parked and the loop goes on with the next one (no head-of-line
  blocking); any unload retries the parked requests;
- a runner chosen for unload is *draining*: new requests do not join it (so it cannot be resurrected);
- a load runs to its end even when the client that started it goes away;
- a runner that exits or stops answering /health fails its in-flight requests at once and is reloaded
  on the next request;
- eviction picks idle runners first, least recently used, and frees just enough memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from ollama_engine.envconfig import EnvConfig
from ollama_engine.llm.layout import LoadRequiredFullError
from ollama_engine.ml.memory import DeviceInfo, SystemInfo

from .types import (
    INCOMPATIBLE,
    RUNNER_STOPPED,
    SINGLE_SLOT_FAMILIES,
    Context,
    LlmRequest,
    Model,
    ModelInfo,
    NewServerFn,
    Options,
    PreparedLoad,
    RequestQueue,
    RunnerFailedError,
    RunnerRef,
    Server,
    ServerBusyError,
    fit_num_ctx,
    model_key,
    session_sort_key,
)

log = logging.getLogger(__name__)

DEFAULT_MODELS_PER_GPU = 3
PING_TIMEOUT = 10.0
PING_TIMEOUT_LOADING = 120.0
PING_FRESH = 1.0  # a runner that answered this recently is not pinged again before reuse (Ollama pings always)
VRAM_POLL_INTERVAL = 0.25
GIB = 1 << 30

GetGpuFn = Callable[[list[RunnerRef]], Awaitable[list[DeviceInfo]]]
LoadFn = Callable[[LlmRequest, SystemInfo, list[DeviceInfo], bool], Awaitable[bool]]


async def _no_gpus(runners: list[RunnerRef]) -> list[DeviceInfo]:
    return []


class SchedulerEvents:
    """What the scheduler tells an observer (serve's /metrics); these defaults ignore it. Called on the event
    loop, so an observer must only record (no I/O)."""

    def model_loaded(self, runner: RunnerRef, seconds: float) -> None:
        """A runner is ready: `seconds` from the start of its fit/alloc/commit until it answered."""

    def model_load_failed(self, model: str) -> None:
        """A load ended in an error (the request that started it fails with it)."""

    def model_unloaded(self, runner: RunnerRef, reason: str) -> None:
        """A runner was stopped; `reason` is the drain reason the log shows (eviction, reload, keep-alive...)."""

    def runner_crashed(self, runner: RunnerRef) -> None:
        """A runner process exited without being asked to, or stopped answering and was killed."""


def default_num_ctx(config: EnvConfig, gpus: Sequence[DeviceInfo]) -> int:
    """OLLAMA_CONTEXT_LENGTH, or Ollama's tier by total VRAM: 4k below 23 GiB, 32k below 47 GiB, else 256k."""
    if config.context_length > 0:
        return config.context_length
    vram = sum(gpu.total_memory for gpu in gpus) - config.gpu_overhead * len(gpus)
    if vram >= 47 * GIB:
        return 262144
    if vram >= 23 * GIB:
        return 32768
    return 4096


class Scheduler:
    """Loaded runners by model key, the pending queue, and the loops that change them."""

    def __init__(
        self,
        config: EnvConfig | None = None,
        *,
        new_server_fn: NewServerFn | None = None,
        get_gpu_fn: GetGpuFn | None = None,
        get_system_info_fn: Callable[[], SystemInfo] | None = None,
        read_model_info: Callable[[str], ModelInfo] | None = None,
    ) -> None:
        self.config = config or EnvConfig.from_env()
        self.pending_reqs = RequestQueue(self.config.max_queue)
        self.finished_reqs: asyncio.Queue[LlmRequest] = asyncio.Queue()
        self.expired: asyncio.Queue[RunnerRef] = asyncio.Queue()
        self.unloaded: asyncio.Queue[RunnerRef] = asyncio.Queue()
        self.loaded: dict[str, RunnerRef] = {}
        self.active_loading: Server | None = None  # the runner being loaded right now
        self.parked: list[LlmRequest] = []  # waiting for memory (an unload) before they can load
        self.max_runners = self.config.max_loaded_models  # read once; 0 becomes 3 per GPU at the first load
        self.wait_for_recovery = 5.0
        self.health_interval = 5.0  # a loaded runner is pinged this often ...
        self.health_failures = 3  # ... and declared hung after this many failures in a row
        self.load_fn: LoadFn = self.load
        self.get_gpu_fn: GetGpuFn = get_gpu_fn or _no_gpus
        self.get_system_info_fn = get_system_info_fn or _default_system_info
        self.new_server_fn = new_server_fn or self._default_new_server
        self.read_model_info = read_model_info or _read_model_info
        self.events = SchedulerEvents()
        self._schedule_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Start the loops (Ollama's Run); they end with stop() or shutdown()."""
        for loop in (self.process_pending, self.process_finished, self.process_expired, self.process_unloaded):
            self._tasks.append(asyncio.create_task(loop(), name=f"sched.{loop.__name__}"))

    async def stop(self) -> None:
        """Stop the loops, leaving runners as they are."""
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def shutdown(self) -> None:
        """Stop the loops, fail every waiting request and stop every runner subprocess (no orphans)."""
        self._closed = True
        await self.stop()
        self.unload_all_runners()
        for req in self._drain_pending():
            req.close_prepared()
            req.fail(RunnerFailedError("server shutting down"))

    def _drain_pending(self) -> list[LlmRequest]:
        requests, self.parked = list(self.parked), []
        while not self.pending_reqs.empty():
            requests.append(self.pending_reqs.get_nowait())
        return requests

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------ entry points

    async def get_runner(
        self, ctx: Context, model: Model, opts: Options, session_duration: float | None
    ) -> LlmRequest:
        """Queue a request for `model`; its future resolves to a ready RunnerRef or an error (GetRunner)."""
        req = LlmRequest(ctx=ctx, model=model, opts=opts.copy(), session_duration=session_duration)
        if self._closed:
            req.fail(RunnerFailedError("server shutting down"))
            return req
        key = model_key(model)
        runner = self.loaded.get(key)
        if runner is not None and not runner.draining and await self.needs_reload(runner, req) is False:
            # the ping awaited: check that nothing changed meanwhile
            if self.loaded.get(key) is runner and not runner.draining:
                if runner.waiting >= self.config.max_queue:
                    req.fail(ServerBusyError())
                    return req
                self.use_loaded_runner(req, runner)
                return req
        try:
            self.pending_reqs.put_nowait(req)
        except asyncio.QueueFull:
            req.fail(ServerBusyError())
        return req

    def expire_runner(self, model: Model, force: bool = False) -> bool:
        """Unload `model` as soon as it is idle (keep_alive 0); with force, fail its in-flight requests now.

        The runner drains: new requests wait for the unload and then load it again. False if not loaded.
        """
        runner = self.loaded.get(model_key(model))
        if runner is None:
            return False
        runner.expires_at = time.time()
        self._drain(runner, "force stop" if force else "stop requested")
        if force and runner.llama is not None and not runner.closing:
            runner.failure = f"model '{model.name or runner.model_path}' was stopped"
            runner.llama.close()  # in-flight streams end at once with that error
        return True

    def unload_all_runners(self) -> None:
        """Close every runner and the one being loaded (Ollama's unloadAllRunners, at shutdown)."""
        if self.active_loading is not None:
            log.debug("shutting down currently loading runner")
            self.active_loading.close()
            self.active_loading = None
        for key, runner in self.loaded.items():
            if runner.llama is not None:
                log.debug("shutting down runner model=%s", key)
                runner.unload()

    def loaded_models(self) -> list[RunnerRef]:
        """A snapshot for /api/ps."""
        return list(self.loaded.values())

    def queue_depth(self, runner: RunnerRef) -> int:
        """Requests waiting for this runner: for one of its slots, or for it to (re)load."""
        waiting = [*self.parked, *self.pending_reqs.snapshot()]
        return runner.waiting + sum(
            1 for req in waiting if not req.ctx.done() and model_key(req.model) == runner.model_key
        )

    # ------------------------------------------------------------ the pending loop

    async def process_pending(self) -> None:
        """Take pending requests one at a time; those that must wait for memory are parked, not waited on."""
        while True:
            pending = await self.pending_reqs.get()
            async with self._schedule_lock:
                await self._schedule(pending)

    async def process_unloaded(self) -> None:
        """Any unload may free what a parked request waits for: retry them all.

        Grouped by model in order of each model's first request, so that a model that loads serves all its
        parked requests before another one can make it drain (otherwise every switch serves one request).
        """
        while True:
            await self.unloaded.get()
            async with self._schedule_lock:
                parked, self.parked = self.parked, []
                first: dict[str, int] = {}
                for i, req in enumerate(parked):
                    first.setdefault(model_key(req.model), i)
                parked.sort(key=lambda req: first[model_key(req.model)])
                for req in parked:
                    await self._schedule(req)

    async def _schedule(self, pending: LlmRequest) -> None:
        """One pass of processPending's inner loop for one request."""
        pending.sched_attempts += 1
        if pending.ctx.done():
            log.debug("pending request cancelled or timed out, skipping scheduling")
            pending.close_prepared()
            return
        key = model_key(pending.model)
        while True:
            runner = self.loaded.get(key)
            loaded_count = len(self.loaded)
            runner_to_expire: RunnerRef | None = None
            reason = ""
            if runner is not None:
                if runner.draining:
                    self._park(pending, f"model is unloading ({runner.drain_reason})")
                    return
                why = await self.reload_reason(runner, pending)
                if why is None:
                    pending.close_prepared()  # loaded meanwhile by another request
                    self.use_loaded_runner(pending, runner)
                    return
                if self.loaded.get(key) is not runner:
                    continue  # it went away while we pinged it
                runner_to_expire, reason = runner, f"reload: {why}"
            elif self.max_runners > 0 and loaded_count >= self.max_runners:
                runner_to_expire = self.find_runner_to_unload()
                reason = f"max loaded models reached ({self.max_runners}), needed for {pending.model.name or key}"
                if runner_to_expire is None and any(r.draining for r in self.loaded.values()):
                    self._park(pending, "waiting for a runner to unload")
                    return
            else:
                runners = list(self.loaded.values())
                gpus = [] if pending.opts.num_gpu == 0 else await self.get_gpu_fn(runners)
                system_info = self.get_system_info_fn()
                if self.max_runners <= 0:
                    self.max_runners = DEFAULT_MODELS_PER_GPU * max(len(gpus), 1)
                    log.debug("updating default concurrency max_runners=%d gpu_count=%d", self.max_runners, len(gpus))
                self.update_free_space(gpus)
                if loaded_count == 0:
                    await self.load_fn(pending, system_info, gpus, False)
                    return
                if not await self.load_fn(pending, system_info, gpus, True):
                    return
                shortfall = self._shortfall(pending, gpus, system_info)
                runner_to_expire = self.find_runner_to_unload(shortfall, gpus)
                reason = f"not enough memory for {pending.model.name or key} (short by {shortfall} bytes)"
                if runner_to_expire is None and any(r.draining for r in self.loaded.values()):
                    self._park(pending, "waiting for memory")
                    return
            if runner_to_expire is None:
                if not self.loaded:
                    continue
                self._park(pending, "waiting for a runner to unload")
                return
            self._drain(runner_to_expire, reason)
            self._park(pending, f"waiting for {runner_to_expire.model_key} to unload")
            return

    def _park(self, req: LlmRequest, why: str) -> None:
        log.debug("request parked model=%s reason=%s", model_key(req.model), why)
        self.parked.append(req)
        req.ctx.add_done_callback(lambda: self._unpark(req))

    def _unpark(self, req: LlmRequest) -> None:
        """A parked request whose client left: forget it, and stop the runner started for it."""
        if req in self.parked:
            self.parked.remove(req)
        req.close_prepared()

    def _drain(self, runner: RunnerRef, reason: str) -> None:
        """Mark for unload: no new requests, unload once the last in-flight one ends."""
        if not runner.draining:
            log.info("unloading model model=%s reason=%r in_flight=%d", runner.model_key, reason, runner.ref_count)
        runner.draining = True
        runner.drain_reason = runner.drain_reason or reason
        runner.stop_timer()
        runner.session_duration = 0
        runner.expire_requested = True
        if runner.ref_count <= 0:
            self.expired.put_nowait(runner)

    def _shortfall(self, req: LlmRequest, gpus: Sequence[DeviceInfo], system_info: SystemInfo) -> int:
        """Bytes the model being loaded lacks, from what its runner measured."""
        if req.prepared is None:
            return 0
        total, vram = req.prepared.server.memory_size()
        if gpus:
            return max(vram - max(gpu.free_memory for gpu in gpus), 0)
        return max(total - system_info.free_memory, 0)

    # ------------------------------------------------------------ loading

    async def load(self, req: LlmRequest, system_info: SystemInfo, gpus: list[DeviceInfo], require_full: bool) -> bool:
        """Start (or retry) a runner for req's model; True when other models must be evicted first."""
        num_parallel = max(self.config.num_parallel, 1)
        session_duration = self.config.keep_alive if req.session_duration is None else req.session_duration
        path = req.model.model_path
        if req.prepared is None:
            try:
                info = await asyncio.to_thread(self.read_model_info, path)
            except Exception as err:
                log.info("failed to read model path=%s error=%s", path, err)
                req.fail(err)
                return False
            if info.embedding or req.model.family in SINGLE_SLOT_FAMILIES or info.architecture in SINGLE_SLOT_FAMILIES:
                num_parallel = 1
            opts = req.opts.resolved(default_num_ctx(self.config, gpus), info.context_length,
                                     "vision" in req.model.capabilities)
            try:
                server = self.new_server_fn(
                    system_info, gpus, path, info, list(req.model.adapter_paths), list(req.model.projector_paths),
                    opts, num_parallel,
                )
                if req.model.draft_path:  # the runner loads it beside the model (LoadRequest.DraftPath)
                    server.draft_path = req.model.draft_path
            except Exception as err:
                if "failed to load model" in str(err):
                    err = RuntimeError(f"{err}: " + INCOMPATIBLE.format(name=req.model.short_name or req.model.name))
                req.fail(err)
                return False
        else:
            # a retry after an eviction: the runner started for this request waited with it (Ollama keeps one
            # such runner in activeLoading; here each parked request keeps its own, so others can load meanwhile)
            prepared, req.prepared = req.prepared, None
            server, info, opts, num_parallel = prepared.server, prepared.info, prepared.opts, prepared.num_parallel
            if server.model_path != path:
                raise RuntimeError(f"scheduler retried a load of {server.model_path} for {path}")
        self.active_loading = server
        load_started = time.monotonic()
        try:
            gpu_ids = await server.load(system_info, gpus, require_full)
        except LoadRequiredFullError as err:
            self.active_loading = None
            if require_full:
                req.prepared = PreparedLoad(server, info, opts, num_parallel)
            else:
                server.close()
                req.fail(err)
            return True
        except Exception as err:
            log.info("failed to load model path=%s error=%s", path, err)
            server.close()
            self.active_loading = None
            self.events.model_load_failed(req.model.name or model_key(req.model))
            req.fail(err)
            return False

        used = [gpu for gpu in gpus if gpu.device_id in gpu_ids]
        total, vram = server.memory_size()
        runner = RunnerRef(
            model=req.model, model_path=path, model_key=model_key(req.model), llama=server, options=opts, info=info,
            num_parallel=num_parallel, session_duration=session_duration, loading=True, pid=server.pid(),
            gpus=list(gpu_ids), discrete_gpus=any(not gpu.integrated for gpu in used), vram_size=vram,
            total_size=total, ready=asyncio.get_running_loop().create_future(),
        )
        runner.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        old = self.loaded.get(runner.model_key)
        if old is not None:
            log.warning("replacing a runner that was still registered model=%s", runner.model_key)
            old.unload()
        self.active_loading = None
        self.loaded[runner.model_key] = runner
        server.add_exit_callback(lambda: self._runner_exited(runner))
        log.info("loading model model=%s parallel=%d num_ctx=%s keep_alive=%s", runner.model_key, num_parallel,
                 opts.num_ctx, session_duration)
        self._spawn(self._wait_until_running(req, runner, load_started), f"sched.wait:{runner.model_key}")
        return False

    async def _wait_until_running(self, req: LlmRequest, runner: RunnerRef, load_started: float) -> None:
        """The load goes on whether or not the client that started it is still there (pain point 6)."""
        assert runner.llama is not None and runner.ready is not None
        try:
            await runner.llama.wait_until_running()
        except Exception as err:
            log.warning("model failed to start model=%s error=%s", runner.model_key, err)
            self.events.model_load_failed(req.model.name or runner.model_key)
            req.fail(err)
            runner.ready.set_exception(err)
            runner.loading = False
            self.expired.put_nowait(runner)
            return
        if runner.pid < 0:
            runner.pid = runner.llama.pid()
        runner.ref_count += 1
        runner.loading = False
        runner.last_used = time.monotonic()
        req.runner = runner
        req.ctx.add_done_callback(lambda: self.finished_reqs.put_nowait(req))
        runner.ready.set_result(runner)
        self.events.model_loaded(runner, time.monotonic() - load_started)
        req.succeed(runner)
        runner.monitor = self._spawn(self._monitor(runner), f"sched.monitor:{runner.model_key}")

    def use_loaded_runner(self, req: LlmRequest, runner: RunnerRef) -> None:
        """Give req a reference to runner; the future resolves once the runner is ready."""
        runner.ref_count += 1
        runner.stop_timer()
        if req.session_duration is not None:
            runner.session_duration = req.session_duration
        runner.last_used = time.monotonic()
        req.runner = runner
        if runner.ready is None or runner.ready.done() and not runner.ready.exception():
            req.succeed(runner)
        else:
            def resolved(ready: asyncio.Future[RunnerRef]) -> None:
                if ready.cancelled() or ready.exception() is not None:
                    req.fail(ready.exception() or RunnerFailedError("load cancelled"))
                else:
                    req.succeed(runner)

            runner.ready.add_done_callback(resolved)
        req.ctx.add_done_callback(lambda: self.finished_reqs.put_nowait(req))

    # ------------------------------------------------------------ reload decisions

    async def needs_reload(self, runner: RunnerRef, req: LlmRequest) -> bool:
        return await self.reload_reason(runner, req) is not None

    async def reload_reason(self, runner: RunnerRef, req: LlmRequest) -> str | None:
        """Why the loaded runner cannot serve req, or None. Options the request leaves out never count."""
        if runner.options is None:
            return "runner was unloaded"
        if runner.failure:
            return runner.failure
        model = runner.model or Model()
        if list(model.adapter_paths) != list(req.model.adapter_paths):
            return f"adapters changed ({model.adapter_paths} -> {req.model.adapter_paths})"
        if list(model.projector_paths) != list(req.model.projector_paths):
            return f"projectors changed ({model.projector_paths} -> {req.model.projector_paths})"
        if model.draft_path != req.model.draft_path:
            return f"draft model changed ({model.draft_path} -> {req.model.draft_path})"
        loaded, wanted = runner.options, req.opts
        if wanted.num_ctx is not None:
            train = runner.info.context_length if runner.info is not None else 0
            num_ctx = fit_num_ctx(wanted.num_ctx, train, "vision" in req.model.capabilities)
            if loaded.num_ctx is not None and num_ctx > loaded.num_ctx:
                return f"num_ctx {num_ctx} is larger than the loaded {loaded.num_ctx}"
        for name in ("num_batch", "main_gpu", "use_mmap", "num_thread", "num_gpu"):
            value = getattr(wanted, name)
            if value is None or (name == "num_gpu" and value < 0):
                continue
            if value != getattr(loaded, name):
                return f"{name} changed ({getattr(loaded, name)} -> {value})"
        if runner.llama is None:
            return "runner was unloaded"
        try:
            timeout = PING_TIMEOUT_LOADING if runner.loading else PING_TIMEOUT
            await asyncio.wait_for(runner.llama.ping(fresh=PING_FRESH), timeout)
        except Exception as err:
            return f"runner did not answer: {err or type(err).__name__}"
        return None

    # ------------------------------------------------------------ finishing and unloading

    async def process_completed(self) -> None:
        """processCompleted: finished requests and expired runners (both loops)."""
        await asyncio.gather(self.process_finished(), self.process_expired())

    async def process_finished(self) -> None:
        while True:
            finished = await self.finished_reqs.get()
            runner = finished.runner or self.loaded.get(model_key(finished.model))
            if runner is None or self.loaded.get(runner.model_key) is not runner:
                log.debug("finished request signal received after model unloaded model=%s", model_key(finished.model))
                continue
            runner.ref_count -= 1
            runner.last_used = time.monotonic()
            if runner.ref_count > 0:
                continue
            if runner.session_duration <= 0 or runner.expire_requested:
                log.debug("runner with zero duration has gone idle, expiring to unload model=%s", runner.model_key)
                runner.stop_timer()
                self.expired.put_nowait(runner)
            else:
                self._start_timer(runner)

    def _start_timer(self, runner: RunnerRef) -> None:
        runner.stop_timer()
        if math.isinf(runner.session_duration):
            runner.expires_at = math.inf
            return
        loop = asyncio.get_running_loop()
        runner.expire_timer = loop.call_later(runner.session_duration, self._timer_fired, runner)
        runner.expires_at = time.time() + runner.session_duration

    def _timer_fired(self, runner: RunnerRef) -> None:
        runner.expire_timer = None
        log.debug("timer expired, expiring to unload model=%s", runner.model_key)
        runner.drain_reason = runner.drain_reason or "keep-alive expired"
        self.expired.put_nowait(runner)

    async def process_expired(self) -> None:
        while True:
            runner = await self.expired.get()
            if runner.ref_count > 0 or runner.loading:
                # busy (or still loading: its first request will hold it): it unloads when its last request
                # finishes (Ollama polls every 10 ms instead)
                log.debug("expired event with positive ref count, retrying model=%s", runner.model_key)
                runner.expire_requested = True
                runner.draining = True
                continue
            current = self.loaded.get(runner.model_key)
            if current is None:
                log.debug("duplicate expired event, ignoring model=%s", runner.model_key)
                continue
            if current is not runner:
                log.debug("orphaned runner, unloading it model=%s", runner.model_key)
                runner.unload()
                continue
            reason = runner.drain_reason or runner.failure or "expired"
            log.info("model unloaded model=%s reason=%r", runner.model_key, reason)
            self.events.model_unloaded(runner, reason)
            exited = runner.llama is None or runner.llama.has_exited()
            baseline = None if exited else await self._vram_baseline(runner)
            runner.unload()
            del self.loaded[runner.model_key]
            self._spawn(self._after_unload(runner, baseline), f"sched.unloaded:{runner.model_key}")

    async def _after_unload(self, runner: RunnerRef, baseline: int | None) -> None:
        if baseline is not None:
            await self._wait_for_vram_recovery(runner, baseline)
        self.unloaded.put_nowait(runner)

    def _needs_vram_wait(self, runner: RunnerRef) -> bool:
        """Only discrete GPUs other than a single Metal one free their memory with a delay worth waiting for."""
        if not runner.gpus or not runner.discrete_gpus:
            return False
        return not (len(runner.gpus) == 1 and runner.gpus[0].library == "Metal")

    async def _vram_baseline(self, runner: RunnerRef) -> int | None:
        if not self._needs_vram_wait(runner):
            return None
        return sum(gpu.free_memory for gpu in await self.get_gpu_fn([]))

    async def _wait_for_vram_recovery(self, runner: RunnerRef, baseline: int) -> None:
        """Wait (at most wait_for_recovery) until 75% of the runner's VRAM shows as free again."""
        deadline = time.monotonic() + self.wait_for_recovery
        while time.monotonic() < deadline:
            await asyncio.sleep(VRAM_POLL_INTERVAL)
            free = sum(gpu.free_memory for gpu in await self.get_gpu_fn([]))
            if free - baseline > 0.75 * runner.vram_size:
                return
        log.warning("gpu VRAM usage didn't recover within timeout seconds=%s model=%s", self.wait_for_recovery,
                    runner.model_key)

    # ------------------------------------------------------------ crashed and hung runners

    def _runner_exited(self, runner: RunnerRef) -> None:
        """The runner process ended without being asked to: fail what uses it, unload it, reload on demand."""
        if runner.closing or self.loaded.get(runner.model_key) is not runner:
            return
        reason = runner.llama.exit_reason() if runner.llama is not None else "unknown"
        log.error("model runner stopped unexpectedly model=%s reason=%r", runner.model_key, reason)
        if runner.drain_reason != "force stop":  # /api/stop with force kills it on purpose
            self.events.runner_crashed(runner)
        runner.failure = runner.failure or f"{RUNNER_STOPPED}: {reason}"
        self._drain(runner, "runner process exited")

    async def _monitor(self, runner: RunnerRef) -> None:
        """Ping a loaded runner; one that stops answering is killed (and so handled as a crash)."""
        failures = 0
        while not runner.closing and runner.llama is not None:
            await asyncio.sleep(self.health_interval)
            if runner.closing or runner.llama is None or runner.llama.has_exited():
                return
            try:
                await asyncio.wait_for(runner.llama.ping(), PING_TIMEOUT)
                failures = 0
            except Exception as err:
                failures += 1
                log.warning("runner health check failed model=%s failures=%d error=%s", runner.model_key,
                            failures, err or type(err).__name__)
                if failures >= self.health_failures:
                    runner.failure = f"model runner stopped responding (no health answer {failures} times in a row)"
                    log.error("model runner hung, stopping it model=%s", runner.model_key)
                    llama = runner.llama
                    self._drain(runner, "runner hung")
                    llama.close()
                    self._runner_exited(runner)
                    return

    # ------------------------------------------------------------ memory

    def update_free_space(self, gpus: list[DeviceInfo]) -> None:
        """Free GPU memory: the smaller of what the GPU reports and total minus what loaded runners hold."""
        if not gpus:
            return
        for gpu in gpus:
            predicted = sum(
                runner.llama.vram_by_gpu(gpu.device_id) for runner in self.loaded.values() if runner.llama is not None
            )
            if predicted > gpu.total_memory:
                log.warning("predicted usage exceeds VRAM gpu=%s totalMemory=%d predicted=%d", gpu.device_id.id,
                            gpu.total_memory, predicted)
                gpu.free_memory = 0
            elif gpu.total_memory - predicted < gpu.free_memory:
                gpu.free_memory = gpu.total_memory - predicted

    def _freed_by(self, runner: RunnerRef, gpus: Sequence[DeviceInfo]) -> int:
        if runner.llama is None:
            return 0
        if gpus:
            return sum(runner.llama.vram_by_gpu(gpu.device_id) for gpu in gpus)
        return max(runner.total_size - runner.vram_size, 0)

    def find_runner_to_unload(self, shortfall: int = 0, gpus: Sequence[DeviceInfo] = ()) -> RunnerRef | None:
        """Idle runners first: the least recently used of those that free enough (else the one freeing most).

        When every runner is busy: Ollama's order (shortest keep-alive, then path); the caller waits for it
        to drain. Runners already draining are not chosen again.
        """
        candidates = [runner for runner in self.loaded.values() if not runner.draining]
        if not candidates:
            return None
        idle = [runner for runner in candidates if runner.ref_count <= 0 and not runner.loading]
        if idle:
            if shortfall > 0:
                enough = [runner for runner in idle if self._freed_by(runner, gpus) >= shortfall]
                if enough:
                    return min(enough, key=lambda r: (self._freed_by(r, gpus), r.last_used))
                return max(idle, key=lambda r: (self._freed_by(r, gpus), -r.last_used))
            return min(idle, key=lambda r: r.last_used)
        if any(runner.draining for runner in self.loaded.values()):
            return None  # something is already on its way out: wait for it rather than drain a second runner
        return min(candidates, key=session_sort_key)

    # ------------------------------------------------------------ defaults

    def _default_new_server(
        self, system_info: SystemInfo, gpus: Sequence[DeviceInfo], model_path: str, info: ModelInfo,
        adapters: list[str], projectors: list[str], opts: Options, num_parallel: int,
    ) -> Server:
        from .llama_server import LlamaServer

        return LlamaServer.start(model_path, info, gpus, adapters, projectors, opts, num_parallel, self.config)


def _default_system_info() -> SystemInfo:
    from ollama_engine.llm.discovery import system_info

    return system_info()


def _read_model_info(path: str) -> ModelInfo:
    """The GGUF facts the scheduler needs; raises for a path that is not a readable GGUF."""
    from ollama_engine.fs import GGUFFile

    gguf = GGUFFile.open(path)
    config = gguf.config
    return ModelInfo(
        architecture=gguf.architecture,
        block_count=config.get_uint("block_count", 0),
        context_length=config.get_uint("context_length", 0),
        embedding="pooling_type" in config,
        file_size=gguf.file_size,
    )
