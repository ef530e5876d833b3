"""Where a runner's time to ready goes, in the runner's own CPU seconds (meaningful on a shared machine,
where wall time is not): imports until /health answers, then each /load of fit -> alloc -> commit as
Ollama's parent sends them, then reading the weights until /health says ready. Also its peak RSS.

    .venv/bin/python bench/ready_cpu.py bench/out/llama-3.2-1b-Q4_0.gguf bench/out/smollm2-135m-Q8_0.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers import BATCH, N_CTX, peak_rss_mib, process_cpu_seconds  # noqa: E402

from ollama_engine.fs import GGUFFile  # noqa: E402
from ollama_engine.llm.discovery import system_info  # noqa: E402
from ollama_engine.llm.load import LoadOptions, load  # noqa: E402
from ollama_engine.llm.runner_handle import RunnerHandle  # noqa: E402
from ollama_engine.server.wire import ServerStatus  # noqa: E402


def phases(model: str, threads: int) -> tuple[list[tuple[str, float]], float]:
    """(phase, CPU seconds) in order, and the runner's VmHWM in MiB."""
    total_layers = GGUFFile.open(model).config.get_uint("block_count") + 1
    options = LoadOptions(num_ctx=N_CTX, parallel=1, batch_size=BATCH, num_gpu=0, num_threads=threads,
                          kv_cache_type="f16")
    handle = RunnerHandle.start(model)
    try:
        handle.wait_launched()
        pid = handle.process.pid
        marks = [("imports (to /health)", process_cpu_seconds(pid))]
        load(handle, system_info(), [], total_layers, options,
             on_attempt=lambda a: marks.append((f"/load {a.operation.name.lower()}", process_cpu_seconds(pid))))
        while handle.health(timeout=5)[0] != ServerStatus.READY:
            time.sleep(0.01)
        marks.append(("weights read (ready)", process_cpu_seconds(pid)))
        rss = peak_rss_mib(pid)
    finally:
        handle.close()
    previous, out = 0.0, []
    for name, seconds in marks:
        out.append((name, seconds - previous))
        previous = seconds
    return out, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    for model in args.models:
        steps, rss = phases(model, args.threads)
        print(model)
        for name, seconds in steps:
            print(f"  {name:22s} {seconds:5.2f} s")
        print(f"  {'total':22s} {sum(s for _, s in steps):5.2f} s CPU   peak RSS {rss:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
