"""Where a runner's time to ready goes, in the runner's own CPU seconds (meaningful on a shared machine,
where wall time is not; wall seconds are printed beside them): imports until /health answers, then each
/load of fit -> alloc -> commit as Ollama's parent sends them, then reading the weights until /health
says ready. Also its peak RSS, its memory at ready (anonymous and file-backed, from smaps_rollup), and
the work that follows ready in the background: the tokenizer's BPE model (built once the runner is ready,
see server/app.py; a first request waits for it) and the weights' move onto 2 MiB pages
(OLLAMA_ENGINE_HUGE_PAGES=collapse): its CPU seconds and AnonHugePages.

    .venv/bin/python bench/ready_cpu.py bench/out/llama-3.2-1b-Q4_0.gguf bench/out/smollm2-135m-Q8_0.gguf
    .venv/bin/python bench/ready_cpu.py --mmap bench/out/llama-3.2-1b-f16-F16.gguf   # mapped, as llama.cpp
    .venv/bin/python bench/ready_cpu.py --mmap --wall 7 bench/out/llama-3.2-1b-f16-F16.gguf   # wall s vs llama.cpp
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers import BATCH, N_CTX, WorkerArgs, peak_rss_mib, process_cpu_seconds, start_runner  # noqa: E402

from bench import compile_engine  # noqa: E402
from ollama_engine.fs import GGUFFile  # noqa: E402
from ollama_engine.llm.discovery import system_info  # noqa: E402
from ollama_engine.llm.load import LoadOptions, load  # noqa: E402
from ollama_engine.llm.runner_handle import RunnerHandle  # noqa: E402
from ollama_engine.server.wire import ServerStatus  # noqa: E402


def memory_mib(pid: int) -> dict[str, float]:
    """The process's Rss, Anonymous, AnonHugePages and file-backed pages (Rss - Anonymous), in MiB."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in f if line.endswith("kB\n")}
    keep = {key: fields[key] for key in ("Rss", "Anonymous", "AnonHugePages")}
    return {**keep, "file": fields["Rss"] - fields["Anonymous"]}


def after_ready(pid: int, settle: float = 1.0, limit: float = 30.0) -> tuple[float, float]:
    """(CPU seconds, AnonHugePages MiB) once the runner has been idle for `settle` seconds after ready:
    what moving the weights onto huge pages in the background cost, and where it left them."""
    cpu, start = process_cpu_seconds(pid), time.monotonic()
    while time.monotonic() - start < limit:
        time.sleep(settle)
        if process_cpu_seconds(pid) - cpu < 0.02:
            break
        cpu = process_cpu_seconds(pid)
    return process_cpu_seconds(pid), memory_mib(pid)["AnonHugePages"]


def phases(model: str, threads: int, use_mmap: bool = False,
           ) -> tuple[list[tuple[str, float, float]], float, dict[str, float]]:
    """(phase, CPU seconds, wall seconds) in order, the runner's VmHWM in MiB and its memory (memory_mib)
    at ready; the last phase is what the runner did after ready until idle, with AnonHugePages then."""
    total_layers = GGUFFile.open(model).config.get_uint("block_count") + 1
    options = LoadOptions(num_ctx=N_CTX, parallel=1, batch_size=BATCH, num_gpu=0, num_threads=threads,
                          kv_cache_type="f16", use_mmap=use_mmap)
    start = time.perf_counter()
    handle = RunnerHandle.start(model)
    try:
        handle.wait_launched()
        pid = handle.process.pid

        def mark(name: str) -> None:
            marks.append((name, process_cpu_seconds(pid), time.perf_counter() - start))

        marks: list[tuple[str, float, float]] = []
        mark("imports (to /health)")
        load(handle, system_info(), [], total_layers, options,
             on_attempt=lambda attempt: mark(f"/load {attempt.operation.name.lower()}"))
        while handle.health(timeout=5)[0] != ServerStatus.READY:
            time.sleep(0.005)
        mark("weights read (ready)")
        rss, memory = peak_rss_mib(pid), memory_mib(pid)
        cpu, huge = after_ready(pid)
        marks.append((f"after ready ({huge:.0f} MiB huge)", cpu, time.perf_counter() - start))
    finally:
        handle.close()
    previous, out = (0.0, 0.0), []
    for name, seconds, wall in marks:
        out.append((name, seconds - previous[0], wall - previous[1]))
        previous = (seconds, wall)
    return out, rss, memory


_LLAMA_CPP_READY = """
import sys, time
sys.path.insert(0, sys.argv[2])
from workers import N_CTX, LlamaCpp, WorkerArgs
args = WorkerArgs(engine="llamacpp", task="ready", model=sys.argv[3], prompts={}, threads=int(sys.argv[4]),
                  t0=float(sys.argv[1]), gpu=False, streams=[], verbose=False)
LlamaCpp(args, N_CTX, 1)
print(time.time() - args.t0)
"""


def wall_to_ready(model: str, threads: int, use_mmap: bool, reps: int) -> dict[str, list[float]]:
    """Seconds to ready as bench.py measures them, engines alternating in fresh processes: the runner from its
    spawn to /health ready through fit -> alloc -> commit (workers.start_runner); llama.cpp from before its
    process starts to its model and context made (workers.LlamaCpp; bench.py's worker imports more first)."""
    here = str(Path(__file__).resolve().parent)
    worker = WorkerArgs(engine="runner", task="ready", model=model, prompts={}, threads=threads, t0=time.time(),
                        gpu=False, streams=[], verbose=False, mmap=use_mmap)
    seconds: dict[str, list[float]] = {"runner": [], "llamacpp": []}
    for rep in range(reps):
        for engine in ("runner", "llamacpp") if rep % 2 == 0 else ("llamacpp", "runner"):
            if engine == "runner":
                handle, ready, _ = start_runner(worker, N_CTX, 1)
                handle.close()
            else:
                out = subprocess.run([sys.executable, "-c", _LLAMA_CPP_READY, repr(time.time()), here, model,
                                      str(threads)], check=True, capture_output=True, text=True).stdout
                ready = float(out.split()[-1])
            seconds[engine].append(ready)
            print(f"  rep {rep + 1}/{reps} {engine:8s} {ready:.3f} s", flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mmap", action="store_true", help="map the file (UseMmap) instead of reading it")
    parser.add_argument("--wall", type=int, metavar="REPS",
                        help="instead: wall seconds to ready of the runner and llama.cpp, alternating, REPS each")
    args = parser.parse_args()
    compile_engine()  # as bench.py: an installed package's bytecode
    if args.wall:
        for model in args.models:
            print(model, "(mapped)" if args.mmap else "(read)")
            seconds = wall_to_ready(model, args.threads, args.mmap, args.wall)
            runner, llamacpp = (statistics.median(seconds[e]) for e in ("runner", "llamacpp"))
            ratios = [r / c for r, c in zip(seconds["runner"], seconds["llamacpp"], strict=True)]
            print(f"  median runner {runner:.3f} s, llama.cpp {llamacpp:.3f} s: {runner / llamacpp:.2f}x "
                  f"(median of the reps' ratios {statistics.median(ratios):.2f}x)")
        return 0
    for model in args.models:
        steps, rss, memory = phases(model, args.threads, args.mmap)
        print(model)
        print(f"  {'phase':28s}   CPU s  wall s (a quiet machine's only)")
        for name, seconds, wall in steps:
            print(f"  {name:28s} {seconds:7.2f} {wall:7.2f}")
        cpu, wall = (sum(step[i] for step in steps[:-1]) for i in (1, 2))
        print(f"  {'total to ready':28s} {cpu:7.2f} {wall:7.2f}   peak RSS {rss:.0f} MiB")
        print("  at ready, MiB: " + ", ".join(f"{key} {value:.0f}" for key, value in memory.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
