"""`ollama-engine serve` against `llama-server` through HTTP, both real servers on the same GGUF.

    python bench/serve_bench.py --build-llama-server       # once: llama-server from the pinned llama.cpp (minutes)
    python bench/serve_bench.py [--model bench/out/llama-3.2-1b-Q4_0.gguf] [--streams 1,4,8]

Measures, with `--slots` (4) sequences sharing each server's model:
  * aggregate generated tokens/s and mean time to first token for 1, 4 and 8 concurrent streams
    (serve: /api/generate raw; llama-server: /completion; greedy, the same prompt texts), and the CPU
    milliseconds per generated token of each process: the two busiest threads of the runner and of
    llama-server (ggml's compute threads), their other threads, serve and this client. Both servers run
    at once and take turns, in --rounds rounds with their order swapped each round (medians; the ratio
    is the median of the rounds' ratios), so that the machine's drift hits both alike; with --runner a runner
    alone (no serve: Ollama's runner protocol straight from this client) takes its turn too, and with
    --its-runner the runner serve loaded, driven straight from this client (the hop alone: the same process
    with and without serve in front of it);
  * the serve -> runner hop: single-stream decode speed and first-token time through serve against the
    same requests sent straight to a runner (loaded by fit -> alloc -> commit as serve's scheduler does);
  * multi-turn chat: the second turn's first-token time against the first's, on a ~2,000-token conversation
    (serve's /api/chat: the template, the scheduler and the runner's prompt cache).

The synthetic models have random weights, so a stream may stop early at an end-of-generation token: the
counts are the tokens each server reports having generated. On a negligible-compute model (stories260K) run
each stream count as its own command: once several streams have decoded together their KV cells interleave,
and a later single stream's graph spans every slot's cells (bench/RESULTS.md, issue 33), which measures
attention, not the host. Results print as JSON (and go to --out).

Both servers get the same settings: threads (--threads, also for llama-server's prompt batches), slots,
context per slot, batch 512, f16 KV cache and flash attention (--flash-attention: llama-server's default
"auto" turns it on for the CPU, serve's leaves it off, so it is set on both). llama-server keeps its other
defaults (continuous batching, a KV stream per slot, its HTTP threads).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]  # bench helpers, build_ggml, the tests' helpers

from serve_process import free_port, serve_process  # noqa: E402  (tests/: how the tests start serve)
from workers import WorkerArgs, progress, start_runner  # noqa: E402

LLAMA_SERVER_BUILD = ROOT / "build" / "llama-server"
LLAMA_SERVER = LLAMA_SERVER_BUILD / "bin" / "llama-server"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "near old river banks under grey autumn skies").split()


def build_llama_server(jobs: int) -> Path:
    """llama-server from the llama.cpp tree build_ggml.py extracted (the source our ggml is built from), with
    the compiler flags of our ggml and the reference (build_ggml.compiler_cmake_args: no AMX kernels)."""
    from build_ggml import compiler_cmake_args

    tree = Path((ROOT / "build" / "source-path.txt").read_text().strip())
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *compiler_cmake_args()]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(LLAMA_SERVER_BUILD), *options], check=True)
    subprocess.run(["cmake", "--build", str(LLAMA_SERVER_BUILD), "--target", "llama-server", "-j", str(jobs)],
                   check=True)
    return LLAMA_SERVER


def prompt_text(index: int, words: int) -> str:
    """A distinct plain-text prompt of about `words` words (distinct: no stream reuses another's cache)."""
    return f"Story {index}: " + " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(words))


def stream_lines(url: str, body: dict[str, Any]) -> Iterator[bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        while line := response.readline():
            if line.strip():
                yield line


class Stream:
    """One streamed request: seconds to its first token, generated tokens, seconds in all."""

    def __init__(self, first_token_s: float, tokens: int, total_s: float):
        self.first_token_s, self.tokens, self.total_s = first_token_s, tokens, total_s


def timed_stream(chunks: Iterator[dict[str, Any]], text_of: Callable[[dict], str],
                 tokens_of: Callable[[dict], int | None]) -> Stream:
    start = time.perf_counter()
    first, tokens = None, None
    for chunk in chunks:
        if first is None and text_of(chunk):
            first = time.perf_counter() - start
        if (count := tokens_of(chunk)) is not None:
            tokens = count
    total = time.perf_counter() - start
    if tokens is None:
        raise RuntimeError("the stream ended without a final count of generated tokens")
    return Stream(total if first is None else first, tokens, total)


def serve_generate(url: str, model: str, num_ctx: int, threads: int) -> Callable[[str, int], Stream]:
    def run(prompt: str, n: int) -> Stream:
        body = {"model": model, "prompt": prompt, "raw": True, "stream": True,
                "options": {"num_predict": n, "temperature": 0, "seed": 0, "num_ctx": num_ctx, "num_thread": threads}}
        chunks = (json.loads(line) for line in stream_lines(url + "/api/generate", body))
        return timed_stream(chunks, lambda c: c.get("response", ""), lambda c: c.get("eval_count"))
    return run


def llama_server_completion(url: str) -> Callable[[str, int], Stream]:
    def run(prompt: str, n: int) -> Stream:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 0, "stream": True, "cache_prompt": True}
        chunks = (json.loads(line.removeprefix(b"data: ")) for line in stream_lines(url + "/completion", body))
        return timed_stream(chunks, lambda c: c.get("content", ""),
                            lambda c: c.get("tokens_predicted") if c.get("stop") else None)
    return run


def runner_completion(handle) -> Callable[[str, int], Stream]:
    def run(prompt: str, n: int) -> Stream:
        chunks = handle.completion(prompt, {"num_predict": n, "temperature": 0, "seed": 0})
        return timed_stream(chunks, lambda c: c.get("content", ""),
                            lambda c: c.get("eval_count") if c.get("done") else None)
    return run


class RunnerPort:
    """A runner someone else started (serve's), driven over Ollama's runner protocol from this client."""

    def __init__(self, pid: int):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        self.port = int(argv[argv.index(b"--port") + 1])

    def completion(self, prompt: str, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
        from ollama_engine.llm.runner_handle import completion_lines

        return completion_lines(self.port, prompt, options)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of a process (/proc schedstat: nanoseconds on a CPU)."""
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                seconds[tid] = int(stat.read().split()[0]) / 1e9
        except OSError:  # the thread has ended
            pass
    return seconds


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as listing:
            kids += [int(kid) for kid in listing.read().split()]
    return kids


def serve_pids() -> dict[str, int]:
    """serve (this process's child) and its runner."""
    serve = next(kid for kid in children(os.getpid()) if b" serve" in Path(f"/proc/{kid}/cmdline").read_bytes()
                 .replace(b"\0", b" "))
    return {"serve": serve, "runner": children(serve)[0]}


def cpu_per_token(pids: dict[str, int], before: dict[str, dict[str, float]], tokens: int,
                  client_seconds: float) -> dict[str, float]:
    """CPU ms per generated token: a model server's two busiest threads (ggml's compute threads, which spin
    while they wait) apart from its other threads (HTTP, batching, sampling), each other process, the client."""
    out = {}
    for name, pid in pids.items():
        after = thread_cpu(pid)
        used = sorted((seconds - before[name].get(tid, 0.0) for tid, seconds in after.items()), reverse=True)
        if name == "serve":
            out[name] = 1e3 * sum(used) / tokens
        else:
            out[name + "_compute"] = 1e3 * sum(used[:2]) / tokens
            out[name + "_other"] = 1e3 * sum(used[2:]) / tokens
    out["client"] = 1e3 * client_seconds / tokens
    return out


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def streams_once(run: Callable[[str, int], Stream], count: int, n_predict: int, words: int, pids: dict[str, int],
                 round_: int) -> dict:
    """`count` concurrent streams, each with its own prompt (new in every round: no prompt cache hits)."""
    prompts = [prompt_text(i + 100 * count + 10_000 * round_, words) for i in range(count)]
    before = {name: thread_cpu(pid) for name, pid in pids.items()}
    client = client_cpu()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        done = list(pool.map(lambda p: run(p, n_predict), prompts))
    wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in done)
    return {"aggregate_tps": tokens / wall, "wall_s": wall, "tokens": [s.tokens for s in done],
            "mean_first_token_s": sum(s.first_token_s for s in done) / count,
            "cpu_ms_per_token": cpu_per_token(pids, before, tokens, client_cpu() - client)}


def median(values: list[float]) -> float:
    return statistics.median(values)


def interleaved(servers: dict[str, tuple[Callable[[str, int], Stream], dict[str, int]]], streams: list[int],
                rounds: int, n_predict: int, words: int) -> dict[str, Any]:
    """Every stream count on every server, round after round, the servers' order swapped each round: a drift of
    the machine's speed hits both alike. Per server and count: medians over the rounds, and each round's t/s."""
    for run, _ in servers.values():
        run(prompt_text(999, 8), 4)  # warm-up
    rows: dict[str, dict[str, list[dict]]] = {name: {str(count): [] for count in streams} for name in servers}
    for round_ in range(rounds):
        order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
        for count in streams:
            for name in order:
                run, pids = servers[name]
                row = streams_once(run, count, n_predict, words, pids, round_)
                rows[name][str(count)].append(row)
                progress(f"round {round_ + 1}/{rounds}, {name}, {count} streams: {row['aggregate_tps']:.1f} t/s, "
                         f"first token {row['mean_first_token_s']:.3f} s")
    results: dict[str, Any] = {}
    for name, by_count in rows.items():
        results[name] = {count: {
            "aggregate_tps": median([r["aggregate_tps"] for r in runs]),
            "mean_first_token_s": median([r["mean_first_token_s"] for r in runs]),
            "cpu_ms_per_token": {key: median([r["cpu_ms_per_token"][key] for r in runs])
                                 for key in runs[0]["cpu_ms_per_token"]},
            "rounds_tps": [r["aggregate_tps"] for r in runs], "tokens": [r["tokens"] for r in runs],
        } for count, runs in by_count.items()}
    def ratios(ours: str, theirs: str) -> dict[str, float]:
        """Per stream count, the median over the rounds of the round's t/s ratio."""
        return {count: median([a["aggregate_tps"] / b["aggregate_tps"]
                               for a, b in zip(rows[ours][count], rows[theirs][count], strict=True)])
                for count in rows[ours]}

    if "llama_server" in rows:
        results["ratios"] = ratios("serve", "llama_server")
        if "runner" in rows:
            results["ratios_runner"] = ratios("runner", "llama_server")
    if "runner" in rows:
        results["ratios_serve_runner"] = ratios("serve", "runner")
    if "its_runner" in rows:
        results["ratios_serve_its_runner"] = ratios("serve", "its_runner")
    return results


def single(run: Callable[[str, int], Stream], n_predict: int, words: int, repeats: int) -> dict:
    """Single-stream decode speed (after the first token) and first-token time, medians over `repeats`."""
    run(prompt_text(998, 8), 4)
    tps, first = [], []
    for i in range(repeats):
        s = run(prompt_text(500 + i, words), n_predict)
        first.append(s.first_token_s)
        tps.append((s.tokens - 1) / max(s.total_s - s.first_token_s, 1e-9))
    return {"decode_tps": sorted(tps)[len(tps) // 2], "first_token_s": sorted(first)[len(first) // 2]}


def multi_turn(url: str, model: str, words: int) -> dict:
    """First-token time of a conversation's first turn (its whole prompt evaluated) and of its second turn."""
    options = {"num_predict": 16, "temperature": 0, "seed": 0, "num_ctx": 4096}
    messages = [{"role": "user", "content": prompt_text(7, words)}]

    def turn() -> Stream:
        body = {"model": model, "messages": messages, "stream": True, "options": options}
        replies: list[str] = []

        def text_of(chunk: dict) -> str:
            replies.append(chunk.get("message", {}).get("content", ""))
            return replies[-1]

        chunks = (json.loads(line) for line in stream_lines(url + "/api/chat", body))
        s = timed_stream(chunks, text_of, lambda c: c.get("eval_count") if c.get("done") else None)
        messages.append({"role": "assistant", "content": "".join(replies)})
        return s

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False, "options": options}
    urllib.request.urlopen(urllib.request.Request(url + "/api/chat", json.dumps(body).encode()), timeout=600).read()
    first = turn()
    messages.append({"role": "user", "content": "And then what happened?"})
    second = turn()
    return {"first_turn_first_token_s": first.first_token_s, "second_turn_first_token_s": second.first_token_s,
            "ratio": second.first_token_s / first.first_token_s}


def wait_http(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.25)


def loaded_on_gpu(results: dict[str, Any]) -> bool:
    """Whether serve put the model in GPU memory (/api/ps): a runner alone is then loaded on the GPU too, else
    the comparison would set a GPU-loaded serve against a CPU-loaded runner."""
    return any(m.get("size_vram") for m in results.get("serve_loaded", []))


def hop(args: argparse.Namespace, num_ctx: int, streams: list[int], results: dict[str, Any]) -> None:
    """Single-stream decode and first token straight to a runner, against serve's (results["serve_single"])."""
    progress("runner direct: single stream")
    worker = WorkerArgs(engine="runner", task="single", model=str(args.model), prompts={}, threads=args.threads,
                        t0=time.time(), gpu=loaded_on_gpu(results), streams=streams, verbose=False)
    handle, _, _ = start_runner(worker, num_ctx, args.slots)
    try:
        results["runner_single"] = single(runner_completion(handle), args.n_predict, args.prompt_words, 5)
    finally:
        handle.close()
    serve_single, runner_single = results["serve_single"], results["runner_single"]
    results["hop"] = {"decode_ratio": serve_single["decode_tps"] / runner_single["decode_tps"],
                      "first_token_extra_ms": 1e3 * (serve_single["first_token_s"] - runner_single["first_token_s"])}


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, num_ctx: int) -> Iterator[tuple[str, int]]:
    """llama-server with serve's settings; its URL and pid."""
    port = free_port()
    command = [str(args.llama_server), "-m", str(args.model), "--port", str(port), "-np", str(args.slots),
               "-c", str(num_ctx * args.slots), "-t", str(args.threads), "-tb", str(args.threads), "-b", "512",
               "-ctk", "f16", "-ctv", "f16", "-fa", args.flash_attention, "--no-webui"]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", server)
            yield f"http://127.0.0.1:{port}", server.pid
        finally:
            server.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=HERE / "out" / "llama-3.2-1b-Q4_0.gguf")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--build-llama-server", action="store_true", help="build llama-server, then exit")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-ctx", type=int, default=1024, help="context per slot")
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--chat-words", type=int, default=1500, help="first turn of the multi-turn chat (~2k tokens)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--flash-attention", choices=("off", "on"), default="off")
    parser.add_argument("--runner", action="store_true",
                        help="also a runner alone (no serve) in the interleaved rounds (flash attention off only)")
    parser.add_argument("--its-runner", action="store_true",
                        help="also serve's own runner driven straight from this client in the interleaved rounds")
    parser.add_argument("--concurrency-only", action="store_true", help="skip the hop and the multi-turn chat")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the interleaved concurrency runs")
    parser.add_argument("--out", type=Path, default=HERE / "out" / "serve_bench.json")
    args = parser.parse_args()
    if args.build_llama_server:
        print(build_llama_server(os.cpu_count() or 2))
        return 0
    if args.runner and args.flash_attention != "off":
        parser.error("--runner: workers.start_runner loads without flash attention")
    if not args.model.exists():
        raise SystemExit(f"{args.model} is missing: `python bench/bench.py` writes the synthetic models")
    streams = [int(s) for s in args.streams.split(",")]
    results: dict[str, Any] = {"model": str(args.model), "slots": args.slots, "threads": args.threads,
                               "flash_attention": args.flash_attention}
    num_ctx = args.slot_ctx

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        from ollama_engine.store import Store

        store = Store(Path(tmp) / "models")
        store.create("bench", files={args.model.name: store.add_file(args.model)})
        env = {"OLLAMA_NUM_PARALLEL": str(args.slots), "OLLAMA_KEEP_ALIVE": "1h",
               "OLLAMA_FLASH_ATTENTION": str(int(args.flash_attention == "on"))}
        url = stack.enter_context(serve_process(store.root, **env))
        generate = serve_generate(url, "bench", num_ctx, args.threads)
        generate(prompt_text(997, 8), 4)  # loads the model: its runner is then serve's child
        with urllib.request.urlopen(url + "/api/ps", timeout=10) as ps:  # where it loaded (size_vram)
            results["serve_loaded"] = [{k: m.get(k) for k in ("size", "size_vram", "context_length")}
                                       for m in json.loads(ps.read())["models"]]
        servers = {"serve": (generate, serve_pids())}
        if args.its_runner:
            runner_pid = servers["serve"][1]["runner"]
            servers["its_runner"] = (runner_completion(RunnerPort(runner_pid)), {"runner": runner_pid})
        if args.runner:  # the runner alone, loaded as serve's scheduler loads it, driven over Ollama's protocol
            worker = WorkerArgs(engine="runner", task="single", model=str(args.model), prompts={}, threads=args.threads,
                                t0=time.time(), gpu=loaded_on_gpu(results), streams=streams, verbose=False)
            handle = stack.enter_context(start_runner(worker, num_ctx, args.slots)[0])
            servers["runner"] = (runner_completion(handle), {"runner": handle.process.pid})
        if args.llama_server.exists() or shutil.which(str(args.llama_server)):
            llama_url, llama_pid = stack.enter_context(llama_server(args, num_ctx))
            servers["llama_server"] = (llama_server_completion(llama_url), {"llama_server": llama_pid})
        else:
            progress(f"no llama-server at {args.llama_server}: run with --build-llama-server first")
        progress("concurrency, " + " and ".join(servers) + " interleaved")
        results.update(interleaved(servers, streams, args.rounds, args.n_predict, args.prompt_words))
        if not args.concurrency_only:
            results["serve_single"] = single(generate, args.n_predict, args.prompt_words, 5)
            progress("serve: multi-turn chat")
            results["multi_turn"] = multi_turn(url, "bench", args.chat_words)

    if args.concurrency_only:
        pass
    elif args.flash_attention == "off":  # workers.start_runner loads without flash attention
        hop(args, num_ctx, streams, results)
    else:
        progress("the serve -> runner hop is measured with --flash-attention off only")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
