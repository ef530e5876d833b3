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
from workers import N_CTX, WorkerArgs, complete, start_runner  # noqa: E402

VARIANTS = (("fault", 0.0), ("collapse", 0.0), ("collapse", 5.0))  # (mode, pause after ready in seconds)


def run(model: str, mode: str, pause: float, threads: int) -> tuple[float, float, float]:
    """(seconds from spawn to ready, decode t/s, AnonHugePages MiB when the decode starts)."""
    os.environ["OLLAMA_ENGINE_HUGE_PAGES"] = mode  # the runner inherits it
    args = WorkerArgs(engine="runner", task="huge_pages", model=model, prompts={}, threads=threads, t0=time.time(),
                      gpu=False, streams=[], verbose=False)
    handle, ready, _ = start_runner(args, N_CTX, parallel=1)
    try:
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
