"""The scheduler, with a fake runner behind the same seams as Ollama's server/sched_test.go (f63eea3d).

The first 19 tests are ports of every sched_test.go case (reference §2.2), in order; the rest test what our
scheduler does beyond Ollama (reference §5). Go's channels are asyncio queues and futures here; fixed sleeps
of a few milliseconds become `eventually` polls, so that a loaded 2-core machine does not make them flaky.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from ollama_engine.envconfig import EnvConfig
from ollama_engine.llm.layout import LoadRequiredFullError
from ollama_engine.ml.memory import DeviceID, DeviceInfo, SystemInfo
from ollama_engine.sched import scheduler as scheduler_module
from ollama_engine.sched.scheduler import Scheduler
from ollama_engine.sched.types import Context, LlmRequest, Model, ModelInfo, Options, RunnerRef, ServerBusyError

GB = 1000 * 1000 * 1000  # format.GigaByte
MS = 1e-3
METAL = DeviceID(library="Metal")


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def result(req: LlmRequest, timeout: float = 5.0) -> RunnerRef:
    return await asyncio.wait_for(asyncio.shield(req.future), timeout)


async def error(req: LlmRequest, timeout: float = 5.0) -> BaseException:
    await asyncio.wait_for(asyncio.wait([req.future]), timeout)
    err = req.future.exception()
    assert err is not None, f"expected an error, got {req.future.result()}"
    return err


# ---------------------------------------------------------------- fixtures (§2.1)


_counter = iter(range(1_000_000))


def create_bin_file(directory: Path) -> str:
    """A real GGUF like Go's createBinFile: a distinct path every call, so every scenario has its own key."""
    path = directory / f"model-{next(_counter)}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(32)
    writer.add_embedding_length(4096)
    writer.add_block_count(1)
    writer.add_head_count(32)
    writer.add_head_count_kv(32)
    writer.add_token_list([" "])
    writer.add_token_scores([0.0])
    writer.add_token_types([0])
    for name in ("blk.0.attn.weight", "output.weight"):
        writer.add_tensor(name, np.zeros((1, 1, 1, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


class MockLlm:
    """Go's mockLlm."""

    def __init__(self, vram_size: int = 0, vram_by_gpu: dict[DeviceID, int] | None = None) -> None:
        self.model_path = ""
        self.ping_resp: Exception | None = None
        self.wait_resp: Exception | None = None
        self.wait_delay = 0.0
        self.close_called = False
        self.vram_size = vram_size
        self.total_size = 0
        self.vram_by_gpu_map = vram_by_gpu or {}
        self.exit_callbacks: list[Callable[[], None]] = []
        self.ping_hangs = False

    async def load(self, system_info, gpus, require_full):
        if require_full:
            if not gpus:
                return []
            for gpu in gpus:
                if gpu.free_memory >= self.vram_size:
                    return [gpu.device_id]
            raise LoadRequiredFullError()
        return [gpu.device_id for gpu in gpus]

    async def ping(self, fresh: float = 0.0) -> None:
        if self.ping_hangs:
            await asyncio.sleep(3600)
        if self.ping_resp is not None:
            raise self.ping_resp

    async def wait_until_running(self) -> None:
        await asyncio.sleep(self.wait_delay)
        if self.wait_resp is not None:
            raise self.wait_resp

    async def completion(self, prompt, options):
        yield {"content": "", "done": True}

    def close(self) -> None:
        self.close_called = True

    def memory_size(self) -> tuple[int, int]:
        return self.total_size, self.vram_size

    def vram_by_gpu(self, device_id: DeviceID) -> int:
        return self.vram_by_gpu_map.get(device_id, 0)

    def pid(self) -> int:
        return -1

    def has_exited(self) -> bool:
        return False

    def exit_reason(self) -> str:
        return "signal: killed"

    def context_length(self) -> int:
        return 0

    def add_exit_callback(self, callback: Callable[[], None]) -> None:
        self.exit_callbacks.append(callback)

    def crash(self) -> None:
        for callback in self.exit_callbacks:
            callback()


async def get_gpu_fn(runners) -> list[DeviceInfo]:
    return [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=12 * GB)]


def get_system_info_fn() -> SystemInfo:
    return SystemInfo(total_memory=32 * GB, free_memory=26 * GB)


@dataclasses.dataclass
class Scenario:
    ctx_done: Callable[[], None]
    req: LlmRequest
    srv: MockLlm

    def new_server(self, system_info, gpus, model_path, info, adapters, projectors, opts, num_parallel) -> MockLlm:
        self.srv.model_path = model_path
        return self.srv


def new_scenario_request(
    directory: Path, ctx: Context, name: str, vram_size: int, duration: float | None = None,
    vram_by_gpu: dict[DeviceID, int] | None = None,
) -> Scenario:
    path = create_bin_file(directory)
    req_ctx = Context(ctx)
    req = LlmRequest(ctx=req_ctx, model=Model(name=name, model_path=path), opts=Options(),
                     session_duration=5 * MS if duration is None else duration)
    return Scenario(req_ctx.cancel, req, MockLlm(vram_size, vram_by_gpu))


@contextlib.asynccontextmanager
async def running(**config) -> AsyncIterator[Scheduler]:
    """A scheduler with its loops running (init_scheduler's), stopped at the end."""
    s = init_scheduler(**config)
    s.run()
    try:
        yield s
    finally:
        await s.stop()


def init_scheduler(**config) -> Scheduler:
    s = Scheduler(EnvConfig(**config))
    s.wait_for_recovery = 10 * MS
    s.get_gpu_fn = get_gpu_fn
    s.get_system_info_fn = get_system_info_fn
    return s


# ---------------------------------------------------------------- the 19 ports (§2.2)


def test_sched_init():
    async def body():
        s = Scheduler(EnvConfig())
        assert s.loaded == {}

    run(body())


def test_sched_load(tmp_path):
    async def body():
        s = init_scheduler()
        path = create_bin_file(tmp_path)
        req = LlmRequest(ctx=Context(), model=Model(model_path=path), opts=Options(), session_duration=2.0)

        def failing(*args):
            raise RuntimeError("something failed to load model blah")

        s.new_server_fn = failing
        await s.load(req, SystemInfo(), [], False)
        err = await error(req)
        assert s.loaded == {}
        assert "this model may be incompatible" in str(err)

        server = MockLlm(vram_size=10)
        s.new_server_fn = lambda *args: server
        req = LlmRequest(ctx=Context(), model=Model(model_path=path), opts=Options(), session_duration=2.0)
        await s.load(req, SystemInfo(), [], False)
        resp = await result(req)
        assert resp.vram_size == 10 and resp.ref_count == 1 and len(s.loaded) == 1

        req = LlmRequest(ctx=Context(), model=Model(model_path=create_bin_file(tmp_path)), opts=Options(),
                         session_duration=2.0)
        server.wait_resp = RuntimeError("wait failure")
        await s.load(req, SystemInfo(), [], False)
        assert "wait failure" in str(await error(req))
        runner = s.loaded[req.model.model_path]
        assert runner is not None and runner.ref_count == 0
        await asyncio.sleep(MS)
        assert s.expired.qsize() == 1

    run(body())


def test_sched_requests_same_model_same_request(tmp_path):
    async def body():
        ctx = Context()
        s = init_scheduler()
        a = new_scenario_request(tmp_path, ctx, "ollama-model-1", 10, duration=5 * MS)
        b = new_scenario_request(tmp_path, ctx, "ollama-model-1", 11, duration=0)
        b.req.model = a.req.model
        s.new_server_fn = a.new_server
        s.pending_reqs.put_nowait(a.req)
        s.run()
        try:
            assert (await result(a.req)).llama is a.srv
            assert s.pending_reqs.empty()
            s.new_server_fn = b.new_server
            s.pending_reqs.put_nowait(b.req)
            assert (await result(b.req)).llama is a.srv  # the same options: no reload
            assert s.pending_reqs.empty()
        finally:
            await s.stop()

    run(body())


def test_sched_requests_simple_reload_same_model(tmp_path):
    async def body():
        ctx = Context()
        s = init_scheduler()
        a = new_scenario_request(tmp_path, ctx, "ollama-model-1", 10, duration=5 * MS)
        b = new_scenario_request(tmp_path, ctx, "ollama-model-1", 20, duration=5 * MS)
        b.req.model = dataclasses.replace(a.req.model)
        s.new_server_fn = a.new_server
        s.pending_reqs.put_nowait(a.req)
        s.run()
        try:
            assert (await result(a.req)).llama is a.srv
            s.new_server_fn = b.new_server
            b.req.model.adapter_paths = ["new"]
            s.pending_reqs.put_nowait(b.req)
            await asyncio.sleep(MS)
            a.ctx_done()
            await asyncio.sleep(MS)

            async def roomy(runners):
                return [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=24 * GB)]

            s.get_gpu_fn = roomy
            assert (await result(b.req)).llama is b.srv  # a new server after the reload
            assert s.pending_reqs.empty()
        finally:
            await s.stop()

    run(body())


def test_sched_requests_multiple_loaded_models(tmp_path):
    async def body():
        ctx = Context()
        s = init_scheduler()
        a = new_scenario_request(tmp_path, ctx, "model-a-1g-gpu", 1 * GB, 5 * MS, {METAL: 1 * GB})
        b = new_scenario_request(tmp_path, ctx, "model-b-10g-gpu", 10 * GB, 10 * MS, {METAL: 10 * GB})
        c = new_scenario_request(tmp_path, ctx, "model-c-10g-cpu", 10 * GB, 5 * MS)
        c.req.opts.num_gpu = 0
        d = new_scenario_request(tmp_path, ctx, "model-d-10g-gpu", 13 * GB, 5 * MS, {METAL: 13 * GB})
        s.new_server_fn = a.new_server
        s.pending_reqs.put_nowait(a.req)
        s.run()
        try:
            assert (await result(a.req)).llama is a.srv
            assert len(s.loaded) == 1
            s.new_server_fn = b.new_server
            s.pending_reqs.put_nowait(b.req)
            assert (await result(b.req)).llama is b.srv
            assert len(s.loaded) == 2
            s.new_server_fn = c.new_server
            s.pending_reqs.put_nowait(c.req)
            assert (await result(c.req)).llama is c.srv
            assert len(s.loaded) == 3

            a.ctx_done()
            await asyncio.sleep(2 * MS)
            s.new_server_fn = d.new_server
            s.pending_reqs.put_nowait(d.req)
            # a (idle) goes first because 3 reaches the automatic cap; d still lacks memory: c is drained
            await eventually(lambda: len(s.loaded) == 2 and s.loaded[c.req.model.model_path].draining,
                             what="a unloaded and c draining")
            assert not d.req.future.done()
            b.ctx_done()
            await asyncio.sleep(MS)

            async def roomy(runners):
                return [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=24 * GB)]

            s.get_gpu_fn = roomy
            assert (await result(d.req)).llama is d.srv
            assert s.pending_reqs.empty()
            await eventually(lambda: b.srv.close_called, what="b closed")
            assert len(s.loaded) == 2  # c and d
        finally:
            await s.stop()

    run(body())


def test_sched_get_runner(tmp_path):
    async def body():
        ctx = Context()
        s = init_scheduler(max_queue=1)
        a = new_scenario_request(tmp_path, ctx, "ollama-model-1a", 10, 2 * MS)
        b = new_scenario_request(tmp_path, ctx, "ollama-model-1b", 10, 2 * MS)
        c = new_scenario_request(tmp_path, ctx, "ollama-model-1c", 10, 2 * MS)
        s.new_server_fn = a.new_server
        a_req = await s.get_runner(a.req.ctx, a.req.model, a.req.opts, a.req.session_duration)
        assert s.pending_reqs.qsize() == 1
        b_req = await s.get_runner(b.req.ctx, b.req.model, b.req.opts, b.req.session_duration)
        assert s.pending_reqs.qsize() == 1
        assert "server busy" in str(await error(b_req))
        s.run()
        try:
            assert (await result(a_req)).llama is a.srv
            assert s.pending_reqs.empty()
            a.ctx_done()
            assert len(s.loaded) == 1
            s.new_server_fn = c.new_server
            c.req.model.model_path = "bad path"
            c_req = await s.get_runner(c.req.ctx, c.req.model, c.req.opts, c.req.session_duration)
            assert "bad path" in str(await error(c_req))
            await eventually(lambda: not s.loaded, what="a's 2 ms keep-alive to unload it")
        finally:
            await s.stop()

    run(body())


def _preloaded_digest_runner(s: Scheduler) -> RunnerRef:
    model = Model(name="safetensors-a", digest="sha-a")
    runner = RunnerRef(model=model, model_key="digest:sha-a", options=Options(num_ctx=4).resolved(4096),
                       llama=MockLlm(), num_parallel=1)
    s.loaded["digest:sha-a"] = runner
    return runner


@pytest.mark.parametrize(("model", "reused"), [
    (Model(name="safetensors-b", digest="sha-b"), False),  # a different key: no fast path, queued
    (Model(name="safetensors-a-copy", digest="sha-a"), True),  # another name for the same digest: shared
])
def test_sched_get_runner_keys_by_digest_when_model_path_empty(model: Model, reused: bool):
    async def body():
        s = init_scheduler()
        runner = _preloaded_digest_runner(s)
        ctx = Context()
        req = await s.get_runner(ctx, model, Options(num_ctx=4), None)
        ctx.cancel()
        if reused:
            assert req.future.done() and req.future.result() is runner and s.pending_reqs.empty()
        else:
            assert not req.future.done() and s.pending_reqs.qsize() == 1

    run(body())


def test_sched_expire_runner(tmp_path):
    async def body():
        s = init_scheduler()
        path = create_bin_file(tmp_path)
        ctx = Context()
        req = LlmRequest(ctx=ctx, model=Model(model_path=path), opts=Options(), session_duration=120.0)
        s.new_server_fn = lambda *args: MockLlm(vram_size=10)
        await s.load(req, SystemInfo(), [], False)
        resp = await result(req)
        assert resp.ref_count == 1 and len(s.loaded) == 1
        completed = asyncio.create_task(s.process_completed())
        s.expire_runner(Model(model_path=path))
        ctx.cancel()
        await asyncio.wait_for(s.unloaded.get(), 5)
        assert len(s.loaded) == 0
        completed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(completed, 5)

    run(body())


def test_sched_premature_expired(tmp_path):
    async def body():
        ctx = Context()
        s = init_scheduler()
        scenario = new_scenario_request(tmp_path, ctx, "ollama-model-1a", 10, 100 * MS)
        s.new_server_fn = scenario.new_server
        req = await s.get_runner(scenario.req.ctx, scenario.req.model, scenario.req.opts, 100 * MS)
        s.run()
        try:
            resp = await result(req)
            assert resp.llama is scenario.srv and s.pending_reqs.empty() and len(s.loaded) == 1
            s.expired.put_nowait(resp)  # premature: the runner is busy
            await asyncio.sleep(100 * MS)
            assert len(s.loaded) == 1, "a busy runner is never unloaded"
            scenario.ctx_done()
            await eventually(lambda: s.finished_reqs.empty() and not s.loaded, what="the unload")
            s.finished_reqs.put_nowait(req)  # after the unload: ignored, no crash
            await asyncio.sleep(5 * MS)
            assert all(not task.done() for task in s._tasks)
        finally:
            await s.stop()

    run(body())


def test_sched_use_loaded_runner():
    async def body():
        s = init_scheduler()
        ctx = Context()
        req = LlmRequest(ctx=ctx, model=Model(), opts=Options(), session_duration=2e-9)
        r1 = RunnerRef(llama=MockLlm(), session_duration=1e-9, num_parallel=1)
        s.use_loaded_runner(req, r1)
        ctx.cancel()
        assert r1.ref_count == 1
        assert r1.session_duration == 2e-9
        assert req.future.result() is r1
        assert s.finished_reqs.get_nowait() is req

    run(body())


def test_sched_update_free_space():
    async def body():
        s = init_scheduler()
        gpus = [DeviceInfo(device_id=DeviceID(id="1"), total_memory=1000, free_memory=900),
                DeviceInfo(device_id=DeviceID(id="2"), total_memory=2000, free_memory=1900)]
        llm1 = MockLlm(vram_by_gpu={DeviceID(id="1"): 50, DeviceID(id="2"): 50})
        llm2 = MockLlm(vram_by_gpu={DeviceID(id="1"): 125, DeviceID(id="2"): 75})
        ids = [gpu.device_id for gpu in gpus]
        s.loaded["a"] = RunnerRef(llama=llm1, gpus=ids, num_parallel=1)
        s.loaded["b"] = RunnerRef(llama=llm2, gpus=ids, num_parallel=1)
        s.update_free_space(gpus)
        assert gpus[0].free_memory == 1000 - 50 - 125
        assert gpus[1].free_memory == 2000 - 50 - 75

    run(body())


def test_sched_find_runner_to_unload():
    async def body():
        s = init_scheduler()
        r1 = RunnerRef(ref_count=1, session_duration=1, num_parallel=1)
        r2 = RunnerRef(session_duration=2, num_parallel=1)
        s.loaded["a"], s.loaded["b"] = r1, r2
        assert s.find_runner_to_unload() is r2  # idle beats a shorter keep-alive
        r2.ref_count = 1
        assert s.find_runner_to_unload() is r1  # all busy: the shortest keep-alive

    run(body())


# A runner loaded with adapter1, projector1 and Options(num_ctx=1024).resolved(4096), from a file trained on
# 8192 tokens; each case is a request that differs from it in one way: (the difference, reload?).
RELOAD_CASES = [
    ({}, False),
    ({"adapter_paths": ["adapter2"]}, True),
    ({"projector_paths": ["projector2"]}, True),
    ({"num_batch": 1234}, True),
    ({"num_batch": 512}, False),  # the loaded value, said again
    ({"ping": RuntimeError("foo")}, True),
    ({"loading": True, "ping": RuntimeError("foo")}, True),
    ({"num_gpu": 99}, True),
    ({"num_gpu": -1}, False),  # automatic accepts whatever is loaded
    ({"num_ctx": 512}, False),  # a smaller context is served by the larger one
    ({"num_ctx": 2048}, True),
    ({"num_ctx": 1, "capabilities": ["vision"]}, True),  # a vision model's context is at least 2048
    ({"num_ctx": 1}, False),
]


@pytest.mark.parametrize(("change", "reload"), RELOAD_CASES)
def test_sched_needs_reload(change: dict, reload: bool):
    async def body():
        s = init_scheduler()
        llm = MockLlm()
        runner = RunnerRef(model=Model(adapter_paths=["adapter1"], projector_paths=["projector1"]),
                           options=Options(num_ctx=1024).resolved(4096), info=ModelInfo(context_length=8192),
                           llama=llm, num_parallel=1, loading=change.get("loading", False))
        model = Model(adapter_paths=change.get("adapter_paths", ["adapter1"]),
                      projector_paths=change.get("projector_paths", ["projector1"]),
                      capabilities=change.get("capabilities", []))
        opts = Options(**{k: v for k, v in change.items() if k in ("num_ctx", "num_batch", "num_gpu")})
        llm.ping_resp = change.get("ping")
        assert await s.needs_reload(runner, LlmRequest(ctx=Context(), model=model, opts=opts)) is reload

    run(body())


@pytest.mark.parametrize(("num_ctx", "train", "loaded"), [(4096, 32, 32), (4096, 0, 4096), (2, 0, 4)])
def test_a_load_fits_the_requested_context(tmp_path, num_ctx: int, train: int, loaded: int):
    """The runner gets num_ctx fitted once (types.fit_num_ctx): at most the training context, at least 4."""
    async def body():
        s = init_scheduler()
        s.read_model_info = lambda path: ModelInfo(block_count=1, context_length=train)
        scenario = new_scenario_request(tmp_path, Context(), "m", 10, 60.0)
        s.new_server_fn = scenario.new_server
        req = LlmRequest(ctx=Context(), model=scenario.req.model, opts=Options(num_ctx=num_ctx))
        await s.load(req, SystemInfo(), [], False)
        assert (await result(req)).options.num_ctx == loaded

    run(body())


def test_sched_unload_all_runners():
    async def body():
        s = init_scheduler()
        s.unload_all_runners()  # nothing loaded: no error
        llm1, llm2 = MockLlm(), MockLlm()
        s.loaded["a"] = RunnerRef(llama=llm1, num_parallel=1)
        s.loaded["b"] = RunnerRef(llama=llm2, num_parallel=1)
        s.unload_all_runners()
        assert llm1.close_called and llm2.close_called

    run(body())


def test_sched_unload():
    llm1 = MockLlm()
    r1 = RunnerRef(llama=llm1, num_parallel=1)
    r2 = RunnerRef(model=Model(adapter_paths=["A"]), num_parallel=1)
    r1.unload()
    assert llm1.close_called
    r2.unload()  # no runner: no crash
    assert r2.model is None


def test_sched_already_canceled(tmp_path):
    async def body():
        ctx = Context()
        dctx = Context(ctx)
        dctx.cancel()
        s = init_scheduler()
        scenario = new_scenario_request(tmp_path, dctx, "ollama-model-1", 10, 0)
        s.new_server_fn = scenario.new_server
        s.pending_reqs.put_nowait(scenario.req)
        assert s.pending_reqs.qsize() == 1
        s.run()
        try:
            await asyncio.sleep(5 * MS)
            await eventually(s.pending_reqs.empty)
            await asyncio.sleep(5 * MS)
            assert not scenario.req.future.done()  # dropped silently: neither success nor error
        finally:
            await s.stop()

    run(body())


def test_image_gen_runner_can_be_evicted():
    async def body():
        s = init_scheduler()
        runner = RunnerRef(model=Model(name="z-image"), model_path="/fake/image/model",
                           model_key="/fake/image/model", llama=MockLlm(vram_size=21 * GB),
                           session_duration=5 * MS, num_parallel=1)
        s.loaded["/fake/image/model"] = runner
        assert len(s.loaded) == 1
        victim = s.find_runner_to_unload()
        assert victim is not None and victim.model_path == "/fake/image/model"

    run(body())


def test_image_gen_scheduler_coexistence():
    async def body():
        s = init_scheduler()
        for path, size in (("/fake/flux/model", 8 * GB), ("/fake/llama3/model", 4 * GB)):
            s.loaded[path] = RunnerRef(model=Model(name=path), model_path=path, model_key=path,
                                       llama=MockLlm(vram_by_gpu={METAL: size}), session_duration=10 * MS,
                                       num_parallel=1)
        gpus = [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=24 * GB)]
        s.update_free_space(gpus)
        assert len(s.loaded) == 2 and {"/fake/flux/model", "/fake/llama3/model"} <= s.loaded.keys()
        assert gpus[0].free_memory == 24 * GB - 8 * GB - 4 * GB

    run(body())


# ---------------------------------------------------------------- beyond Ollama (§5)


async def _loaded(s: Scheduler, tmp_path: Path, name: str, opts: Options | None = None, **mock) -> Scenario:
    scenario = new_scenario_request(tmp_path, Context(), name, **({"vram_size": 10} | mock))
    s.new_server_fn = scenario.new_server
    req = await s.get_runner(scenario.req.ctx, scenario.req.model, opts or Options(), 60.0)
    await result(req)
    return scenario


def test_omitted_or_smaller_runner_options_never_reload(tmp_path, caplog):
    async def body():
        async with running() as s:
            a = await _loaded(s, tmp_path, "m", Options(num_ctx=16, num_batch=8))
            runner = s.loaded[a.req.model.model_path]
            assert runner.options.num_ctx == 16
            for opts in (Options(), Options(num_ctx=8), Options(num_ctx=16, num_batch=8), Options(num_gpu=-1)):
                ctx = Context()
                req = await s.get_runner(ctx, a.req.model, opts, None)
                assert (await result(req)) is runner, opts
                ctx.cancel()
            assert s.loaded[a.req.model.model_path] is runner
            # num_ctx 32 is more than the loaded 16: a reload, logged with its reason
            b_srv = MockLlm(vram_size=10)
            s.new_server_fn = lambda *args: b_srv
            with caplog.at_level(logging.INFO, logger="ollama_engine.sched"):
                ctx = Context()
                req = await s.get_runner(ctx, a.req.model, Options(num_ctx=32), None)
                await asyncio.sleep(10 * MS)
                a.ctx_done()
                assert (await result(req)).llama is b_srv
            assert "num_ctx 32 is larger than the loaded 16" in caplog.text
            # more than the model's training context (32) is clamped to it: the loaded 32 serves it
            reloaded = s.loaded[a.req.model.model_path]
            req = await s.get_runner(Context(), a.req.model, Options(num_ctx=4096), None)
            assert (await result(req)) is reloaded

    run(body())


def test_bounded_queue_for_a_loaded_model(tmp_path):
    async def body():
        async with running(max_queue=2) as s:
            a = await _loaded(s, tmp_path, "m")
            runner = s.loaded[a.req.model.model_path]
            await runner.acquire_slot()  # the one slot is taken
            waiters = []
            for _ in range(2):
                req = await s.get_runner(Context(), a.req.model, Options(), None)
                waiters.append(asyncio.create_task((await result(req)).acquire_slot()))
            await eventually(lambda: runner.waiting == 2)
            assert s.queue_depth(runner) == 2
            over = await s.get_runner(Context(), a.req.model, Options(), None)
            err = await error(over)
            assert isinstance(err, ServerBusyError) and "maximum pending requests exceeded" in str(err)
            runner.release_slot()
            await waiters[0]
            assert runner.waiting == 1
            for task in waiters:
                task.cancel()

    run(body())


def test_no_head_of_line_blocking_and_draining(tmp_path):
    async def body():
        async with running() as s:
            big = await _loaded(s, tmp_path, "big", vram_size=10 * GB, vram_by_gpu={METAL: 10 * GB})
            big_runner = s.loaded[big.req.model.model_path]
            # huge needs 13 GB of the 12 free: big (busy) must drain first, so huge waits ...
            huge = new_scenario_request(tmp_path, Context(), "huge", 13 * GB, 60.0, {METAL: 13 * GB})
            s.new_server_fn = huge.new_server
            huge_req = await s.get_runner(huge.req.ctx, huge.req.model, Options(), None)
            await eventually(lambda: big_runner.draining, what="big to drain")
            assert big_runner.state == "draining"
            # ... while a small model behind it in the queue loads at once (no head-of-line blocking)
            small = new_scenario_request(tmp_path, Context(), "small", 1 * GB, 60.0, {METAL: 1 * GB})
            s.new_server_fn = small.new_server
            small_req = await s.get_runner(small.req.ctx, small.req.model, Options(), None)
            assert (await result(small_req)).llama is small.srv
            assert not huge_req.future.done()
            # a new request for the draining model does not join it (no resurrection) but waits for the reload
            again_ctx = Context()
            again = await s.get_runner(again_ctx, big.req.model, Options(), None)
            await asyncio.sleep(10 * MS)
            assert big_runner.ref_count == 1 and not again.future.done()
            assert s.queue_depth(big_runner) == 1

            async def roomy(runners):
                return [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=24 * GB)]

            s.get_gpu_fn = roomy
            # once big has drained, huge loads and big reloads, in whichever order the scheduler takes them
            reloaded_srv = MockLlm(vram_size=1 * GB)
            servers = {huge.req.model.model_path: huge.new_server, big.req.model.model_path: lambda *a: reloaded_srv}
            s.new_server_fn = lambda *args: servers[args[2]](*args)
            big.ctx_done()
            assert (await result(huge_req)).llama is huge.srv
            assert big.srv.close_called
            assert (await result(again)).llama is reloaded_srv

    run(body())


def test_load_survives_its_first_client_leaving(tmp_path):
    async def body():
        async with running() as s:
            scenario = new_scenario_request(tmp_path, Context(), "slow", 10, 60.0)
            scenario.srv.wait_delay = 0.2
            s.new_server_fn = scenario.new_server
            first_ctx, second_ctx = Context(), Context()
            first = await s.get_runner(first_ctx, scenario.req.model, Options(), None)
            await eventually(lambda: s.loaded, what="the load to start")
            first_ctx.cancel()  # the client that started the load goes away
            second = await s.get_runner(second_ctx, scenario.req.model, Options(), None)
            runner = await result(second)  # attached to the load in progress
            assert runner.llama is scenario.srv and runner.state == "busy"
            assert not first.future.done() or first.future.result() is runner
            second_ctx.cancel()
            await eventually(lambda: runner.ref_count == 0 and runner.expire_timer is not None, what="idle")
            assert runner.state == "idle" and not scenario.srv.close_called

    run(body())


def test_crashed_runner_fails_and_reloads(tmp_path):
    async def body():
        async with running() as s:
            a = await _loaded(s, tmp_path, "m")
            runner = s.loaded[a.req.model.model_path]
            a.srv.crash()
            assert runner.failure.startswith("model runner has unexpectedly stopped") and runner.draining
            assert "signal: killed" in runner.failure
            a.ctx_done()  # the in-flight request ends (with that error, in the API)
            await eventually(lambda: not s.loaded, what="the dead runner to unload")
            fresh = MockLlm(vram_size=10)
            s.new_server_fn = lambda *args: fresh
            req = await s.get_runner(Context(), a.req.model, Options(), None)
            assert (await result(req)).llama is fresh

    run(body())


def test_hung_runner_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_module, "PING_TIMEOUT", 0.02)

    async def body():
        s = init_scheduler()
        s.health_interval = 0.01
        s.run()
        try:
            a = await _loaded(s, tmp_path, "m")
            runner = s.loaded[a.req.model.model_path]
            a.srv.ping_hangs = True
            await eventually(lambda: a.srv.close_called, what="the hung runner to be stopped")
            assert "stopped responding" in runner.failure and runner.draining
        finally:
            await s.stop()

    run(body())


def test_force_stop_and_stop(tmp_path):
    async def body():
        async with running() as s:
            a = await _loaded(s, tmp_path, "m")
            runner = s.loaded[a.req.model.model_path]
            assert s.expire_runner(a.req.model)  # busy: drains, unloads after the request
            assert runner.state == "draining" and not a.srv.close_called
            assert s.expire_runner(a.req.model, force=True)
            assert a.srv.close_called and "was stopped" in runner.failure
            a.ctx_done()
            await eventually(lambda: not s.loaded)
            assert not s.expire_runner(a.req.model)

    run(body())


def test_eviction_is_idle_first_lru_and_size_aware():
    async def body():
        s = init_scheduler()
        gpus = [DeviceInfo(device_id=METAL, total_memory=24 * GB, free_memory=24 * GB)]
        runners = {}
        for i, size in enumerate((2, 6, 10)):
            runners[size] = RunnerRef(model_key=f"m{size}", llama=MockLlm(vram_by_gpu={METAL: size * GB}),
                                      session_duration=60, last_used=100 - i, num_parallel=1)
            s.loaded[f"m{size}"] = runners[size]
        assert s.find_runner_to_unload() is runners[10]  # least recently used
        assert s.find_runner_to_unload(5 * GB, gpus) is runners[6]  # the smallest that frees enough
        assert s.find_runner_to_unload(20 * GB, gpus) is runners[10]  # none does: the one freeing most
        runners[6].ref_count = 1
        assert s.find_runner_to_unload(5 * GB, gpus) is runners[10]  # idle first
        runners[2].ref_count = runners[10].ref_count = 1
        runners[10].draining = True
        assert s.find_runner_to_unload(5 * GB, gpus) is None  # all busy and one already draining: wait for it

    run(body())


def test_shutdown_fails_waiting_requests_and_closes_runners(tmp_path):
    async def body():
        s = init_scheduler()
        s.run()
        a = await _loaded(s, tmp_path, "m")
        await s.stop()  # the loops stop: a queued request stays queued
        queued = await s.get_runner(Context(), Model(name="other", model_path=create_bin_file(tmp_path)),
                                    Options(), None)
        await s.shutdown()
        assert a.srv.close_called
        assert "shutting down" in str(await error(queued))
        late = await s.get_runner(Context(), a.req.model, Options(), None)
        assert "shutting down" in str(await error(late))

    run(body())


def test_keep_alive_forever_and_zero(tmp_path):
    async def body():
        async with running() as s:
            a = await _loaded(s, tmp_path, "m")
            runner = s.loaded[a.req.model.model_path]
            ctx = Context()
            await result(await s.get_runner(ctx, a.req.model, Options(), math.inf))
            a.ctx_done()
            ctx.cancel()
            await eventually(lambda: runner.ref_count == 0)
            assert runner.expires_at == math.inf and runner.expire_timer is None
            ctx = Context()
            await result(await s.get_runner(ctx, a.req.model, Options(), 0.0))
            ctx.cancel()
            await eventually(lambda: not s.loaded, what="keep_alive 0 to unload")

    run(body())


def test_a_parked_client_leaving_stops_the_runner_started_for_it(tmp_path):
    async def body():
        async with running() as s:
            await _loaded(s, tmp_path, "big", vram_size=10 * GB, vram_by_gpu={METAL: 10 * GB})
            huge = new_scenario_request(tmp_path, Context(), "huge", 13 * GB, 60.0, {METAL: 13 * GB})
            s.new_server_fn = huge.new_server
            ctx = Context()
            await s.get_runner(ctx, huge.req.model, Options(), None)
            await eventually(lambda: s.parked and s.parked[0].prepared is not None, what="huge to park")
            ctx.cancel()
            assert not s.parked and huge.srv.close_called

    run(body())
