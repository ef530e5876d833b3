"""Models of the size people run, through serve as a user meets them: create -> load -> chat.

Usage:
    .venv/bin/python bench/real_size.py [--models llama-3.2-1b-f16,llama-3.1-8b] [--threads 2] [--json OUT]

For each synthetic model of bench.py (written to bench/out/ on first use; the 8B-shaped Q4_K is 4.9 GB, the
Llama-3.2-1B-shaped F16 2.8 GiB), against a fresh serve with its own store:
- create: the official `ollama` client's create_blob (the upload that `ollama create` does) and create;
  seconds, MB/s against `cp` of the same file to the same file system (both from a warm page cache), and
  serve's peak RSS growth (its VmHWM before and after);
- load + chat, with the blob's pages dropped from the page cache (posix_fadvise DONTNEED: "cold") and
  again after an unload ("warm"): time to ready (the request's load_duration), the runner's resident
  memory after load (VmRSS) and its peak (VmHWM), and `plan`'s estimate for the same options;
- prompt and decode speed of that chat (a 512-word prompt, 32 tokens), from the response's own durations.
llama.cpp's rows for the same files (time to ready, peak RSS, pp512, tg128) come from bench.py:
    .venv/bin/python bench/bench.py --models llama-3.2-1b-f16,llama-3.1-8b --engines runner,llamacpp --streams ''
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (bench/bench.py: the synthetic models)

NUM_CTX = 4096
PROMPT_WORDS = 512
PREDICT = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(pid: int, field: str) -> int:
    """A /proc/PID/status size (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def copy_rate(path: Path, folder: Path) -> float:
    """MB/s of `cp` of the file into `folder` (the store's file system), from a warm page cache."""
    bench.read_through(path)
    target = folder / "cp-copy"
    start = time.perf_counter()
    subprocess.run(["cp", str(path), str(target)], check=True)
    os.sync()
    seconds = time.perf_counter() - start
    target.unlink()
    return path.stat().st_size / seconds / 1e6


def plan_estimate(blob: Path, threads: int) -> int:
    """plan's total for the CPU (input weights, weights, KV cache, graph) at the chat's options."""
    out = subprocess.run([sys.executable, "-m", "ollama_engine", "plan", str(blob), "--ctx", str(NUM_CTX),
                          "--flash-attention", "off", "--json"], check=True, capture_output=True, text=True)
    memory = json.loads(out.stdout)["memory"]
    cpu = memory["CPU"]
    return memory["InputWeights"] + sum(cpu["Weights"]) + sum(cpu["Cache"]) + cpu["Graph"]


def chat_once(client: Any, model: str, prompt: str, threads: int) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    final = None
    for part in client.chat(model=model, messages=[{"role": "user", "content": prompt}], stream=True,
                            options={"num_ctx": NUM_CTX, "num_predict": PREDICT, "temperature": 0,
                                     "num_thread": threads}):
        if first is None and part.message.content:
            first = time.perf_counter() - start
        final = part
    return {
        "load_s": final.load_duration / 1e9, "ttft_s": first,
        "pp_tps": final.prompt_eval_count / (final.prompt_eval_duration / 1e9),
        "tg_tps": (final.eval_count - 1) / (final.eval_duration / 1e9) if final.eval_count > 1 else None,
        "prompt_tokens": final.prompt_eval_count, "tokens": final.eval_count,
    }


def unload(client: Any, url: str, model: str) -> None:
    import httpx

    httpx.post(url + "/api/generate", json={"model": model, "keep_alive": 0}, timeout=120)
    deadline = time.monotonic() + 120
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.2)


def measure(name: str, path: Path, threads: int, prompt: str) -> dict[str, Any]:
    import ollama

    size = path.stat().st_size
    with tempfile.TemporaryDirectory(dir=bench.OUT) as root:
        store = Path(root) / "models"
        port = free_port()
        env = {**os.environ, "OLLAMA_HOST": f"127.0.0.1:{port}", "OLLAMA_MODELS": str(store),
               "OLLAMA_KEEP_ALIVE": "10m"}
        serve = subprocess.Popen([sys.executable, "-m", "ollama_engine", "serve"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            client = ollama.Client(host=url, timeout=3600)
            for _ in range(600):
                try:
                    client.list()
                    break
                except Exception:
                    time.sleep(0.1)
            result: dict[str, Any] = {"model": name, "file_bytes": size}
            result["cp_mb_s"] = copy_rate(path, Path(root))
            bench.read_through(path)
            serve_before = status(serve.pid, "VmHWM")
            start = time.perf_counter()
            digest = client.create_blob(path)
            upload = time.perf_counter() - start
            client.create(model=name, files={path.name: digest})
            result["create_s"] = time.perf_counter() - start
            result["upload_mb_s"] = size / upload / 1e6
            result["serve_peak_growth_mib"] = (status(serve.pid, "VmHWM") - serve_before) / 2**20
            blob = store / "blobs" / digest.replace(":", "-")
            result["plan_bytes"] = plan_estimate(blob, threads)
            for temperature in ("cold", "warm"):
                if temperature == "cold":
                    drop_from_page_cache(blob)
                row = chat_once(client, name, prompt, threads)
                runners = children(serve.pid)
                if runners:
                    row["runner_rss_mib"] = status(runners[0], "VmRSS") / 2**20
                    row["runner_peak_mib"] = status(runners[0], "VmHWM") / 2**20
                result[temperature] = row
                bench.log(f"{name} {temperature}: {row}")
                unload(client, url, name)
            return result
        finally:
            serve.terminate()
            serve.wait(30)


def main() -> int:
    global PREDICT
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-3.2-1b-f16,llama-3.1-8b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--prompt-words", type=int, default=PROMPT_WORDS)
    parser.add_argument("--predict", type=int, default=PREDICT)
    args = parser.parse_args()
    PREDICT = args.predict
    words = ["apple", "river", "stone", "cloud", "paper", "window", "garden", "silver"]
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    results = []
    for name in args.models.split(","):
        path = bench.ensure_model(name)
        results.append(measure(name, path, args.threads, prompt))
        bench.log(json.dumps(results[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("| model | file | create s | upload MB/s | cp MB/s | serve RSS growth MiB | ready cold s | ready warm s "
          "| runner RSS MiB | runner peak MiB | plan MiB | pp t/s | tg t/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        warm = r["warm"]
        print(f"| {r['model']} | {r['file_bytes'] / 2**30:.2f} GiB | {r['create_s']:.1f} | {r['upload_mb_s']:.0f} "
              f"| {r['cp_mb_s']:.0f} | {r['serve_peak_growth_mib']:.0f} | {r['cold']['load_s']:.2f} "
              f"| {warm['load_s']:.2f} | {warm.get('runner_rss_mib', 0):.0f} | {warm.get('runner_peak_mib', 0):.0f} "
              f"| {r['plan_bytes'] / 2**20:.0f} | {warm['pp_tps']:.1f} | {warm['tg_tps'] or 0:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
