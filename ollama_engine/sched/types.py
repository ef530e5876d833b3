"""What the scheduler passes around: models, runner options, requests and the loaded-runner record.

Names follow Ollama's server/sched.go (LlmRequest, runnerRef) so that its tests port line for line; the
Go channels successCh/errCh become one asyncio.Future per request, and a request's context becomes Context.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ollama_engine.ml.memory import DeviceID, DeviceInfo, SystemInfo

log = logging.getLogger(__name__)

MAX_QUEUE_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"  # two spaces, as Ollama
INCOMPATIBLE = (
    "this model may be incompatible with your version of Ollama. If you previously pulled this model, try "
    "updating it by running `ollama pull {name}`"
)
RUNNER_STOPPED = (
    "model runner has unexpectedly stopped, this may be due to resource limitations or an internal error, "
    "check ollama server logs for details"
)
# Families whose runner gets one slot whatever OLLAMA_NUM_PARALLEL says (sched.go, f63eea3d).
SINGLE_SLOT_FAMILIES = frozenset({
    "mllama", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3next", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "nemotron_h_omni",
})


class ServerBusyError(Exception):
    """A queue is full (Ollama's ErrMaxQueue): HTTP 503 with Retry-After."""

    def __init__(self, message: str = MAX_QUEUE_MESSAGE, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RunnerFailedError(Exception):
    """The runner serving a request crashed, hung or was force-stopped."""


class StatusError(Exception):
    """The runner answered a request with an HTTP error; the API passes its code through."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Context:
    """Go's context.Context, reduced to what the scheduler needs: cancelled once, with callbacks.

    A handler cancels its request's context when it ends or its client goes away; for the scheduler that
    means "request finished". A child is cancelled with its parent.
    """

    def __init__(self, parent: Context | None = None) -> None:
        self._done = False
        self._callbacks: list[Callable[[], None]] = []
        self._event = asyncio.Event()
        if parent is not None:
            parent.add_done_callback(self.cancel)

    def cancel(self) -> None:
        if self._done:
            return
        self._done = True
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Run `callback` when cancelled (at once if it already is)."""
        if self._done:
            callback()
        else:
            self._callbacks.append(callback)

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class Model:
    """The model a request names (Ollama's *Model, reduced to what scheduling needs)."""

    name: str = ""
    short_name: str = ""
    model_path: str = ""
    digest: str = ""
    adapter_paths: list[str] = field(default_factory=list)
    projector_paths: list[str] = field(default_factory=list)
    draft_path: str = ""  # a draft model for speculative decoding, sent to the runner as DraftPath
    capabilities: list[str] = field(default_factory=list)
    family: str = ""


def model_key(model: Model | None) -> str:
    """Ollama's schedulerModelKey: two names that share a blob share one runner."""
    if model is None:
        return ""
    if model.model_path:
        return model.model_path
    for prefix, value in (("digest:", model.digest), ("name:", model.name), ("short:", model.short_name)):
        if value:
            return prefix + value
    return ""


@dataclass
class ModelInfo:
    """What the scheduler reads from a GGUF before it starts a runner (Ollama's llm.LoadModel)."""

    architecture: str = ""
    block_count: int = 0
    context_length: int = 0  # n_ctx_train; 0: unknown
    embedding: bool = False  # a pooling model: no completion, one slot
    file_size: int = 0


MIN_NUM_CTX = 4
MIN_NUM_CTX_VISION = 2048  # an image's tokens must fit beside the text (Ollama's GetRunner)


def fit_num_ctx(num_ctx: int, context_train: int = 0, vision: bool = False) -> int:
    """The context a runner gets for a requested num_ctx: the one place it is clamped.

    At least 4 (2048 for a vision model, as Ollama), at most the model's training context when known."""
    num_ctx = max(num_ctx, MIN_NUM_CTX_VISION if vision else MIN_NUM_CTX)
    if context_train > 0:
        num_ctx = min(num_ctx, context_train)
    return max(num_ctx, MIN_NUM_CTX)


RUNNER_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread")


@dataclass
class Options:
    """The options that shape a runner (needsReload's set); None means the request did not say.

    A request that leaves an option out accepts whatever the loaded runner has (pain point 1). The runner
    record keeps the resolved values it was loaded with.
    """

    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None  # layers to offload; -1 automatic
    main_gpu: int | None = None
    use_mmap: bool | None = None
    num_thread: int | None = None

    @classmethod
    def from_request(cls, options: Mapping[str, Any] | None) -> Options:
        """The runner options present in an API `options` object (others are sampling options)."""
        options = options or {}
        return cls(**{name: options[name] for name in RUNNER_OPTIONS if options.get(name) is not None})

    def resolved(self, default_num_ctx: int, context_train: int = 0, vision: bool = False) -> Options:
        """Every field filled: Ollama's defaults, num_ctx as fit_num_ctx makes it."""
        num_ctx = self.num_ctx if self.num_ctx is not None else default_num_ctx
        return Options(
            num_ctx=fit_num_ctx(num_ctx, context_train, vision),
            num_batch=self.num_batch if self.num_batch is not None else 512,
            num_gpu=self.num_gpu if self.num_gpu is not None else -1,
            main_gpu=self.main_gpu if self.main_gpu is not None else 0,
            use_mmap=self.use_mmap,
            num_thread=self.num_thread if self.num_thread is not None else 0,
        )

    def copy(self) -> Options:
        return dataclasses.replace(self)


class Server(Protocol):
    """A runner as the scheduler drives it (Ollama's llm.LlamaServer): the seam the tests replace."""

    model_path: str

    async def load(self, system_info: SystemInfo, gpus: Sequence[DeviceInfo], require_full: bool) -> list[DeviceID]:
        ...

    async def ping(self, fresh: float = 0.0) -> None: ...

    async def wait_until_running(self) -> None: ...

    def completion(self, prompt: str, options: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    def close(self) -> None: ...

    def memory_size(self) -> tuple[int, int]: ...

    def vram_by_gpu(self, device_id: DeviceID) -> int: ...

    def pid(self) -> int: ...

    def has_exited(self) -> bool: ...

    def exit_reason(self) -> str: ...

    def context_length(self) -> int: ...

    def add_exit_callback(self, callback: Callable[[], None]) -> None: ...


NewServerFn = Callable[
    [SystemInfo, Sequence[DeviceInfo], str, ModelInfo, list[str], list[str], Options, int], Server
]


@dataclass
class PreparedLoad:
    """A runner started for a request that did not fit yet, kept with it while others are evicted."""

    server: Server
    info: ModelInfo
    opts: Options  # resolved
    num_parallel: int


@dataclass(eq=False)
class LlmRequest:
    """One request for a runner. `future` gets the RunnerRef or the error (Go's successCh / errCh)."""

    ctx: Context
    model: Model
    opts: Options
    session_duration: float | None = None  # seconds; None: not given (differs from 0); inf: forever
    future: asyncio.Future[RunnerRef] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    sched_attempts: int = 0
    runner: RunnerRef | None = None  # the runner it was given: its finish counts there and nowhere else
    enqueued_at: float = field(default_factory=time.monotonic)
    prepared: PreparedLoad | None = None

    def __post_init__(self) -> None:
        # an error nobody awaits (the client left) must not be logged as "never retrieved"
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def succeed(self, runner: RunnerRef) -> None:
        if not self.future.done():
            self.future.set_result(runner)

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)

    def close_prepared(self) -> None:
        if self.prepared is not None:
            self.prepared.server.close()
            self.prepared = None


class RequestQueue:
    """The bounded FIFO of requests waiting to be scheduled (Go's pendingReqCh).

    Unlike asyncio.Queue it can be looked into: /api/ps counts what waits here per model. One consumer
    (process_pending) takes from it; anyone may put."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = max(maxsize, 1)
        self._items: collections.deque[LlmRequest] = collections.deque()
        self._nonempty = asyncio.Event()

    def put_nowait(self, req: LlmRequest) -> None:
        """Queue `req`; asyncio.QueueFull when maxsize requests already wait."""
        if len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        self._items.append(req)
        self._nonempty.set()

    async def get(self) -> LlmRequest:
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()
        return self._items.popleft()

    def get_nowait(self) -> LlmRequest:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[LlmRequest]:
        """The waiting requests, oldest first."""
        return list(self._items)


@dataclass(eq=False)
class RunnerRef:
    """One loaded (or loading) model: its runner, reference count, keep-alive and state."""

    model: Model | None = None
    model_path: str = ""
    model_key: str = ""
    llama: Server | None = None
    options: Options | None = None  # resolved options it was loaded with; None once unloaded
    info: ModelInfo | None = None
    num_parallel: int = 1
    session_duration: float = 0.0
    ref_count: int = 0
    loading: bool = False
    draining: bool = False  # chosen for unload: takes no new requests (pain points 4 and 5)
    drain_reason: str = ""
    expire_requested: bool = False  # expire as soon as the reference count reaches zero
    failure: str = ""  # set when the runner crashed, hung or was force-stopped: in-flight requests fail with it
    pid: int = -1
    gpus: list[DeviceID] = field(default_factory=list)
    discrete_gpus: bool = False
    vram_size: int = 0
    total_size: int = 0
    expire_timer: asyncio.TimerHandle | None = None
    expires_at: float | None = None  # wall-clock seconds
    last_used: float = field(default_factory=time.monotonic)
    ready: asyncio.Future[RunnerRef] | None = None
    waiting: int = 0  # requests holding a reference, waiting for a slot
    active: int = 0  # requests holding a slot
    closing: bool = False
    monitor: asyncio.Task[None] | None = None
    _slots: asyncio.Semaphore | None = field(default=None, repr=False)

    @property
    def state(self) -> str:
        """loading, idle, busy or draining, as /api/ps shows it."""
        if self.draining:
            return "draining"
        if self.loading:
            return "loading"
        return "busy" if self.ref_count > 0 else "idle"

    def stop_timer(self) -> None:
        if self.expire_timer is not None:
            self.expire_timer.cancel()
            self.expire_timer = None

    def unload(self) -> None:
        """Close the runner and forget the model; safe without a runner (Ollama's runnerRef.unload)."""
        self.stop_timer()
        self.closing = True
        if self.monitor is not None:
            self.monitor.cancel()
            self.monitor = None
        if self.llama is not None:
            self.llama.close()
        self.model = None
        self.options = None
        self.gpus = []

    async def acquire_slot(self) -> None:
        """Wait for one of the runner's parallel slots; the wait is what /api/ps shows as queue depth."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(max(self.num_parallel, 1))
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1

    def release_slot(self) -> None:
        assert self._slots is not None
        self.active -= 1
        self._slots.release()


def session_sort_key(runner: RunnerRef) -> tuple[float, str]:
    """findRunnerToUnload's order: shortest keep-alive first, then the model path."""
    duration = runner.session_duration if runner.session_duration >= 0 else math.inf
    return duration, runner.model_path or runner.model_key
