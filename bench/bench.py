"""Our engine against llama.cpp (llama-cpp-python 0.3.36, the same ggml) on the same GGUF, threads and machine.

Usage:
    .venv/bin/python bench/bench.py [--models smollm2-135m,llama-3.2-1b] [--gguf PATH ...] [--threads 2]
        [--reps 5] [--engines inproc,llamacpp,runner] [--streams 1,4,8] [--json OUT] [--gpu] [--verbose]

Engines: `inproc` is our model driven in-process (ollama_engine.generate.prefill), `runner` is our runner
process over HTTP (/load fit -> alloc -> commit, then /completion, as Ollama's parent drives it), `llamacpp`
is llama.cpp through llama-cpp-python's low-level ctypes API (no `Llama` class). Every measurement runs in
a fresh process (this script with a hidden --worker flag, see workers.py), and reps alternate the engines.

Measured: pp512 (one 512-token batch from an empty cache, logits of the last token only), tg128 (128
single-token decodes from an empty cache, each reading its logits and taking the argmax), time to ready
(process start to ready to compute; runner: spawn to /health ready), peak RSS (VmHWM of the process
holding the model), and aggregate generation speed with 1, 4 and 8 concurrent streams on 4 slots of 1024
tokens (32-token prompts, 128 tokens each). Settings on both sides: n_ctx 4096, batch 512, f16 KV cache,
flash attention off, the same thread count for prompt and generation.

Models are synthetic GGUFs (random weights, real tokenizers) written to bench/out/ on first use. --gpu
adds an 8B-shaped Q4_K model with every layer offloaded on both sides (needs CUDA builds of both).
Progress goes to stderr; the tables go to stdout (markdown); --json keeps every measurement.

Details that matter when reading the numbers:
- Prompts are made of single-token words, so the runner (which takes text) evaluates the same ids as the
  engines fed with ids. The runner always reuses the prefix a slot shares with a new prompt; its pp prompt
  shares only BOS (if the vocabulary adds one) with the warm-up before it, so it sends BOS + 512 words and
  512 tokens are evaluated. Its rates come from the runner's own prompt_eval_duration and eval_duration;
  tg uses a one-word prompt and 129 tokens, since eval_duration starts after the first token (and leaves
  out sampling). Generation stops early at an end-of-generation token: the table notes it if it happens.
- The machine may be shared. Each measurement waits for a quiet CPU and records how many cores other
  processes used meanwhile; a disturbed one is repeated (up to 3 attempts), and disturbed results are left
  out of the medians when undisturbed ones exist. Spinning thread pools (ggml's and llama.cpp's OpenMP)
  slow down by 10-100x when another process takes a core, so this matters.
- The model file is read once before the reps, so times to ready start from a warm page cache.
- The engine's bytecode is written first (compileall), as installing a package does: where
  PYTHONDONTWRITEBYTECODE is set (this sandbox sets it) nothing else writes it, and every runner start
  compiled its ~110 modules from source (0.1 s of its time to ready); llama-cpp-python's is installed.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Collection
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the synthetic models

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
SEED = 0
ENGINES = ("inproc", "llamacpp", "runner")
CONCURRENT_ENGINES = ("runner", "llamacpp")
N_PP, N_TG = 512, 128
N_STREAM_PROMPT, N_STREAM = 32, 128
N_WARMUP = 16
WORKER_TIMEOUT = 3600
# The machine may be shared: a measurement during which other processes kept more than this many cores busy
# is repeated (after waiting for a quiet machine), up to ATTEMPTS times.
QUIET_CORES = 0.15
ATTEMPTS = 3

# name -> (synthetic preset, weight type, ModelSpec overrides)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "smollm2-135m": ("smollm2-135m", "Q8_0", {}),
    "llama-3.2-1b": ("llama-3.2-1b", "Q4_0", {"tied_embeddings": True}),
    "llama-3.1-8b": (
        "llama-3.2-1b", "Q4_K",
        {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "n_ff": 14336, "tied_embeddings": False,
         "name": "llama-3.1-8b"},
    ),
    # Llama 3.2 1B's shape in F16 with its own output matrix: 2.8 GiB, past the old 1 GiB upload limit
    "llama-3.2-1b-f16": ("llama-3.2-1b", "F16", {"tied_embeddings": False, "name": "llama-3.2-1b-f16"}),
    # Qwen3-30B-A3B's shape scaled to ~1.0B parameters (~0.34B active, half of that the embeddings):
    # 32 experts of width 512 per layer, 4 used per token
    "qwen3moe-1b": (
        "qwen3moe", "Q4_0",
        {"n_layer": 16, "n_embd": 1024, "n_head": 16, "n_head_kv": 4, "head_dim": 128, "n_ff": 2048,
         "n_expert": 32, "n_expert_used": 4, "n_ff_exp": 512, "context_length": 40960, "name": "qwen3moe-1b"},
    ),
    # LFM2-350M's shape (a hybrid: 10 short-convolution layers, 6 attention layers), GPT-2's vocabulary
    "lfm2-350m": (
        "lfm2", "Q8_0",
        {"n_layer": 16, "n_embd": 1024, "n_head": 16, "n_head_kv": 8, "n_ff": 4608, "context_length": 32768,
         "attention_layers": (2, 5, 8, 10, 12, 14), "name": "lfm2-350m"},
    ),
    # a dense model of lfm2-350m's size and vocabulary (Llama's layers): the hybrid's reference (prefix_hit.py)
    "llama-350m": (
        "llama-3.2-1b", "Q8_0",
        {"n_layer": 16, "n_embd": 1024, "n_head": 16, "n_head_kv": 8, "n_ff": 4608, "head_dim": 64,
         "context_length": 32768, "tied_embeddings": True, "vocab": "gpt-2", "name": "llama-350m"},
    ),
}
GPU_MODEL = "llama-3.1-8b"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- models and prompts


def random_q4_k_blocks() -> contextlib.AbstractContextManager[None]:
    """While active, synthetic Q4_K matrices are random blocks (4-bit values and 6-bit scales drawn uniformly,
    small block scales) instead of quantized Gaussian weights: the 8B-shaped file takes seconds, not the hour
    quantizing 8 billion weights takes on 2 cores; the kernels' work is the same."""
    from unittest import mock

    import gguf
    from synthetic import models as synthetic

    original = synthetic._values
    # d and dmin: a weight is d * scale * q - dmin * min, zero on average with dmin = 7.5 d (q averages 7.5)
    d = np.array([1 / 4096, 7.5 / 4096], dtype=np.float16).view(np.uint8)

    def values(t: Any, spec: Any, seed: int) -> np.ndarray:
        if t.qtype != gguf.GGMLQuantizationType.Q4_K or t.kind == "norm":
            return original(t, spec, seed)
        rows = int(np.prod(t.shape[1:]))
        rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
        blocks = rng.integers(0, 256, size=(rows * t.shape[0] // 256, 144), dtype=np.uint8)
        blocks[:, :4] = d
        return blocks.reshape(rows, -1)

    return mock.patch.object(synthetic, "_values", values)


def ensure_model(name: str) -> Path:
    """The synthetic model's file in bench/out/, written on first use."""
    from synthetic.models import write_synthetic

    from ollama_engine.fs import GGUFFile

    preset, weight_type, overrides = MODELS[name]
    path = OUT / f"{name}-{weight_type}.gguf"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        log(f"writing synthetic {name} ({weight_type}) to {path}")
        fast = random_q4_k_blocks() if name == "llama-3.1-8b" else contextlib.nullcontext()
        with fast:
            write_synthetic(path, preset, weight_type=weight_type, seed=SEED, **overrides)
    if overrides.get("tied_embeddings") and "output.weight" in GGUFFile.open(path).tensors:
        raise RuntimeError(f"{path} should have tied embeddings but has output.weight")
    return path


def compile_engine() -> None:
    """Write the bytecode of the engine's packages (see the module docstring)."""
    for folder in ("ollama_engine", "models", "kvcache", "server"):
        compileall.compile_dir(ROOT / folder, quiet=1)


def read_through(path: Path) -> None:
    """Read the file once, so that every engine's time to ready starts from a warm page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def word_pool(tokenizer: Any, rng: np.random.Generator, size: int = 4000) -> list[int]:
    """Ids of tokens that are a space and a lowercase word and encode back to themselves.

    Text made of such words tokenizes to exactly those ids, so the runner (which takes text) evaluates the
    same ids as the engines fed with ids.
    """
    pool = []
    for token in rng.permutation(tokenizer.vocab_size):
        piece = tokenizer.vocab.piece(int(token), special=False)
        if re.fullmatch(rb" [a-z]{2,12}", piece) and tokenizer.encode(piece.decode(), add_special=False) == [token]:
            pool.append(int(token))
            if len(pool) == size:
                break
    if len(pool) < 100:
        raise RuntimeError(f"only {len(pool)} single-token words in this vocabulary")
    return pool


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build_prompts(path: Path, max_streams: int) -> dict[str, Any]:
    """Token ids for the id-fed engines and the matching texts for the runner, from a fixed seed."""
    from ollama_engine.fs import GGUFFile
    from ollama_engine.tokenizer import from_metadata

    tok = from_metadata(GGUFFile.open(path).metadata)
    rng = np.random.default_rng(SEED)
    pool = word_pool(tok, rng)
    bos = [tok.bos_id] if tok.add_bos else []

    def words(n: int, avoid: Collection[int] = ()) -> list[int]:
        first = int(rng.choice([w for w in pool if w not in avoid]))
        return [first] + [int(w) for w in rng.choice(pool, n - 1)]

    def text(ids: list[int]) -> tuple[str, list[int]]:
        """The runner's text for these word ids, and what the runner's tokenizer makes of it."""
        body = ids[len(bos):] if ids[:len(bos)] == bos else ids
        s = tok.decode(body)
        encoded = tok.encode(s, add_special=True)
        if encoded != bos + body:
            log(f"warning: a prompt of {len(bos) + len(body)} ids re-tokenizes to {len(encoded)}")
        return s, encoded

    pp = words(N_PP)
    warmup = bos + words(N_WARMUP, avoid={pp[0]})
    tg_first = words(1, avoid={pp[0], warmup[len(bos)]})[0]
    streams = [bos + words(N_STREAM_PROMPT - len(bos)) for _ in range(max_streams)]
    runner_warmup, warm_encoded = text(warmup)
    runner_pp, pp_encoded = text(pp)
    return {
        "pp": pp, "warmup": warmup, "tg_first": tg_first, "n_tg": N_TG, "streams": streams, "n_stream": N_STREAM,
        "runner_warmup": runner_warmup, "runner_pp": runner_pp, "runner_pp_count": len(pp_encoded),
        # the runner reuses the prefix its slot shares with the warm-up (BOS, if the vocabulary adds one)
        "runner_pp_evaluated": len(pp_encoded) - common_prefix(warm_encoded, pp_encoded),
        "runner_tg": text([tg_first])[0], "runner_streams": [text(ids)[0] for ids in streams],
        "add_bos": tok.add_bos, "eog_ids": sorted(tok.eos_ids),
    }


# ---------------------------------------------------------------- workers


def run_worker(engine: str, task: str, model: Path, prompts: Path, args: argparse.Namespace, gpu: bool) -> dict:
    """Run one measurement in a fresh process; its JSON, or {"error": ...}."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", engine, "--task", task, "--model-path",
        str(model), "--prompts", str(prompts), "--threads", str(args.threads), "--streams", args.streams,
        "--t0", repr(time.time()),
    ] + (["--gpu"] if gpu else []) + (["--verbose"] if args.verbose else []) + (["--mmap"] if args.mmap else [])
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if args.verbose else
                               subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the worker's session: it and its runner, nothing else
        process.communicate()
        return {"error": f"timed out after {WORKER_TIMEOUT} s"}
    if stderr:
        # progress lines pass through; everything else only on failure
        for line in stderr.splitlines():
            if line.startswith("  [") or process.returncode:
                print(line, file=sys.stderr, flush=True)
    if process.returncode:
        return {"error": f"exit code {process.returncode}: {(stderr or '').strip().splitlines()[-1:]}"}
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"no JSON from the worker: {stdout[-500:]!r}"}


def wait_quiet(max_wait: float) -> None:
    """Wait until other processes leave the CPU alone (or max_wait seconds have passed)."""
    from workers import system_busy_seconds

    deadline = time.monotonic() + max_wait
    logged = False
    while True:
        before = system_busy_seconds()
        time.sleep(1.5)
        busy = (system_busy_seconds() - before) / 1.5
        if busy < QUIET_CORES:
            return
        if time.monotonic() > deadline:
            log(f"  the machine is still busy ({busy:.2f} cores used by others): measuring anyway")
            return
        if not logged:
            log(f"  waiting for a quiet machine: other processes keep {busy:.2f} cores busy")
            logged = True


def foreign_cores(result: dict) -> float:
    """The most cores other processes used during any measured interval of a worker."""
    if "streams" in result:
        return max((v.get("foreign_cores", 0.0) for v in result["streams"].values()), default=0.0)
    return max(result.get("foreign_cores", {}).values(), default=0.0)


def measure(engine: str, task: str, model: Path, prompts: Path, args: argparse.Namespace, gpu: bool) -> dict:
    """run_worker on a quiet machine, repeated while other processes disturbed it; the least disturbed result."""
    best: dict | None = None
    for attempt in range(ATTEMPTS):
        wait_quiet(args.max_wait)
        result = run_worker(engine, task, model, prompts, args, gpu)
        if "error" in result:
            return result
        if best is None or foreign_cores(result) < foreign_cores(best):
            best = result
        if foreign_cores(result) < QUIET_CORES:
            break
        log(f"  other processes used {foreign_cores(result):.2f} cores during the measurement"
            + ("; measuring again" if attempt + 1 < ATTEMPTS else ""))
    assert best is not None
    best["attempts"] = attempt + 1
    best["contended"] = foreign_cores(best) >= QUIET_CORES
    return best


def rotate(items: list[str], k: int) -> list[str]:
    k %= max(len(items), 1)
    return items[k:] + items[:k]


def bench_model(name: str, path: Path, args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    streams = [int(s) for s in args.streams.split(",") if s]
    read_through(path)
    prompts = build_prompts(path, max(streams, default=1))
    prompts_path = OUT / f"{path.stem}.prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    engines = [e for e in ENGINES if e in args.engines]
    concurrent = [e for e in CONCURRENT_ENGINES if e in args.engines] if streams else []
    single: dict[str, list[dict]] = {e: [] for e in engines}
    conc: dict[str, list[dict]] = {e: [] for e in concurrent}
    for rep in range(args.reps):
        for engine in rotate(engines, rep):
            log(f"{name}: rep {rep + 1}/{args.reps} {engine} pp{N_PP}/tg{N_TG}")
            result = measure(engine, "single", path, prompts_path, args, gpu)
            single[engine].append(result)
            if "error" in result:
                log(f"  {engine} failed: {result['error']}")
            else:
                log(f"  pp {result['pp_tps']:.1f} t/s, tg {result['tg_tps']:.2f} t/s, ready "
                    f"{result['ready_s']:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB")
        for engine in rotate(concurrent, rep):
            log(f"{name}: rep {rep + 1}/{args.reps} {engine} concurrency {streams}")
            result = measure(engine, "concurrency", path, prompts_path, args, gpu)
            conc[engine].append(result)
            if "error" in result:
                log(f"  {engine} failed: {result['error']}")
    return {"model": name, "path": str(path), "gpu": gpu, "single": single, "concurrency": conc,
            "add_bos": prompts["add_bos"], "runner_pp_evaluated": prompts["runner_pp_evaluated"]}


# ---------------------------------------------------------------- report


def usable(results: list[dict]) -> list[dict]:
    """The successful results; only the undisturbed ones if there are any."""
    ok = [r for r in results if "error" not in r]
    quiet = [r for r in ok if not r.get("contended")]
    return quiet or ok


def median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in usable(results) if r.get(key) is not None]
    return statistics.median(values) if values else None


def conc_median(results: list[dict], streams: int) -> float | None:
    values = [r["streams"][str(streams)]["aggregate_tps"] for r in usable(results)]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "error" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return "—" if ours is None or not theirs else f"{ours / theirs:.2f}"


def summarize(run: dict[str, Any], streams: list[int]) -> dict[str, Any]:
    keys = ("pp_tps", "tg_tps", "ready_s", "peak_rss_mib", "tg_python_share", "tg_python_us_per_step")
    single = {engine: {key: median(results, key) for key in keys}
              for engine, results in run["single"].items()}
    conc = {engine: {str(s): conc_median(results, s) for s in streams}
            for engine, results in run["concurrency"].items()}
    return {"single": single, "concurrency": conc}


def tables(runs: list[dict[str, Any]], streams: list[int]) -> str:
    lines = [
        f"| model | engine | pp{N_PP} t/s | pp ratio | tg{N_TG} t/s | tg ratio | time to ready s | peak RSS MiB "
        "| Python per decode step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for run in runs:
        label = run["model"] + (" (GPU)" if run["gpu"] else "")
        medians = run["summary"]["single"]
        base = medians.get("llamacpp", {})
        for engine, m in medians.items():
            pp_ratio = "1.00" if engine == "llamacpp" else ratio(m["pp_tps"], base.get("pp_tps"))
            tg_ratio = "1.00" if engine == "llamacpp" else ratio(m["tg_tps"], base.get("tg_tps"))
            share = m.get("tg_python_share")
            python = "—" if share is None else f"{100 * share:.1f}% ({m['tg_python_us_per_step']:.0f} µs)"
            lines.append(f"| {label} | {engine} | {fmt(m['pp_tps'])} | {pp_ratio} | {fmt(m['tg_tps'], 2)} | "
                         f"{tg_ratio} | {fmt(m['ready_s'], 2)} | {fmt(m['peak_rss_mib'], 0)} | {python} |")
        for engine, results in run["single"].items():
            failed = [r["error"] for r in results if "error" in r]
            if failed:
                notes.append(f"{label} {engine}: {len(failed)} failed run(s): {failed[0]}")
        for engine, results in run["single"].items():
            for r in results:
                if r.get("contended"):
                    kept = "kept in the medians" if r in usable(results) else "left out of the medians"
                    notes.append(f"{label} {engine}: other processes used {foreign_cores(r):.2f} cores during a "
                                 f"measurement even after {r['attempts']} attempts ({kept})")
        for r in run["single"].get("runner", []):
            if "error" not in r and r["tg_tokens"] < N_TG:
                notes.append(f"{label} runner: tg stopped at an end-of-generation token after {r['tg_tokens']} "
                             f"decodes (rate over those)")
    out = "\n".join(lines)
    if any(run["summary"]["concurrency"] for run in runs):
        lines = [
            "| model | streams (4 slots) | runner aggregate t/s | llama.cpp aggregate t/s | ratio |",
            "|---|---:|---:|---:|---:|",
        ]
        for run in runs:
            label = run["model"] + (" (GPU)" if run["gpu"] else "")
            conc = run["summary"]["concurrency"]
            for s in streams:
                ours, theirs = conc.get("runner", {}).get(str(s)), conc.get("llamacpp", {}).get(str(s))
                cells = [fmt(v) if engine in conc else "—" for engine, v in (("runner", ours), ("llamacpp", theirs))]
                lines.append(f"| {label} | {s} | {cells[0]} | {cells[1]} | {ratio(ours, theirs)} |")
            for r in run["concurrency"].get("runner", []):
                for s, v in r.get("streams", {}).items():
                    short = [c for c in v["eval_counts"] if c < N_STREAM]
                    if short:
                        notes.append(f"{label} runner, {s} streams: {len(short)} stream(s) stopped at an "
                                     f"end-of-generation token ({short} tokens)")
            for engine, results in run["concurrency"].items():
                for r in results:
                    if r.get("contended"):
                        kept = "kept in the medians" if r in usable(results) else "left out of the medians"
                        notes.append(f"{label} {engine} concurrency: other processes used {foreign_cores(r):.2f} "
                                     f"cores during a measurement even after {r['attempts']} attempts ({kept})")
                failed = [r["error"] for r in results if "error" in r]
                if failed:
                    notes.append(f"{label} {engine} concurrency: {len(failed)} failed run(s): {failed[0]}")
        out += "\n\n" + "\n".join(lines)
    if notes:
        out += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes))
    return out


def spread(runs: list[dict[str, Any]]) -> str | None:
    """The largest max/min ratio of one engine's pp or tg across reps: how far a single ratio can be trusted."""
    worst = {}
    for run in runs:
        for results in run["single"].values():
            for key in ("pp_tps", "tg_tps"):
                values = [r[key] for r in usable(results)]
                if len(values) > 1:
                    worst[key] = max(worst.get(key, 0.0), max(values) / min(values) - 1)
    if not worst:
        return None
    return ("rep-to-rep spread (largest max/min of one engine): "
            + ", ".join(f"{k[:2]} {v:.0%}" for k, v in worst.items()))


def render(data: dict[str, Any]) -> str:
    """The report: machine, command and tables."""
    info, runs = data["machine"], data["runs"]
    head = (f"Machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), {info['threads']} "
            f"threads; commit {info['git_commit']}; ggml {info['ggml']}, llama-cpp-python "
            f"{info['llama_cpp_python']}, Python {info['python']}\n"
            f"Command: `{data['command']}` ({data['reps']} reps, medians; the run took {data['wall_s'] / 60:.1f} min)")
    streams = data.get("streams") or sorted({int(s) for run in runs for results in run["concurrency"].values()
                                             for r in results for s in r.get("streams", {})})
    note = spread(runs)
    return f"{head}\n\n{tables(runs, streams)}" + (f"\n\n{note}" if note else "")


def machine(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "?"

    from ollama_engine import ggml

    dirty = "+uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "threads": threads,
        "git_commit": git("rev-parse", "--short", "HEAD") + (f" ({dirty})" if dirty else ""),
        "ggml": ggml.version(), "llama_cpp_python": metadata.version("llama_cpp_python"),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b",
                        help=f"synthetic models, comma-separated, from {[m for m in MODELS if m != GPU_MODEL]}")
    parser.add_argument("--gguf", nargs="+", default=[], help="more GGUF files to benchmark")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--streams", default="1,4,8", help="concurrent streams to measure; empty: none")
    parser.add_argument("--json", help="write every measurement and the medians here")
    parser.add_argument("--gpu", action="store_true", help=f"also {GPU_MODEL} (Q4_K) with every layer on the GPU")
    parser.add_argument("--max-wait", type=float, default=600,
                        help="seconds to wait for other processes to leave the CPU before each measurement")
    parser.add_argument("--verbose", action="store_true", help="the engines' own logs on stderr")
    parser.add_argument("--mmap", action="store_true",
                        help="the runner maps the model file (UseMmap), as llama.cpp does by default; else it reads it")
    parser.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's --json file and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        import workers

        return workers.run_worker(workers.WorkerArgs(
            engine=args.worker, task=args.task, model=args.model_path,
            prompts=json.loads(Path(args.prompts).read_text()), threads=args.threads, t0=args.t0, gpu=args.gpu,
            streams=[int(s) for s in args.streams.split(",") if s], verbose=args.verbose, mmap=args.mmap,
        ))

    if args.report:
        print(render(json.loads(Path(args.report).read_text())))
        return 0
    started = time.perf_counter()
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}: choose from {ENGINES}")
    names = [m for m in args.models.split(",") if m]
    for name in names:
        if name not in MODELS or name == GPU_MODEL:
            parser.error(f"unknown model {name!r}: choose from {[m for m in MODELS if m != GPU_MODEL]}")
    targets = [(name, ensure_model(name), False) for name in names]
    targets += [(Path(p).stem, Path(p).resolve(), False) for p in args.gguf]
    if args.gpu:
        targets.append((GPU_MODEL, ensure_model(GPU_MODEL), True))
    streams = [int(s) for s in args.streams.split(",") if s]
    compile_engine()
    info = machine(args.threads)
    command = shlex.join([os.path.relpath(sys.executable, ROOT), os.path.relpath(__file__, ROOT), *sys.argv[1:]])

    runs = []
    for name, path, gpu in targets:
        run = bench_model(name, path, args, gpu)
        run["summary"] = summarize(run, streams)
        runs.append(run)

    data = {"machine": info, "command": command, "wall_s": time.perf_counter() - started, "reps": args.reps,
            "streams": streams, "runs": runs}
    print(render(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
        log(f"wrote {args.json}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
