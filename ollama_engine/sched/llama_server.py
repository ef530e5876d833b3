"""The scheduler's view of one real runner subprocess (Ollama's llm.LlamaServer), on top of ollama_engine.llm.

Blocking parts of the parent side (the fit → alloc → commit loop, waiting for the weights) run in worker
threads; completions stream over aiohttp so that a client going away closes the runner connection too.
A thread waits on the process so that a crash is noticed at once, not at the next request.

Every request to one runner goes through one aiohttp session whose connections are kept alive: a ping and a
completion reuse a connection instead of building a session and connecting for each (Ollama's parent keeps
its runner connections alive through Go's http.Client too). The session is closed once the runner is gone
and no request uses it: a stream still reading ends first, by itself, with the runner's error (closing the
session under it was what hung a first try at this, bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import aiohttp

from ollama_engine.envconfig import EnvConfig
from ollama_engine.llm.load import LoadOptions, load, mmap_weights
from ollama_engine.llm.runner_handle import RunnerError, RunnerHandle, visible_devices_env
from ollama_engine.ml.memory import BackendMemory, DeviceID, DeviceInfo, SystemInfo, resolve_flash_attention
from ollama_engine.runner.sequence import capped_num_predict
from ollama_engine.server.wire import ServerStatus

from .types import RUNNER_STOPPED, ModelInfo, Options, RunnerFailedError, StatusError

log = logging.getLogger(__name__)


class _Recorder:
    """The load loop's target: the runner, remembering the last memory report (size-aware eviction uses it)."""

    def __init__(self, server: LlamaServer) -> None:
        self.server = server

    def load(self, request: dict[str, Any]) -> tuple[bool, BackendMemory]:
        success, memory = self.server.handle.load(request)
        self.server.memory = memory
        return success, memory


class LlamaServer:
    """One `ollama-engine runner` process serving one model."""

    def __init__(
        self, handle: RunnerHandle, model_path: str, info: ModelInfo, options: Options, num_parallel: int,
        config: EnvConfig,
    ) -> None:
        self.handle = handle
        self.model_path = model_path
        self.info = info
        self.options = options
        self.num_parallel = num_parallel
        self.config = config
        self.memory = BackendMemory()
        self.projector_path = ""  # the model's separate vision projector (an mmproj layer in the store), if any
        self.draft_path = ""  # the model's draft model for speculative decoding (a draft layer), if any
        self._exit_callbacks: list[Callable[[], None]] = []
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._session: aiohttp.ClientSession | None = None  # made at the first request, in the event loop
        self._requests = 0  # requests using the session now
        self._session_done = False  # the runner is gone: close the session once no request uses it
        self._answered_at = -math.inf  # time.monotonic() of the runner's last healthy answer or completion line
        threading.Thread(target=self._watch, name=f"runner-{handle.process.pid}", daemon=True).start()

    @classmethod
    def start(
        cls, model_path: str, info: ModelInfo, gpus: Sequence[DeviceInfo], adapters: list[str], projectors: list[str],
        options: Options, num_parallel: int, config: EnvConfig,
    ) -> LlamaServer:
        if adapters:
            raise RunnerError("this engine does not support LoRA adapters yet")
        if len(projectors) > 1:
            raise RunnerError("this engine runs one vision projector per model")
        handle = RunnerHandle.start(model_path, env=visible_devices_env(gpus), rpc_servers=config.rpc_servers)
        server = cls(handle, model_path, info, options, num_parallel, config)
        server.projector_path = projectors[0] if projectors else ""
        return server

    # ------------------------------------------------------------ process

    def _watch(self) -> None:
        self.handle.process.wait()
        try:
            self._loop.call_soon_threadsafe(self._exited)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def _exited(self) -> None:
        if not self._closed:
            log.debug("runner process exited pid=%d code=%s", self.pid(), self.handle.process.returncode)
        self._close_session()
        for callback in self._exit_callbacks:
            callback()

    def add_exit_callback(self, callback: Callable[[], None]) -> None:
        self._exit_callbacks.append(callback)

    def pid(self) -> int:
        return self.handle.process.pid

    def has_exited(self) -> bool:
        return self.handle.exited()

    def exit_reason(self) -> str:
        return self.handle.exit_reason()

    def close(self) -> None:
        """Kill the runner and reap it."""
        self._closed = True
        self.handle.close()
        try:
            self._loop.call_soon_threadsafe(self._close_session)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def _close_session(self) -> None:
        """Close the kept-alive connections once the process is dead and no request uses them: a stream still
        reading ends by itself (the dead runner's end of the connection is closed), with the runner's error."""
        self._session_done = True
        session = self._session
        if session is not None and not self._requests and not session.closed:
            self._session = None
            self._loop.create_task(session.close())

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The runner's session for one request: its connections are kept alive between requests (no limit on
        their number: each parallel completion holds one while it streams)."""
        if self.has_exited() or self._closed:
            raise RunnerFailedError(RUNNER_STOPPED)  # what connecting to it said before
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._requests += 1
        try:
            yield self._session
        finally:
            self._requests -= 1
            if self._session_done:
                self._close_session()

    # ------------------------------------------------------------ loading

    def _load_options(self, gpus: Sequence[DeviceInfo], system_info: SystemInfo) -> LoadOptions:
        flash, why = resolve_flash_attention(self.config.flash_attention, tuple(gpus))
        log.info("flash attention %s model=%s", why, self.model_path)
        kv_cache_type, value_type = self.config.kv_cache_type, self.config.kv_cache_type_v
        if not flash and kv_cache_type not in ("", "f16"):  # as Ollama: the shared type falls back to f16
            log.warning("quantized kv cache requested but flash attention disabled type=%s", kv_cache_type)
            kv_cache_type = ""
        if not flash and value_type not in ("", "f16"):  # a quantized V needs flash attention; K does not
            log.warning("quantized V cache requested but flash attention disabled type=%s", value_type)
            value_type = ""
        assert self.options.num_ctx is not None and self.options.num_batch is not None
        return LoadOptions(
            num_ctx=self.options.num_ctx, parallel=self.num_parallel,
            batch_size=self.options.num_ctx if self.info.embedding else self.options.num_batch,
            num_gpu=self.options.num_gpu if self.options.num_gpu is not None else -1,
            num_threads=max(self.options.num_thread or 0, 0), flash_attention=flash,  # <= 0: the default
            kv_cache_type=kv_cache_type, kv_cache_type_k=self.config.kv_cache_type_k, kv_cache_type_v=value_type,
            use_mmap=mmap_weights(self.options.use_mmap, gpus, system_info.free_memory,
                                  os.path.getsize(self.model_path)),
            gpu_overhead=self.config.gpu_overhead,
            sched_spread=self.config.sched_spread,
            projector_path=self.projector_path,
            draft_path=self.draft_path,
        )

    async def load(self, system_info: SystemInfo, gpus: Sequence[DeviceInfo], require_full: bool) -> list[DeviceID]:
        """fit → alloc → commit; raises LoadRequiredFullError when require_full and it does not fit."""
        await asyncio.to_thread(self.handle.wait_launched)
        options = self._load_options(gpus, system_info)
        result = await asyncio.to_thread(
            load, _Recorder(self), system_info, gpus, self.info.block_count + 1, options, require_full
        )
        self.memory = result.memory
        return result.device_ids()

    async def wait_until_running(self) -> None:
        await asyncio.to_thread(self.handle.wait_until_running, self.config.load_timeout)

    def memory_size(self) -> tuple[int, int]:
        return self.memory.memory_size()

    def vram_by_gpu(self, device_id: DeviceID) -> int:
        return sum(gpu.size() for gpu in self.memory.gpus if gpu.device_id == device_id)

    def context_length(self) -> int:
        return self.options.num_ctx or 0

    # ------------------------------------------------------------ HTTP

    @property
    def _url(self) -> str:
        return f"http://127.0.0.1:{self.handle.port}"

    def _stopped(self) -> RunnerFailedError:
        return RunnerFailedError(f"llama runner process no longer running: {self.exit_reason()}")

    async def ping(self, fresh: float = 0.0) -> None:
        """Raise unless the runner answers /health with a healthy status. `fresh`: seconds within which a
        healthy answer or a completion line already proves it alive (no round trip: a runner streaming tokens
        is not asked again with every request that reuses it)."""
        if self.has_exited():
            raise self._stopped()
        if time.monotonic() - self._answered_at < fresh:
            return
        async with self._client() as session, session.get(
            self._url + "/health", timeout=aiohttp.ClientTimeout(total=10)
        ) as response:
            data = await response.json(content_type=None)
        if response.status != 200 or ServerStatus(data["status"]) in (ServerStatus.ERROR,):
            raise RunnerFailedError(f"runner status {data!r}")
        self._answered_at = time.monotonic()

    async def completion(
        self, prompt: str, options: Mapping[str, Any], extra: Mapping[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream /completion; a runner that dies mid-stream raises RunnerFailedError with its last words.
        `extra`: more llm.CompletionRequest fields (Logprobs, TopLogprobs, Shift, Truncate)."""
        options = {**options, "num_predict": capped_num_predict(options.get("num_predict", -1), self.options.num_ctx)}
        body = {"Prompt": prompt, "Options": options, "Shift": True, "Truncate": True, **(extra or {})}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        try:
            async with self._client() as session, session.post(
                self._url + "/completion", data=json.dumps(body), timeout=timeout
            ) as response:
                if response.status != 200:
                    raise StatusError(response.status, (await response.text()).strip())
                async for line in response.content:
                    if line.strip():
                        self._answered_at = time.monotonic()
                        yield json.loads(line)
        except aiohttp.ClientConnectorError as err:
            raise RunnerFailedError(RUNNER_STOPPED) from err
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as err:  # incl. "Connection closed"
            await asyncio.sleep(0.05)  # let the exit be noticed, so the message says why
            reason = self.exit_reason() if self.has_exited() else str(err)
            raise RunnerFailedError(f"an error was encountered while running the model: {reason}") from err

    async def embedding(self, content: str) -> dict[str, Any]:
        """POST /embedding: {"embedding": [...], "prompt_eval_count": n}; the runner's HTTP errors as StatusError."""
        return await self._pooled("/embedding", {"content": content})

    async def rerank(self, query: str, document: str) -> dict[str, Any]:
        """POST /rerank (ours): the pair's scores as {"embedding": [...], "prompt_eval_count": n}."""
        return await self._pooled("/rerank", {"query": query, "document": document})

    async def _pooled(self, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        try:
            async with self._client() as session, session.post(
                self._url + route, data=json.dumps(payload), timeout=timeout
            ) as response:
                if response.status != 200:
                    raise StatusError(response.status, (await response.text()).strip())
                result: dict[str, Any] = await response.json(content_type=None)
                return result
        except aiohttp.ClientConnectorError as err:
            raise RunnerFailedError(RUNNER_STOPPED) from err
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as err:  # incl. "Connection closed"
            await asyncio.sleep(0.05)
            reason = self.exit_reason() if self.has_exited() else str(err)
            raise RunnerFailedError(f"an error was encountered while running the model: {reason}") from err
