"""Soak `serve`: many requests over two models with random disconnects, cancels and keep-alive values.

serve runs as a subprocess on a fresh store with two tiny synthetic llamas. Clients (4 at a time) send generate
and chat requests, streamed or not, with a random keep_alive (0, 1s, 5m, forever, absent); some hang up after
the first streamed line (disconnect), some give up after a random short time (cancel). Afterwards:

- no leaked slot or reference: /api/ps shows nothing in flight and nothing queued, and a last request works;
- no runner left behind: every runner process seen during the run is gone once serve has stopped (SIGTERM);
- serve's RSS growth from after the warm-up to the end is reported (and bounded by --max-rss-growth-mib);
- latency percentiles of the requests that completed, by kind.

    .venv/bin/python tools/soak.py --requests 1000          # the full run (RELIABILITY.md)
    .venv/bin/python tools/soak.py --requests 60            # what tests/test_soak.py runs in CI
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the synthetic models

ROOT = Path(__file__).resolve().parent.parent
KEEP_ALIVES: list[Any] = [0, "1s", "5m", -1, None]
KEEP_ALIVE_WEIGHTS = [1, 1, 4, 2, 4]  # unloads (0, 1s) are rarer: each one costs the next request a load
WARMUP = 20  # requests before the first RSS reading


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def runner_pids(serve_pid: int) -> set[int]:
    """Children of serve that are runners."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == serve_pid and b"runner" in cmdline:
            pids.add(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def make_store(root: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from synthetic.models import write_synthetic

    from ollama_engine.store import Store

    store = Store(root / "models")
    for name, seed in (("alpha", 1), ("beta", 2)):
        gguf = write_synthetic(root / f"{name}.gguf", "tiny-llama", seed=seed)
        store.create(name, files={f"{name}.gguf": store.add_file(gguf)})


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> tuple[str, str, float]:
    """(kind, outcome, seconds): outcome is ok, disconnect, cancel, or error:<status>."""
    model = rng.choice(["alpha", "beta"])
    stream = rng.random() < 0.6
    options = {"num_predict": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
    body: dict[str, Any] = {"model": model, "options": options, "stream": stream}
    keep_alive = rng.choices(KEEP_ALIVES, KEEP_ALIVE_WEIGHTS)[0]
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if rng.random() < 0.5:
        kind, path = "generate", "/api/generate"
        body["prompt"] = rng.choice(["Once upon a time", "The cat", "Hello"])
    else:
        kind, path = "chat", "/api/chat"
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Tell me a story", "Why?"])}]
    action = rng.choices(["complete", "disconnect", "cancel"], [8, 1, 1])[0]
    started = time.monotonic()
    try:
        if action == "cancel":
            async with asyncio.timeout(rng.uniform(0.01, 0.3)):
                async with session.post(url + path, json=body) as response:
                    await response.read()
        else:
            async with session.post(url + path, json=body) as response:
                if response.status != 200:
                    return kind, f"error:{response.status}:{(await response.text())[:200]}", 0.0
                if action == "disconnect" and stream:
                    await response.content.readline()
                    response.close()
                    return kind, "disconnect", 0.0
                lines = [json.loads(line) for line in (await response.read()).splitlines() if line.strip()]
                if not lines or not lines[-1].get("done") or "error" in lines[-1]:
                    return kind, f"error:stream:{lines[-1] if lines else 'empty'}", 0.0
    except TimeoutError:
        return kind, "cancel", 0.0
    return kind, "ok" if action != "cancel" else "ok (before its cancel)", time.monotonic() - started


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {"n": len(ordered), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": round(ordered[-1] * 1000, 1), "mean_ms": round(statistics.fmean(ordered) * 1000, 1)}


async def drive(url: str, serve_pid: int, requests: int, concurrency: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    latencies: dict[str, list[float]] = {"generate": [], "chat": []}
    runners: set[int] = set()
    rss: dict[str, float] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    done = 0

    async def client(session: aiohttp.ClientSession, worker_rng: random.Random) -> None:
        nonlocal done
        while not queue.empty():
            queue.get_nowait()
            kind, outcome, seconds = await one_request(session, url, worker_rng)
            outcomes[outcome.split(":")[0] if outcome.startswith("error") else outcome] += 1
            if outcome.startswith("error"):
                outcomes_detail.append(outcome)
            if seconds:
                latencies[kind].append(seconds)
            runners.update(runner_pids(serve_pid))
            done += 1
            if done == WARMUP:
                rss["after_warmup_mib"] = rss_mib(serve_pid)

    outcomes_detail: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        rss["start_mib"] = rss_mib(serve_pid)
        started = time.monotonic()
        await asyncio.gather(*(client(session, random.Random(rng.random())) for _ in range(concurrency)))
        seconds = time.monotonic() - started
        # settle: disconnected and cancelled requests end, then nothing may remain in flight or queued
        deadline = time.monotonic() + 30
        while True:
            async with session.get(url + "/api/ps") as response:
                ps = (await response.json())["models"]
            busy = [m for m in ps if m.get("in_flight") or m.get("queue_depth")]
            if not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        async with session.post(url + "/api/generate", json={"model": "alpha", "prompt": "Once", "stream": False,
                                                               "options": {"num_predict": 2}}) as response:
            last_ok = response.status == 200 and (await response.json()).get("done") is True
        rss["end_mib"] = rss_mib(serve_pid)
    return {
        "requests": requests, "concurrency": concurrency, "seconds": round(seconds, 1), "outcomes": dict(outcomes),
        "errors": outcomes_detail[:10], "in_flight_after": busy, "last_request_ok": last_ok,
        "latency": {kind: percentiles(values) for kind, values in latencies.items()},
        "rss": {**{k: round(v, 1) for k, v in rss.items()},
                "growth_mib": round(rss["end_mib"] - rss.get("after_warmup_mib", rss["start_mib"]), 1)},
        "runners_seen": sorted(runners),
    }


def soak(requests: int, concurrency: int = 4, seed: int = 0, workdir: Path | None = None) -> dict[str, Any]:
    """Run the soak; the report as a dict (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = workdir or Path(tmp)
        make_store(root)
        port = _free_port()
        env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(root / "models"),
               "OLLAMA_NUM_PARALLEL": "2", "PYTHONPATH": str(ROOT)}
        log = open(root / "serve.log", "wb")
        process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for(url, process)
            report = asyncio.run(drive(url, process.pid, requests, concurrency, seed))
            process.send_signal(signal.SIGTERM)
            report["serve_exit_code"] = process.wait(60)
            deadline = time.monotonic() + 10
            while any(alive(pid) for pid in report["runners_seen"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            report["runners_left"] = [pid for pid in report["runners_seen"] if alive(pid)]
            report["runners_seen"] = len(report["runners_seen"])
            report["tracebacks_in_log"] = (root / "serve.log").read_text(errors="replace").count("Traceback")
            return report
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, process: subprocess.Popen) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start") from None
            time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=100.0)
    args = parser.parse_args()
    report = soak(args.requests, args.concurrency, args.seed)
    print(json.dumps(report, indent=1))
    ok = (not report["in_flight_after"] and report["last_request_ok"] and not report["runners_left"]
          and report["rss"]["growth_mib"] <= args.max_rss_growth_mib and "error" not in report["outcomes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
