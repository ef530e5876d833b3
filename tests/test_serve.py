"""`ollama-engine serve` end to end: the API on the scheduler, with real runner subprocesses on synthetic models."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from serve_process import eventually, free_port, generate, pid_alive, serving
from synthetic.models import write_synthetic

from ollama_engine.envconfig import EnvConfig

OPTIONS = {"num_predict": 4, "temperature": 0}


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two small synthetic llamas, and a store (OLLAMA_MODELS) that names the first `tiny:latest`."""
    root = tmp_path_factory.mktemp("serve")
    a = write_synthetic(root / "a.gguf", "tiny-llama", seed=1)
    b = write_synthetic(root / "b.gguf", "tiny-llama", seed=2)
    store = root / "store"
    digest = hashlib.sha256(a.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    (store / "blobs" / f"sha256-{digest}").symlink_to(a)
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": a.stat().st_size},
    ]}) + "\n")
    return {"a": a, "b": b, "store": store}


def test_generate_ps_load_unload_and_errors(models):
    async def body():
        config = EnvConfig(models=models["store"], model_paths=True)
        async with serving(config) as (session, url, scheduler):
            status, lines = await generate(session, url, model="tiny", prompt="Once upon a time", options=OPTIONS)
            assert status == 200 and all(not line["done"] for line in lines[:-1])
            final = lines[-1]
            assert final["done"] and final["done_reason"] == "length" and final["eval_count"] == 4
            assert final["model"] == "tiny" and final["load_duration"] > 0 and final["created_at"].endswith("Z")
            streamed = "".join(line["response"] for line in lines)

            status, [single] = await generate(session, url, model="tiny:latest", prompt="Once upon a time",
                                              stream=False, options=OPTIONS)
            assert status == 200 and single["response"] == streamed and single["done"]

            async with session.get(url + "/api/ps") as response:
                [row] = (await response.json())["models"]
            assert row["name"] == "tiny:latest" and row["state"] == "idle" and row["queue_depth"] == 0
            assert row["context_length"] == 512 and row["size"] > 0 and len(row["digest"]) == 64

            # an empty prompt loads (another model), keep_alive 0 with it unloads
            status, [loaded] = await generate(session, url, model=str(models["b"]))
            assert (status, loaded["done_reason"]) == (200, "load")
            assert len(scheduler.loaded) == 2
            status, [unloaded] = await generate(session, url, model=str(models["b"]), keep_alive=0)
            assert (status, unloaded["done_reason"]) == (200, "unload")
            await eventually(lambda: len(scheduler.loaded) == 1)

            async with session.get(url + "/api/version") as response:
                assert "version" in await response.json()
            async with session.get(url + "/") as response:
                assert await response.text() == "Ollama is running"

            assert await generate(session, url, model="missing", prompt="x") == (
                404, [{"error": "model 'missing' not found"}])
            async with session.post(url + "/api/generate", data=b"") as response:
                assert response.status == 400 and await response.json() == {"error": "missing request body"}
            status, [err] = await generate(session, url, model="tiny", prompt="x", keep_alive="5")
            assert status == 400 and "missing unit in duration" in err["error"]
            status, [err] = await generate(session, url, model="tiny", prompt="x", raw=True, system="s")
            assert (status, err["error"]) == (400, "raw mode does not support template, system, or context")
            status, [err] = await generate(session, url, model="tiny", prompt="x", options={"num_ctx": "big"})
            assert (status, err["error"]) == (400, 'option "num_ctx" must be of type integer')

    run(body())


def test_sigkill_mid_stream_gives_an_error_then_recovers(models):
    async def body():
        async with serving(EnvConfig(models=models["store"])) as (session, url, scheduler):
            request = {"model": "tiny", "prompt": "Once upon a time", "options": {"num_predict": 100_000}}
            async with session.post(url + "/api/generate", json=request) as response:
                assert response.status == 200
                first = json.loads(await response.content.readline())
                assert not first["done"]
                [runner] = scheduler.loaded.values()
                pid = runner.pid
                os.kill(pid, signal.SIGKILL)
                lines = [json.loads(line) async for line in response.content if line.strip()]
            assert "error" in lines[-1], lines[-1]
            assert lines[-1]["error"].startswith("model runner has unexpectedly stopped"), lines[-1]
            assert response.status == 200  # bytes were already sent: the error is the stream's last line
            await eventually(lambda: not scheduler.loaded)  # the dead runner is unloaded ...
            status, lines = await generate(session, url, model="tiny", prompt="Once upon a time", options=OPTIONS)
            assert status == 200 and lines[-1]["done"]  # ... and the next request loads a fresh one
            [runner] = scheduler.loaded.values()
            assert runner.pid != pid and runner.ref_count == 0

    run(body())


def test_queue_bound_for_a_loaded_model_is_503_with_retry_after(models):
    async def body():
        config = EnvConfig(models=models["store"], max_queue=1)
        async with serving(config) as (session, url, scheduler):
            long = {"model": "tiny", "prompt": "Once", "options": {"num_predict": 100_000}}
            async with session.post(url + "/api/generate", json=long) as holder:
                await holder.content.readline()  # holds the only slot
                waiter = asyncio.create_task(generate(session, url, model="tiny", prompt="x", options=OPTIONS))
                [runner] = scheduler.loaded.values()
                await eventually(lambda: runner.waiting == 1)
                async with session.get(url + "/api/ps") as response:
                    [row] = (await response.json())["models"]
                assert row["state"] == "busy" and row["queue_depth"] == 1 and row["in_flight"] == 1
                async with session.post(url + "/api/generate", json={"model": "tiny", "prompt": "y"}) as response:
                    assert response.status == 503 and response.headers["Retry-After"] == "1"
                    assert (await response.json())["error"] == (
                        "server busy, please try again.  maximum pending requests exceeded")
            status, lines = await waiter  # the holder went away: its slot went to the waiter
            assert status == 200 and lines[-1]["done"]
            await eventually(lambda: runner.ref_count == 0 and runner.waiting == 0)

    run(body())


def test_a_load_finishes_when_its_client_leaves(models):
    async def body():
        async with serving(EnvConfig(models=models["store"])) as (session, url, scheduler):
            task = asyncio.create_task(generate(session, url, model="tiny", prompt="x", options=OPTIONS))
            await eventually(lambda: scheduler.loaded or scheduler.active_loading is not None)
            task.cancel()  # the client that started the load goes away
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await eventually(lambda: scheduler.loaded and next(iter(scheduler.loaded.values())).state == "idle")
            [runner] = scheduler.loaded.values()
            assert runner.ref_count == 0 and runner.expire_timer is not None  # loaded and kept warm

    run(body())


def test_200_requests_with_disconnects_over_two_models_and_one_slot_for_models(models):
    """OLLAMA_MAX_LOADED_MODELS=1: every switch drains, unloads and loads; clients leave at random moments."""

    async def body():
        config = EnvConfig(models=models["store"], max_loaded_models=1, model_paths=True)
        rng = random.Random(13)
        pids: set[int] = set()
        outcomes = {"done": 0, "cancelled": 0, "error": 0}
        async with serving(config) as (session, url, scheduler):
            gate = asyncio.Semaphore(100)

            async def one(i: int) -> None:
                model = rng.choice(["tiny", str(models["b"])])
                leave_after = rng.uniform(0.0, 1.5) if rng.random() < 0.3 else None
                async with gate:
                    call = asyncio.create_task(generate(session, url, model=model, prompt=f"Request {i}",
                                                        options=OPTIONS, keep_alive=rng.choice([None, "1m", 0])))
                    done, _ = await asyncio.wait([call], timeout=leave_after)
                    for runner in scheduler.loaded.values():
                        if runner.pid > 0:
                            pids.add(runner.pid)
                    if not done:
                        call.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await call
                        outcomes["cancelled"] += 1
                        return
                    status, lines = call.result()
                    if status == 200 and lines and lines[-1].get("done"):
                        outcomes["done"] += 1
                    else:
                        outcomes["error"] += 1
                        raise AssertionError(f"request {i} for {model}: {status} {lines[-1:]}")

            await asyncio.gather(*(one(i) for i in range(200)))
            await eventually(lambda: all(r.ref_count == 0 and r.waiting == 0 and r.active == 0
                                          for r in scheduler.loaded.values()))
            assert outcomes["done"] + outcomes["cancelled"] == 200 and outcomes["done"] > 100
            assert scheduler.pending_reqs.empty() and not scheduler.parked
            assert len(scheduler.loaded) <= 1
            pids.update(r.pid for r in scheduler.loaded.values())
        # the server is closed: every runner it ever started is gone
        assert pids and not [pid for pid in pids if pid_alive(pid)]

    run(body(), timeout=300)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_every_runner_on_signal(models, signum):
    port = free_port()
    env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(models["store"])}
    serve = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async def load() -> None:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}"
                await eventually(lambda: serve.poll() is None)
                for _ in range(300):
                    with contextlib.suppress(aiohttp.ClientConnectionError):
                        async with session.get(url + "/"):
                            break
                    await asyncio.sleep(0.05)
                status, [loaded] = await generate(session, url, model="tiny")
                assert (status, loaded["done_reason"]) == (200, "load")

        run(load(), timeout=60)
        runners = _children(serve.pid)
        assert runners and all(pid_alive(pid) for pid in runners)
        serve.send_signal(signum)
        assert serve.wait(timeout=30) in (0, -signum, 128 + signum)
        deadline = time.monotonic() + 5
        while any(pid_alive(pid) for pid in runners) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in runners if pid_alive(pid)], "orphaned runners"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
