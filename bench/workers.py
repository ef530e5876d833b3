"""One measurement in a fresh process: our engine in-process, llama.cpp (low-level API) or our runner over HTTP.

bench.py starts `python bench/bench.py --worker ENGINE --task TASK ...`; the worker loads the model, warms
up, measures, and prints one JSON object on stdout. A process of its own per measurement means that the
time to ready (interpreter start to ready, imports included) and the peak RSS belong to that engine alone.

Tasks: "single" measures pp512 and tg128 on one sequence; "concurrency" measures aggregate generation
speed with 1..n streams sharing 4 slots (runner and llama.cpp only).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

N_CTX = 4096  # context of the single-sequence measurements
BATCH = 512
SLOTS = 4  # concurrency: sequences sharing the model
SLOT_CTX = 1024  # concurrency: context per slot
GPU_ALL_LAYERS = 999


@dataclass
class WorkerArgs:
    engine: str
    task: str
    model: str
    prompts: dict[str, Any]  # from bench.py: the token ids (and runner texts) every engine uses
    threads: int
    t0: float  # time.time() just before the parent spawned this process
    gpu: bool
    streams: list[int]
    verbose: bool
    mmap: bool = False  # the runner maps the file as llama.cpp does by default (UseMmap); else it reads it


def peak_rss_mib(pid: int | str = "self") -> float:
    """VmHWM of a process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def process_cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class Contention:
    """How many cores other processes kept busy while a measurement ran (the machine may be shared).

    `pids` are the processes doing the measured work; the rest of the machine's busy time is foreign.
    """

    def __init__(self, *pids: int | str):
        self.pids = pids or ("self",)

    def __enter__(self) -> Contention:
        self.start = time.perf_counter()
        self.busy = system_busy_seconds()
        self.own = sum(process_cpu_seconds(p) for p in self.pids)
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.start
        own = sum(process_cpu_seconds(p) for p in self.pids) - self.own
        self.foreign_cores = max(0.0, system_busy_seconds() - self.busy - own) / max(wall, 1e-9)


def progress(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any], foreign: list[float]) -> float:
    """Seconds fn takes; appends the cores other processes used meanwhile to `foreign`."""
    with Contention() as contention:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    foreign.append(contention.foreign_cores)
    return seconds


# ---------------------------------------------------------------- our engine, in-process


def inproc_single(a: WorkerArgs) -> dict[str, Any]:
    from ollama_engine.generate import prefill
    from ollama_engine.ml import DType, GPULayers, gpu_devices
    from ollama_engine.models import load_model

    gpu_layers = []
    if a.gpu:
        gpus = gpu_devices()
        if not gpus:
            raise RuntimeError("--gpu: our ggml build sees no GPU")
        from ollama_engine.fs import GGUFFile

        n_layers = GGUFFile.open(a.model).config.get_uint("block_count") + 1
        gpu_layers = [GPULayers(device_id=gpus[0].device_id, layers=list(range(n_layers)))]
    model = load_model(a.model, gpu_layers, num_threads=a.threads)
    model.backend.load()
    model.cache.init(model.backend, DType.F16, 1, N_CTX, BATCH)
    ready = time.time() - a.t0
    p = a.prompts

    def generate(first: int, n: int) -> None:
        token = first
        for position in range(n):
            token = int(np.argmax(prefill(model, [token], position, copy=False)))

    prefill(model, p["warmup"], 0, BATCH)  # warm-up: a short prompt and a few decode steps
    generate(p["warmup"][0], 4)
    model.cache.remove(0, 0)

    foreign: list[float] = []
    pp = timed(lambda: prefill(model, p["pp"], 0, BATCH), foreign)
    model.cache.remove(0, 0)
    in_ggml = model.backend.compute_seconds
    tg = timed(lambda: generate(p["tg_first"], p["n_tg"]), foreign)
    # Python's share of a decode step: everything but ggml's graph compute (Backend.compute_seconds
    # times each ggml_backend_sched_graph_compute call), argmax included
    python_share = 1 - (model.backend.compute_seconds - in_ggml) / tg
    model.cache.remove(0, 0)
    result = {
        "ready_s": ready, "pp_tps": len(p["pp"]) / pp, "tg_tps": p["n_tg"] / tg,
        "tg_python_share": python_share, "tg_python_us_per_step": python_share * tg / p["n_tg"] * 1e6,
        "pp_tokens": len(p["pp"]), "tg_tokens": p["n_tg"], "peak_rss_mib": peak_rss_mib(),
        "foreign_cores": {"pp": foreign[0], "tg": foreign[1]},
        "settings": {"num_threads": a.threads, "kv": "f16", "capacity": N_CTX, "batch": BATCH,
                     "flash_attention": False, "gpu_layers": len(gpu_layers[0].layers) if gpu_layers else 0},
    }
    model.close()
    return result


# ---------------------------------------------------------------- llama.cpp, low-level API


class LlamaCpp:
    """A llama.cpp model and context through llama-cpp-python's ctypes bindings, with no Python layer above."""

    def __init__(self, a: WorkerArgs, n_ctx: int, n_seq_max: int, eval_callback=None):
        """eval_callback: a llama_cpp.ggml_backend_sched_eval_callback for the context (profile_ops.py)."""
        import llama_cpp as api

        self.api = api
        if not a.verbose:
            self._quiet = api.llama_log_callback(lambda level, text, user_data: None)  # keep a reference
            api.llama_log_set(self._quiet, ctypes.c_void_p(0))
        api.llama_backend_init()
        if a.gpu and not api.llama_supports_gpu_offload():
            raise RuntimeError("--gpu: this llama-cpp-python build cannot offload to a GPU")
        mparams = api.llama_model_default_params()
        cparams = api.llama_context_default_params()
        model_defaults = _fields(mparams)
        context_defaults = _fields(cparams)
        mparams.n_gpu_layers = -1 if a.gpu else 0  # default -1 (all); 0 keeps a CPU run on the CPU
        cparams.n_ctx = n_ctx
        cparams.n_batch = BATCH
        cparams.n_ubatch = BATCH
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = a.threads
        cparams.n_threads_batch = a.threads
        cparams.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = cparams.type_v = 1  # GGML_TYPE_F16
        cparams.swa_full = False  # llama-server's default, and our sliding-window cache
        if eval_callback is not None:
            self._eval_callback = eval_callback  # keep a reference
            cparams.cb_eval = eval_callback
        self.non_default = {
            "model": {k: v for k, v in _fields(mparams).items() if model_defaults[k] != v},
            "context": {k: v for k, v in _fields(cparams).items() if context_defaults[k] != v},
        }
        self.model = api.llama_model_load_from_file(a.model.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {a.model}")
        self.ctx = api.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = api.llama_get_memory(self.ctx)
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.batch = api.llama_batch_init(BATCH, 0, n_seq_max)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        rc = self.api.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, index: int) -> int:
        """The greedy token from the logits of batch entry `index` (-1: the last one with logits)."""
        pointer = self.api.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))))

    def prompt(self, tokens: list[int], seq: int = 0) -> int:
        """Evaluate a prompt from position 0 (one batch), logits for the last token only; the next token."""
        last = len(tokens) - 1
        self.decode([(t, i, seq, i == last) for i, t in enumerate(tokens)])
        return self.argmax(-1)

    def generate(self, first: int, n: int, seq: int = 0) -> None:
        token = first
        for position in range(n):
            self.decode([(token, position, seq, True)])
            token = self.argmax(-1)

    def clear(self) -> None:
        self.api.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)
        self.api.llama_model_free(self.model)


def _fields(params: ctypes.Structure) -> dict[str, Any]:
    """A params struct's plain fields (pointers and callbacks left out)."""
    simple = (ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_bool, ctypes.c_size_t)
    return {name: getattr(params, name) for name, kind in params._fields_ if kind in simple}


def llamacpp_single(a: WorkerArgs) -> dict[str, Any]:
    llm = LlamaCpp(a, N_CTX, 1)
    ready = time.time() - a.t0
    p = a.prompts
    llm.prompt(p["warmup"])
    llm.clear()
    llm.generate(p["warmup"][0], 4)
    llm.clear()
    foreign: list[float] = []
    pp = timed(lambda: llm.prompt(p["pp"]), foreign)
    llm.clear()
    tg = timed(lambda: llm.generate(p["tg_first"], p["n_tg"]), foreign)
    llm.clear()
    result = {
        "ready_s": ready, "pp_tps": len(p["pp"]) / pp, "tg_tps": p["n_tg"] / tg,
        "pp_tokens": len(p["pp"]), "tg_tokens": p["n_tg"], "peak_rss_mib": peak_rss_mib(),
        "foreign_cores": {"pp": foreign[0], "tg": foreign[1]},
        "settings": llm.non_default, "system_info": llm.api.llama_print_system_info().decode().strip(),
    }
    llm.close()
    return result


def serve_streams(llm: LlamaCpp, prompts: list[list[int]], n_predict: int) -> list[int]:
    """Generate n_predict tokens for every prompt on SLOTS sequences, as a server's batch loop would.

    Each step is one llama_decode holding every active sequence: a new one's whole prompt (logits for its
    last token), or the token an ongoing one sampled last. A queued prompt takes the first slot that frees.
    Returns the number of tokens each stream produced.
    """
    queue = list(prompts)
    active: dict[int, dict[str, Any]] = {}  # slot -> {"prompt": ids to evaluate or None, "pos", "token", "n"}
    counts = []
    while queue or active:
        for slot in range(SLOTS):
            if slot not in active and queue:
                llm.api.llama_memory_seq_rm(llm.memory, slot, -1, -1)
                active[slot] = {"prompt": queue.pop(0), "pos": 0, "token": None, "n": 0}
        entries, rows = [], {}
        for slot, s in active.items():
            tokens = s["prompt"] or [s["token"]]
            entries += [(t, s["pos"] + k, slot, k == len(tokens) - 1) for k, t in enumerate(tokens)]
            rows[slot] = len(entries) - 1
            s["pos"] += len(tokens)
            s["prompt"] = None
        llm.decode(entries)
        for slot, row in rows.items():
            s = active[slot]
            s["token"] = llm.argmax(row)
            s["n"] += 1
            if s["n"] == n_predict:
                counts.append(s["n"])
                del active[slot]
    return counts


def llamacpp_concurrency(a: WorkerArgs) -> dict[str, Any]:
    llm = LlamaCpp(a, SLOTS * SLOT_CTX, SLOTS)
    p = a.prompts
    llm.prompt(p["warmup"])
    llm.clear()
    llm.generate(p["warmup"][0], 4)
    llm.clear()
    runs = {}
    for streams in a.streams:
        with Contention() as contention:
            start = time.perf_counter()
            counts = serve_streams(llm, p["streams"][:streams], p["n_stream"])
            wall = time.perf_counter() - start
        llm.clear()
        runs[str(streams)] = {"aggregate_tps": sum(counts) / wall, "wall_s": wall, "eval_counts": counts,
                              "foreign_cores": contention.foreign_cores}
        progress(f"llamacpp {streams} streams: {sum(counts) / wall:.1f} t/s")
    result = {"streams": runs, "peak_rss_mib": peak_rss_mib(), "settings": llm.non_default}
    llm.close()
    return result


# ---------------------------------------------------------------- our runner, over HTTP


def start_runner(a: WorkerArgs, num_ctx: int, parallel: int):
    """Spawn a runner, load the model with fit -> alloc -> commit as Ollama's parent does, wait until ready.

    Returns (handle, seconds from spawn to ready, the /load options).
    """
    from ollama_engine.fs import GGUFFile
    from ollama_engine.llm.discovery import discover_gpus, system_info
    from ollama_engine.llm.load import LoadOptions, load
    from ollama_engine.llm.runner_handle import RunnerHandle
    from ollama_engine.server.wire import ServerStatus

    total_layers = GGUFFile.open(a.model).config.get_uint("block_count") + 1
    options = LoadOptions(
        num_ctx=num_ctx, parallel=parallel, batch_size=BATCH, num_gpu=-1 if a.gpu else 0,
        num_threads=a.threads, flash_attention=0, kv_cache_type="f16", use_mmap=a.mmap,
    )
    start = time.perf_counter()
    handle = RunnerHandle.start(a.model)
    try:
        handle.wait_launched()
        gpus = discover_gpus(handle) if a.gpu else []
        if a.gpu and not gpus:
            raise RuntimeError("--gpu: the runner sees no GPU")
        result = load(handle, system_info(), gpus, total_layers, options)
        if a.gpu and result.gpu_layers.sum() < total_layers:
            raise RuntimeError(f"--gpu: only {result.gpu_layers.sum()}/{total_layers} layers were offloaded")
        while handle.health(timeout=5)[0] != ServerStatus.READY:
            if handle.exited():
                raise RuntimeError(f"runner exited: {handle.exit_reason()}")
            time.sleep(0.01)
    except BaseException:
        handle.close()
        raise
    return handle, time.perf_counter() - start, options


def complete(handle, prompt: str, num_predict: int) -> dict[str, Any]:
    """One streamed /completion, greedy; its final line."""
    final: dict[str, Any] = {}
    for chunk in handle.completion(prompt, {"num_predict": num_predict, "temperature": 0, "seed": 0}):
        final = chunk
    if not final.get("done"):
        raise RuntimeError(f"/completion ended without a final line: {final}")
    return final


def runner_single(a: WorkerArgs) -> dict[str, Any]:
    handle, ready, options = start_runner(a, N_CTX, 1)
    p = a.prompts
    try:
        complete(handle, p["runner_warmup"], 4)
        pids = ("self", handle.process.pid)
        # pp: the slot still holds the warm-up, which shares only BOS with this prompt: p["runner_pp_evaluated"]
        # tokens are evaluated, as many as the other engines evaluate.
        with Contention(*pids) as pp_contention:
            pp = complete(handle, p["runner_pp"], 1)
        if pp["prompt_eval_count"] != p["runner_pp_count"]:
            raise RuntimeError(f"runner counted {pp['prompt_eval_count']} prompt tokens, "
                               f"expected {p['runner_pp_count']}")
        # tg: a short prompt, then n_tg + 1 tokens: eval_duration covers the n_tg decodes after the first token.
        with Contention(*pids) as tg_contention:
            tg = complete(handle, p["runner_tg"], p["n_tg"] + 1)
        rss = peak_rss_mib(handle.process.pid)
    finally:
        handle.close()
    return {
        "ready_s": ready,
        "pp_tps": p["runner_pp_evaluated"] / (pp["prompt_eval_duration"] / 1e9),
        "tg_tps": (tg["eval_count"] - 1) / (tg["eval_duration"] / 1e9),
        "pp_tokens": p["runner_pp_evaluated"], "tg_tokens": tg["eval_count"] - 1,
        "tg_done_reason": tg["done_reason"], "peak_rss_mib": rss, "settings": options.__dict__,
        "foreign_cores": {"pp": pp_contention.foreign_cores, "tg": tg_contention.foreign_cores},
        "raw": {"pp": pp, "tg": tg},
    }


def runner_concurrency(a: WorkerArgs) -> dict[str, Any]:
    handle, _, options = start_runner(a, SLOT_CTX, SLOTS)
    p = a.prompts
    runs = {}
    try:
        complete(handle, p["runner_warmup"], 4)
        for streams in a.streams:
            texts = p["runner_streams"][:streams]
            with Contention("self", handle.process.pid) as contention:
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(max_workers=streams) as pool:
                    finals = list(pool.map(lambda text: complete(handle, text, p["n_stream"]), texts))
                wall = time.perf_counter() - start
            counts = [f["eval_count"] for f in finals]
            runs[str(streams)] = {"aggregate_tps": sum(counts) / wall, "wall_s": wall, "eval_counts": counts,
                                  "foreign_cores": contention.foreign_cores}
            progress(f"runner {streams} streams: {sum(counts) / wall:.1f} t/s, eval counts {counts}")
        rss = peak_rss_mib(handle.process.pid)
    finally:
        handle.close()
    return {"streams": runs, "peak_rss_mib": rss, "settings": options.__dict__}


WORKERS = {
    ("inproc", "single"): inproc_single,
    ("llamacpp", "single"): llamacpp_single,
    ("llamacpp", "concurrency"): llamacpp_concurrency,
    ("runner", "single"): runner_single,
    ("runner", "concurrency"): runner_concurrency,
}


def run_worker(a: WorkerArgs) -> int:
    """Run one measurement and print its JSON on stdout."""
    if not a.gpu:
        # a CPU run hides any GPU, so that neither engine initializes or offloads to one
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    worker = WORKERS.get((a.engine, a.task))
    if worker is None:
        raise SystemExit(f"no worker for engine {a.engine!r} and task {a.task!r}")
    result = worker(a)
    print(json.dumps(result))
    return 0
