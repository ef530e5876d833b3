#!/usr/bin/env python3
"""A model split over two RPC hosts and the local CPU, against the same model on one host, on loopback.

Starts two `ollama-engine rpc-server` processes on this machine, then loads the synthetic model twice in one
process: all layers on the CPU, and a third of its layers on each host (the first third, the token embeddings
and the inputs stay local). Rounds alternate the two, as interleaved.py does, so that a drift of the machine
hits both alike. On one machine nothing runs in parallel (a token passes the hosts one after another), so the
ratio is the cost of ggml's RPC transport: copies, serialization and a round trip per split per step.

    .venv/bin/python bench/rpc_split.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from interleaved import BATCH, N_CTX, N_PP, N_TG, Ours, seconds  # noqa: E402

from bench import ensure_model, log, wait_quiet  # noqa: E402


class Split(Ours):
    """Ours, with layers [n/3, 2n/3) on the first host and [2n/3, n] (the output included) on the second."""

    def __init__(self, path: Path, threads: int, endpoints: list[str]):
        from ollama_engine.fs import GGUFFile
        from ollama_engine.ml import DType, GPULayers
        from ollama_engine.ml.memory import DeviceID
        from ollama_engine.models import load_model

        layers = GGUFFile.open(path).config.get_uint("block_count") + 1
        a, b = layers // 3, 2 * layers // 3
        layout = [GPULayers(DeviceID(endpoints[0], "RPC"), list(range(a, b))),
                  GPULayers(DeviceID(endpoints[1], "RPC"), list(range(b, layers)))]
        self.model = load_model(path, layout, num_threads=threads)
        self.model.backend.load()
        self.model.cache.init(self.model.backend, DType.F16, 1, N_CTX, BATCH)


def start_servers(threads: int) -> tuple[list[str], list[subprocess.Popen]]:
    from ollama_engine.ggml import rpc
    from ollama_engine.llm.runner_handle import free_port

    endpoints, processes = [], []
    for _ in range(2):
        port = free_port()
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "ollama_engine", "rpc-server", "--port", str(port), "--threads", str(threads)],
            stdout=subprocess.DEVNULL))
        endpoints.append(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    for endpoint in endpoints:
        while True:
            try:
                rpc.probe(endpoint)
                break
            except rpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return endpoints, processes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a model of bench.py (default smollm2-135m)")
    parser.add_argument("--threads", type=int, default=2, help="threads here and on each host (default 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for a quiet machine per round")
    args = parser.parse_args()
    path = ensure_model(args.model)
    endpoints, servers = start_servers(args.threads)
    try:
        os.environ["OLLAMA_RPC_SERVERS"] = ",".join(endpoints)
        engines = {"one host": Ours(path, args.threads), "split": Split(path, args.threads, endpoints)}
        tokens = np.random.default_rng(0).integers(100, engines["split"].model.tokenizer.vocab_size, N_PP).tolist()
        for engine in engines.values():  # warm-up
            engine.prompt(tokens[:32])
            engine.clear()
            engine.generate(tokens[0], 4)
            engine.clear()
        times: dict[str, dict[str, list[float]]] = {e: {"pp": [], "tg": []} for e in engines}
        for round_ in range(args.rounds):
            wait_quiet(args.quiet_wait)
            for label in list(engines) if round_ % 2 == 0 else list(reversed(engines)):
                engine = engines[label]
                times[label]["pp"].append(seconds(lambda: engine.prompt(tokens)))  # noqa: B023 - called at once
                engine.clear()
                times[label]["tg"].append(seconds(lambda: engine.generate(tokens[0], N_TG)))  # noqa: B023
                engine.clear()
            log(f"round {round_ + 1}/{args.rounds}: split/one host pp "
                f"{times['one host']['pp'][-1] / times['split']['pp'][-1]:.3f}, tg "
                f"{times['one host']['tg'][-1] / times['split']['tg'][-1]:.3f}")
        for engine in engines.values():
            engine.model.close()
    finally:
        for server in servers:
            server.kill()
            server.wait()
    row = [args.model]
    for kind, n in (("pp", N_PP), ("tg", N_TG)):
        one, split = (n / statistics.median(times[e][kind]) for e in ("one host", "split"))
        ratios = sorted(o / s for o, s in zip(times["one host"][kind], times["split"][kind], strict=True))
        row += [f"{one:.1f}", f"{split:.1f}", f"{statistics.median(ratios):.3f}"]
    print("| model | pp512 one host t/s | pp512 split t/s | pp split/one | tg128 one host t/s | tg128 split t/s "
          "| tg split/one |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
