"""A runner's time to ready and decode speed with each way of putting its weights on 2 MiB pages
(OLLAMA_ENGINE_HUGE_PAGES): "fault" advises the buffers before loading (the load pays for compaction),
"collapse" (the default) moves the loaded weights in the background once the model is idle. Decode is
measured right after ready (what a request that arrives with the load meets) and, for collapse, again
after a pause in which the move finishes. Wall clock: run it on a quiet machine.

    .venv/bin/python bench/huge_pages.py bench/out/llama-3.2-1b-Q4_0.gguf --reps 2

Per run: spawn a runner, /load fit -> alloc -> commit, wait for ready, [pause], a 4-token warm-up, then
129 greedy tokens; t/s = 128 / eval_duration. AnonHugePages is the runner's when that decode starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ready_cpu import memory_mib  # noqa: E402
from workers import BATCH, N_CTX, complete  # noqa: E402

from ollama_engine.fs import GGUFFile  # noqa: E402
from ollama_engine.llm.discovery import system_info  # noqa: E402
from ollama_engine.llm.load import LoadOptions, load  # noqa: E402
from ollama_engine.llm.runner_handle import RunnerHandle  # noqa: E402
from ollama_engine.server.wire import ServerStatus  # noqa: E402

VARIANTS = (("fault", 0.0), ("collapse", 0.0), ("collapse", 5.0))  # (mode, pause after ready in seconds)


def run(model: str, mode: str, pause: float, threads: int) -> tuple[float, float, float]:
    """(seconds from spawn to ready, decode t/s, AnonHugePages MiB when the decode starts)."""
    os.environ["OLLAMA_ENGINE_HUGE_PAGES"] = mode  # the runner inherits it
    total_layers = GGUFFile.open(model).config.get_uint("block_count") + 1
    options = LoadOptions(num_ctx=N_CTX, parallel=1, batch_size=BATCH, num_gpu=0, num_threads=threads,
                          kv_cache_type="f16")
    start = time.perf_counter()
    handle = RunnerHandle.start(model)
    try:
        handle.wait_launched()
        load(handle, system_info(), [], total_layers, options)
        while handle.health(timeout=5)[0] != ServerStatus.READY:
            time.sleep(0.005)
        ready = time.perf_counter() - start
        time.sleep(pause)
        complete(handle, "The quick brown fox", 4)
        huge = memory_mib(handle.process.pid)["AnonHugePages"]
        final = complete(handle, "Once upon a time", 129)
        return ready, (final["eval_count"] - 1) / (final["eval_duration"] / 1e9), huge
    finally:
        handle.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print("| model | mode | pause s | time to ready s | tg128 t/s | AnonHugePages MiB | tg of each rep |")
    print("|---|---|---:|---:|---:|---:|---|")
    for model in args.models:
        results: dict[tuple[str, float], list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):  # variants alternate within each rep
            for mode, pause in VARIANTS:
                results[mode, pause].append(run(model, mode, pause, args.threads))
        for (mode, pause), rows in results.items():
            ready, tg, huge = (statistics.median(r[i] for r in rows) for i in range(3))
            print(f"| {Path(model).stem} | {mode} | {pause:.0f} | {ready:.2f} | {tg:.1f} | {huge:.0f} | "
                  f"{', '.join(f'{r[1]:.1f}' for r in rows)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
