"""A small /embedding request's latency through a real runner, and the runner's OS threads after.

Usage (timings for RESULTS.md on a quiet machine only):
    .venv/bin/python bench/embed_latency.py [--requests 400] [--rounds 3] [--threads 2]

Each round starts a runner subprocess per model (synthetic BERT encoders: tiny-bert, 2 layers of 64, and a
bge-small-shaped one, 12 layers of 384), loads it as Ollama's parent does, warms it with 20 requests, then sends
`--requests` embedding requests of a few words one after another on one keep-alive connection and times each
(client side: request written to answer read). Reported per model: the median and 90th percentile over all
rounds, and the runner's threads at the end (Python's and the OS's: OpenMP pools show in the latter).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from synthetic.models import write_synthetic  # noqa: E402
from workers import WorkerArgs, start_runner  # noqa: E402

from ollama_engine.llm.runner_handle import RunnerHandle  # noqa: E402

MODELS = {  # name: (preset, overrides)
    "tiny-bert": ("tiny-bert", {}),
    "bge-small-shaped": ("tiny-bert", {"n_layer": 12, "n_embd": 384, "n_head": 12, "n_head_kv": 12, "n_ff": 1536}),
}
TEXT = "the quick brown fox jumps over the lazy dog"
WARMUP = 20


def start(path: Path, threads: int) -> RunnerHandle:
    """A runner with the model loaded as serve's scheduler loads it (workers.start_runner), 512 tokens, one slot."""
    worker = WorkerArgs(engine="runner", task="embed", model=str(path), prompts={}, threads=threads, t0=time.time(),
                        gpu=False, streams=[1], verbose=False)
    return start_runner(worker, 512, 1)[0]


def os_threads(pid: int) -> int:
    """The process's OS threads (Python's and every OpenMP pool's workers)."""
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def measure(path: Path, threads: int, requests: int) -> tuple[list[float], int]:
    handle = start(path, threads)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", handle.port, timeout=60)
        body = json.dumps({"content": TEXT}).encode()
        times = []
        for i in range(WARMUP + requests):
            started = time.perf_counter()
            connection.request("POST", "/embedding", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"/embedding answered {response.status}: {data[:200]!r}")
            if i >= WARMUP:
                times.append(elapsed)
        connection.close()
        return times, os_threads(handle.process.pid)
    finally:
        handle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in args.models.split(","):
        preset, overrides = MODELS[name]
        paths[name] = write_synthetic(out / f"embed-{name}.gguf", preset, weight_type="F16", **overrides)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(args.rounds):
        for name, path in paths.items():
            got, threads = measure(path, args.threads, args.requests)
            times[name] += got
            print(f"round {round_ + 1} {name}: median {statistics.median(got) * 1e3:.3f} ms, "
                  f"runner OS threads {threads}", flush=True)
    for name, values in times.items():
        values.sort()
        print(f"{name}: {len(values)} requests, median {statistics.median(values) * 1e3:.3f} ms, "
              f"p90 {values[int(len(values) * 0.9)] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
