#!/usr/bin/env python3
"""One command for a lent GPU machine: build ggml with CUDA and llama.cpp's tools, then check the GPU paths.

    python bench/device_check.py pack             # HERE, once before a device run: fills .device-check/ (carried)
    python bench/device_check.py                  # THERE: build for the visible GPU, run every step (~9 min)
    python bench/device_check.py --cpu [--quick]  # here: every step that needs no CUDA (CI runs --cpu --quick)

A device run (no network there, 16 cores, nvcc and CMake) first builds, in one CMake tree from the pinned
source, ggml with CUDA for the one architecture nvidia-smi reports, libllama (the reference for parity) and
llama-bench / llama-server, only those targets, on every core; our cffi bindings are compiled against that
same ggml. Meanwhile the synthetic 8B-shaped Q4_K model is written. Then the steps, each in its own process
with its own time bound (a hung GPU call costs that step, not the run):

  1. parity:  logprobs of ours against llama.cpp's on the same device (stated tolerance), greedy tokens,
              and a sequence batched with another == the same sequence alone;
  2. memory:  fit == alloc; the per-device estimate against what the device reports after load (NVML),
              full and partial offload;
  3. layout:  `plan`'s load loop: num_gpu auto, partial (num_gpu N), and a context that does not fit;
  4. speed:   pp512 / tg128 of ours against llama-bench, full and partial offload;
  5. serve:   serve against llama-server at 1 and 4 streams, interleaved (bench/serve_bench.py);
  6. bigbatch: half the layers on the GPU, a 512-row batch's CPU-layer work sent to the GPU (ggml's op offload,
              the weights copied over) or kept on the CPU: pp512 / tg128 both ways, ours and llama-bench (-nopo).

Packing and building (here and there) live in device_build.py; this file runs the steps.

Results: <out>/device-check.json (every step's numbers) and <out>/summary.md; logs in <out>/build.log and
<out>/steps.log. <out> is --out, else $OUT (the device tool's folder that comes back), else
bench/out/device-check.

What must travel: the device tool sends the working tree (64 MiB in all) and nothing can be fetched there.
The pinned llama.cpp source (74 MB sdist), the Python packages the device image lacks, and the real models do
not fit as they are, so `pack` writes .device-check/ (git-ignored; name it in `carry`): a pruned source
tarball (the folders the build needs), the llama_cpp Python bindings from the sdist, and wheels for what the
image lacks (cffi, pycparser, gguf, llguidance, diskcache). The real models are 98 MB (SmolLM2) and 253 MB
(Gemma 3), over the limit on their own: parity runs them where they are in the real-model cache (--models
DIR, else ollama_engine.fs.real_models' cache) and reports them as skipped, with their size, where they are
absent. In their place `pack` writes SmolLM2's first 2 layers (--real-layers; its real embeddings, output and
layers, 35 MB) to .device-check/models/, which parity checks where the whole file is absent: all of
.device-check is ~50 MB, the tree ~4 MB. The synthetic 8B model is written there, not carried.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]  # bench.py, the engine, the tests' helpers

from device_build import (  # noqa: E402 - found through the path above
    BUILD_SECONDS,
    DEVICE_BUILD,
    PACK,
    build,
    cuda_library_dirs,
    install_pack,
    log,
    pack,
    prebuild,
    real_model_folder,
    run_bounded,
    source_tree,
    truncated_name,
)

CPU_TOLERANCE = 1e-4  # the parity tests' bound on the CPU: same kernels, same batches
GPU_TOLERANCE = 2e-3  # on CUDA the same graph may be split or reduced differently by batch size
REAL = ("smollm2-135m-instruct", "gemma-3-270m")
SYNTHETIC_8B = "llama-3.1-8b"
# Random weights amplify any rounding difference layer after layer: on this CPU the 8B model's prompt alone
# (one sequence's rows) and beside another (twice the rows) took kernels that round differently (likely the
# repacked Q4_K gemm's remainder rows) and drifted by a logprob of 29, while SmolLM2 and Gemma 3 were bitwise
# equal and every model matched llama.cpp batch for batch. So batched == solo is judged on real weights only.
RANDOM_WEIGHTS_BATCHING = "reported only: random weights amplify batch-size-dependent rounding"


@dataclass(frozen=True)
class Step:
    name: str
    seconds: int  # the step's own time bound on the GPU and in --quick (its process is killed past it)
    cpu_seconds: int  # the bound in --cpu (full): the synthetic 8B model computes on this machine's cores
    needs_cuda: bool
    quick: bool  # part of --quick


STEPS = (
    Step("parity", 100, 900, False, True),
    Step("memory", 70, 120, False, True),
    Step("layout", 40, 120, False, True),
    Step("speed", 100, 100, True, False),
    Step("runner", 60, 120, False, False),
    Step("gpudiff", 200, 200, True, False),
    Step("serve", 160, 160, True, False),
    Step("bigbatch", 120, 120, True, False),
)



# ---------------------------------------------------------------- steps (each in its own process)


def model_paths(args: argparse.Namespace) -> dict[str, Path | str]:
    """name -> path for the models this run checks, or name -> why it is absent."""
    from ollama_engine.fs.real_models import REAL_MODELS

    folder = real_model_folder(args.models)
    found: dict[str, Path | str] = {}
    for name in REAL[:1] if args.quick else REAL:
        path = folder / REAL_MODELS[name].filename
        found[name] = path if path.exists() else (
            f"{REAL_MODELS[name].filename} ({REAL_MODELS[name].size / 1e6:.0f} MB) not in {folder}: too big to "
            f"travel in the device tool's 64 MiB tree; put it there with --models")
        truncated = sorted((PACK / "models").glob(truncated_name(0).replace("-0-", "-*-")))
        if name == REAL[0] and isinstance(found[name], str) and truncated:  # pack's cut of it, real weights
            found[name + " (" + truncated[0].name.split(".")[-2] + ")"] = truncated[0]
    found["stories260K"] = ROOT / "tests" / "data" / "stories260K.gguf"  # real weights, 1 MB: always travels
    if not args.quick:
        from bench import ensure_model

        found[SYNTHETIC_8B] = ensure_model(SYNTHETIC_8B)
    return found


def sized_model(args: argparse.Namespace) -> tuple[str, Path]:
    """The model memory and layout are checked on: the 8B-shaped one on a GPU (a size that matters there),
    else the first real one present."""
    models = model_paths(args)
    if not args.cpu:
        return SYNTHETIC_8B, Path(models[SYNTHETIC_8B])
    return next((n, Path(p)) for n, p in models.items() if not isinstance(p, str))


def gpu_layout(path: Path, count: int | None) -> list:
    """The first GPU holding the last `count` layers (all when None); empty on a machine without one."""
    from ollama_engine.fs import GGUFFile
    from ollama_engine.ml import on_first_gpu

    return on_first_gpu(GGUFFile.open(path).config.get_uint("block_count") + 1, count)


def threads(args: argparse.Namespace) -> int | None:
    """One compute thread in --cpu mode: ggml's spinning barriers crawl on a shared, busy machine (a 3-token
    batch took 13 s with 2 threads at load 15 here); the GPU run keeps the default."""
    return 1 if args.cpu else None


def logits_run(path: Path, gpu_layers: list, texts: list[list[int]], steps: int, num_threads: int | None,
               llama_split: bool = True) -> list[np.ndarray]:
    """Ours: the prompts, then `steps` greedy decodes; per step, per sequence, the logits.

    llama_split feeds the prompts in llama.cpp's split (to compare with it batch for batch); without it every
    prompt goes whole into one batch, as the runner schedules it: each sequence in the chunk it would have
    alone, so a sequence's logits must not depend on the others (batched == solo)."""
    from llama_reference import decode_batch, equal_shares

    from ollama_engine.kvcache import Batch, cache_dtype
    from ollama_engine.models import load_model

    model = load_model(path, gpu_layers, num_threads=num_threads)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), len(texts), 512, 64)
    texts, rows = [list(t) for t in texts], []
    rows_of = [(s, p) for s, t in enumerate(texts) for p in range(len(t))]
    whole = Batch(positions=[p for _, p in rows_of], sequences=[s for s, _ in rows_of],
                  outputs=[i for i, (s, p) in enumerate(rows_of) if p == len(texts[s]) - 1],
                  tokens=[texts[s][p] for s, p in rows_of])
    try:
        for step in range(steps + 1):
            last: dict[int, np.ndarray] = {}
            prompt = equal_shares(texts) if llama_split else [whole]
            for batch in prompt if step == 0 else [decode_batch(texts)]:
                for seq, row in zip(batch.sequences[batch.outputs], model.graphs.compute(batch), strict=True):
                    last[int(seq)] = row
            rows.append(np.stack([last[s] for s in range(len(texts))]))
            for text, row in zip(texts, rows[-1], strict=True):
                text.append(int(row.argmax()))
    finally:
        model.close()
    return rows


def prompt_tokens(path: Path) -> list[list[int]]:
    """The parity tests' two prompts, tokenized by the model's own tokenizer."""
    from llama_reference import PROMPTS

    from ollama_engine.models import load_model

    probe = load_model(path, allocate=False)
    try:
        return [probe.tokenizer.encode(prompt, add_special=True) for prompt in PROMPTS]
    finally:
        probe.close()


def against_reference(path: Path, texts: list[list[int]], ours: list[np.ndarray]) -> tuple[float, bool]:
    """llama.cpp (all layers on its GPU: libllama's default) fed the batches `ours` was fed, and the tokens
    ours chose; the largest logprob difference and whether every greedy token agreed."""
    from llama_reference import Reference, decode_batch, equal_shares, log_softmax

    reference = Reference(path, n_ctx=512, n_batch=64, sequences=len(texts), threads=os.cpu_count() or 2)
    diffs, greedy, feed = [], True, [list(t) for t in texts]
    try:
        for step, mine in enumerate(ours):
            theirs: dict[int, np.ndarray] = {}
            for batch in equal_shares(feed) if step == 0 else [decode_batch(feed)]:
                logits = reference.decode(batch.tokens, batch.positions, batch.sequences, batch.outputs)
                for seq, row in zip(batch.sequences[batch.outputs], logits, strict=True):
                    theirs[int(seq)] = row
            their = np.stack([theirs[s] for s in range(len(feed))])
            diffs.append(float(np.abs(log_softmax(mine) - log_softmax(their)).max()))
            greedy &= bool((mine.argmax(axis=1) == their.argmax(axis=1)).all())
            for text, row in zip(feed, mine, strict=True):
                text.append(int(row.argmax()))
    finally:
        reference.close()
    return max(diffs), greedy


def step_parity(args: argparse.Namespace) -> dict[str, Any]:
    """Ours against llama.cpp (its GPU when it has one), and sequence 0 batched with another == alone."""
    from llama_reference import compare_schedule, log_softmax

    steps = 2 if args.quick else 6
    tolerance = CPU_TOLERANCE if args.cpu else GPU_TOLERANCE
    results: dict[str, Any] = {"tolerance": tolerance, "steps": steps, "models": {}}
    ok = True
    for name, path in model_paths(args).items():
        if isinstance(path, str):
            results["models"][name] = {"status": "skip", "reason": path}
            continue
        started = time.monotonic()
        entry: dict[str, Any] = {}
        if args.cpu:  # the tests' own check: ours and llama.cpp, batch for batch, both on the CPU
            layout: list = []
            try:
                entry["max_logprob_diff"] = compare_schedule(path, flash=False, cache_type="f16", sequences=2,
                                                             steps=steps, tolerance=tolerance, threads=1)
                entry["greedy_equal"] = True
            except AssertionError as err:  # its message says which step and by how much
                entry.update(max_logprob_diff=float("inf"), greedy_equal=False, mismatch=str(err))
        else:
            layout, texts = gpu_layout(path, None), prompt_tokens(path)
            ours = logits_run(path, layout, texts, steps, threads(args))
            entry["max_logprob_diff"], entry["greedy_equal"] = against_reference(path, texts, ours)
        texts = prompt_tokens(path)
        solo = logits_run(path, layout, texts[:1], steps, threads(args), llama_split=False)
        batched = logits_run(path, layout, texts, steps, threads(args), llama_split=False)
        entry["batched_vs_solo_diff"] = max(
            float(np.abs(log_softmax(s[:1]) - log_softmax(b[:1])).max()) for s, b in zip(solo, batched, strict=True))
        entry["batched_greedy_equal"] = all(
            int(s[0].argmax()) == int(b[0].argmax()) for s, b in zip(solo, batched, strict=True))
        entry["on_gpu"] = bool(layout)
        entry["seconds"] = round(time.monotonic() - started, 1)
        batching_ok = entry["batched_vs_solo_diff"] < tolerance and entry["batched_greedy_equal"]
        if name == SYNTHETIC_8B:  # measured, not judged: see RANDOM_WEIGHTS_BATCHING
            entry["batched_vs_solo_note"], batching_ok = RANDOM_WEIGHTS_BATCHING, True
        entry["status"] = "pass" if (entry["max_logprob_diff"] < tolerance and entry["greedy_equal"]
                                     and batching_ok) else "fail"
        ok &= entry["status"] == "pass"
        results["models"][name] = entry
    checked = [m for m in results["models"].values() if m["status"] != "skip"]
    results["status"] = "fail" if not ok else ("pass" if checked else "skip")
    return results


def nvml_used() -> int | None:
    """Bytes in use on GPU 0 as the driver reports them (pynvml, as discovery does); None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # no driver, no GPU: this machine has nothing to report
        return None


def nvml_total() -> int | None:
    """GPU 0's memory in bytes (NVML); None without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except Exception:  # no driver, no GPU
        return None


def step_memory(args: argparse.Namespace) -> dict[str, Any]:
    """fit == alloc (tests/memory_checks.py), and the estimate for GPU 0 against NVML after load."""
    from ollama_engine.runner.allocate import LoadParams

    name, path = sized_model(args)
    cases: dict[str, Any] = {}
    ok = True
    full = gpu_layout(path, None)
    for case, layers in ([("cpu", [])] if args.cpu else [
            ("full", full), ("partial", gpu_layout(path, len(full[0].layers) // 2) if full else [])]):
        before = nvml_used()
        params = LoadParams(parallel=2, kv_size=2048, gpu_layers=tuple(layers))
        try:
            entry = memory_case(path, params, layers, before)
        except AssertionError as err:  # fit != alloc, or the buffers != the report: say where
            entry = {"status": "fail", "fit_equals_alloc": False, "assertion": str(err),
                     "differences": fit_alloc_differences(path, params)}
        ok &= entry["status"] == "pass"
        cases[case] = entry
    return {"model": name, "cases": cases, "status": "pass" if ok else "fail"}


def fit_alloc_differences(path: Path, params: Any) -> list[str]:
    """Where the runner's memory report after fit differs from the one after alloc (device, kind, layer)."""
    from ollama_engine.runner.allocate import open_model

    reports = []
    for allocate in (False, True):
        model = open_model(str(path), params, allocate=allocate)
        reports.append(model.memory.to_json())
        model.close()

    def leaves(value: Any, where: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in leaves(item, f"{where}.{key}").items()}
        if isinstance(value, list):
            return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{where}[{i}]").items()}
        return {where: value}

    fit, alloc = (leaves(r, "") for r in reports)
    return [f"{k}: fit {fit.get(k)} alloc {alloc.get(k)}" for k in sorted(set(fit) | set(alloc))
            if fit.get(k) != alloc.get(k)][:20]


def memory_case(path: Path, params: Any, layers: list, before: int | None) -> dict[str, Any]:
    """fit == alloc for one load (asserted), the estimate beside llama.cpp's and beside NVML's measure."""
    from memory_checks import fitted_then_allocated

    with fitted_then_allocated(str(path), params) as loaded:  # asserts fit == alloc
        estimate = sum(g.size() for g in loaded.memory.gpus)
        after = nvml_used()
        entry = {"layers_on_gpu": sum(len(g.layers) for g in layers), "fit_equals_alloc": True,
                 "gpu_estimate": estimate, "cpu_estimate": loaded.memory.cpu.size(),
                 "gpu_estimate_mib": {kind: round(sum(sum(getattr(g, kind)) if kind != "graph" else g.graph
                                                      for g in loaded.memory.gpus) / 2**20, 1)
                                      for kind in ("weights", "cache", "graph")}}
        if layers and llama_tool("llama-fit-params").exists():  # llama.cpp's estimate of the same load
            entry["llama_cpp_estimate_mib"] = llama_fit_print(path, entry["layers_on_gpu"], params)
        if before is not None and after is not None and layers:
            entry["gpu_measured"] = after - before
            entry["measured_over_estimate"] = round((after - before) / max(estimate, 1), 3)
            # the measurement holds the CUDA context (~0.5 GiB) beside the estimate; more is a miss
            entry["status"] = "pass" if estimate <= after - before <= estimate + (768 << 20) else "fail"
        else:
            entry["status"] = "pass"
    return entry


def llama_tool(name: str) -> Path:
    return DEVICE_BUILD / "bin" / name


def llama_fit_print(path: Path, ngl: int, params: Any) -> dict[str, dict[str, int]]:
    """llama.cpp's estimate of a load (`llama-fit-params --fit-print`): MiB per device of model, context and
    compute buffers, for the same layers, cells, sequences, batch and attention as `params`."""
    out = subprocess.run([str(llama_tool("llama-fit-params")), "-m", str(path), "-ngl", str(ngl), "-c",
                          str(params.kv_size), "-np", str(params.parallel), "-b", str(params.batch_size), "-ub",
                          str(params.batch_size), "-fa", "on" if params.flash_attention == 1 else "off",
                          "--fit-print", "on"], capture_output=True, text=True, timeout=60).stdout
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 4]
    return {name: dict(zip(("model", "context", "compute"), map(int, values), strict=True)) for name, *values in rows
            if all(v.isdigit() for v in values)}


def llama_fit(path: Path, *extra: str) -> str:
    """The arguments llama.cpp's --fit chooses (`llama-fit-params`: "-c N -ngl N ..."), or its error."""
    result = subprocess.run([str(llama_tool("llama-fit-params")), "-m", str(path), *extra], capture_output=True,
                            text=True, timeout=60)
    return result.stdout.strip() or f"exit {result.returncode}: {result.stderr.strip()[-300:]}"


def plan_json(path: Path, *extra: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "ollama_engine", "plan", str(path), "--json", *extra],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    if not result.stdout.strip():
        raise RuntimeError(f"plan failed: {result.stderr[-800:]}")
    return json.loads(result.stdout)


def step_layout(args: argparse.Namespace) -> dict[str, Any]:
    """The load loop as serve runs it: auto, num_gpu N, and a context no device holds whole."""
    name, path = sized_model(args)
    # here: a simulated GPU of 1 GiB (the loop is the same; the memory is charged from the CPU's measure)
    gpu = ["--gpu", "CUDA:GPU-0:1GiB"] if args.cpu else []
    # a context whose cache the GPU cannot hold but the host can: SmolLM2's 65536 (1.4 GiB) against the 1 GiB
    # simulated GPU; on a real one, the 8B model's f16 cache (128 KiB a token) a little over the GPU's memory
    total = nvml_total()
    too_big = "65536" if args.cpu or not total else str(int(total * 1.05) // (128 << 10))
    cases = {"auto": ["--ctx", "4096"], "partial": ["--ctx", "4096", "--num-gpu", "4"],
             "context_too_big": ["--ctx", too_big]}
    theirs = {"auto": ["-c", "4096"], "partial": ["-c", "4096", "-ngl", "4"], "context_too_big": ["-c", too_big]}
    results: dict[str, Any] = {"model": name, "simulated_gpu": bool(gpu), "cases": {}}
    ok = True
    for case, extra in cases.items():
        plan = plan_json(path, *gpu, *extra)
        entry = {"fits": plan["fits"], "offloaded": plan["offloaded_layers"], "total": plan["total_layers"],
                 "passes": len(plan["passes"]), "error": plan["error"]}
        if case == "auto":
            good = plan["fits"] and plan["offloaded_layers"] == plan["total_layers"]
        elif case == "partial":
            good = plan["fits"] and plan["offloaded_layers"] == 4
        else:  # some layers on the GPU, the rest on the CPU: never all (it cannot hold them). A refusal only
            # on a GPU as big as the host's memory (an H200's 141 GiB beside 128 GiB): then nothing holds it
            good = plan["fits"] and 0 < plan["offloaded_layers"] < plan["total_layers"] or (
                not args.cpu and bool(plan["error"]))
        entry["status"] = "pass" if good else "fail"
        if not args.cpu and llama_tool("llama-fit-params").exists():  # what llama.cpp's --fit does instead
            entry["llama_cpp_fit"] = llama_fit(path, "-np", "1", *theirs[case])  # -fa auto, as ours
        ok &= good
        results["cases"][case] = entry
    results["status"] = "pass" if ok else "fail"
    return results


def step_speed(args: argparse.Namespace) -> dict[str, Any]:
    """pp512 / tg128: llama-bench against ours (one 512-token batch, 128 single-token decodes)."""
    path = model_paths(args)[SYNTHETIC_8B]
    bench = llama_tool("llama-bench")
    total = gpu_layout(Path(path), None)
    layers = len(total[0].layers)
    results: dict[str, Any] = {"model": SYNTHETIC_8B, "cases": {}}
    for case, ngl in (("full", layers), ("partial", layers // 2)):
        out = subprocess.run([str(bench), "-m", str(path), "-p", "512", "-n", "128", "-ngl", str(ngl), "-r", "1",
                              "-o", "json"], capture_output=True, text=True, timeout=45, check=True).stdout
        theirs = {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(out)}
        results["cases"][case] = {"ngl": ngl, "llama_bench": theirs, "ours": ours_speed(Path(path), ngl, profile=True)}
    results["status"] = "report"
    return results


def ours_speed(path: Path, ngl: int, op_offload: bool = True, profile: bool = False) -> dict[str, Any]:
    """tokens/s of one 512-token prompt batch and of 128 decodes, on the last `ngl` layers' GPU."""
    from ollama_engine.kvcache import Batch, cache_dtype
    from ollama_engine.models import load_model

    model = load_model(path, gpu_layout(path, ngl), op_offload=op_offload)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, 1024, 512)
    try:
        rng = np.random.default_rng(0)
        tokens = [int(t) for t in rng.integers(100, 30000, 512)]
        prompt = Batch(positions=range(512), sequences=[0] * 512, outputs=[511], tokens=tokens)
        model.graphs.compute(prompt)  # a warm-up as llama-bench's: the first use of each kernel, the first
        model.graphs.compute(Batch(positions=[512], sequences=[0], outputs=[0], tokens=[tokens[0]]))  # graphs
        model.cache.remove(0, 0)
        started = time.perf_counter()
        model.graphs.compute(prompt)
        pp = 512 / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(128):
            model.graphs.compute(Batch(positions=[512 + i], sequences=[0], outputs=[0], tokens=[tokens[i]]))
        speeds = {"pp512": round(pp, 1), "tg128": round(128 / (time.perf_counter() - started), 1)}
        return {**speeds, "decode_profile": decode_profile(model, tokens, 640)} if profile else speeds
    finally:
        model.close()


def decode_profile(model: Any, tokens: list[int], position: int) -> dict[str, Any]:
    """Where a decode step's time goes: the scheduler's splits and copies, Python's functions (cProfile over
    16 steps, by own time) and ggml's ops by kind (one step, each op then computed and waited for alone)."""
    import collections
    import cProfile
    import pstats

    from ollama_engine import ggml
    from ollama_engine.ggml.backend import NodeTimer
    from ollama_engine.kvcache import Batch

    def step(i: int) -> None:
        model.graphs.compute(Batch(positions=[position + i], sequences=[0], outputs=[0], tokens=[tokens[i]]))

    step(0)
    scheduler = model.backend.scheduler
    splits, copies = scheduler.splits()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.runcall(lambda: [step(i) for i in range(1, 17)])
    wall = (time.perf_counter() - started) / 16
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    python = [{"function": f"{Path(f).name}:{line} {name}", "calls": v[0], "own_ms_per_step": round(1e3 * v[2] / 16, 3)}
              for (f, line, name), v in top]
    ops: collections.Counter[str] = collections.Counter()
    timer = NodeTimer(lambda node, seconds: ops.update({ggml.node_kind(node): seconds}))
    scheduler.set_eval_callback(timer)
    try:
        step(17)
    finally:
        scheduler.set_eval_callback(None)
    return {"splits": splits, "copies": copies, "ms_per_step_profiled": round(1e3 * wall, 3), "python": python,
            "ops_ms_one_step_synced": {k: round(1e3 * v, 3) for k, v in ops.most_common(12)}}


def step_runner(args: argparse.Namespace) -> dict[str, Any]:
    """The runner's own loop (runner/loop.py) in this process, without HTTP: greedy streams of 64 tokens at
    1 and 4 streams, the graphs it built, and where its threads spent their time (stack samples every ms):
    what serve's runner costs beyond a bare decode step (the speed step's)."""
    import collections
    import threading

    from ollama_engine.models import graphs
    from ollama_engine.runner.allocate import LoadParams, open_model
    from ollama_engine.runner.loop import Runner
    from ollama_engine.runner.sequence import SequenceOptions
    from ollama_engine.sample import Sampler

    name, path = sized_model(args)
    built: collections.Counter[str] = collections.Counter()
    build = graphs.Graph.__init__

    def counted(graph: Any, model: Any, key: Any, batch: Any) -> None:
        built[f"{len(batch)} rows"] += 1
        build(graph, model, key, batch)

    graphs.Graph.__init__ = counted
    layers = tuple(gpu_layout(path, None))
    loaded = open_model(str(path), LoadParams(parallel=4, batch_size=512, kv_size=4096, gpu_layers=layers,
                                              num_threads=threads(args) or 0), allocate=True)
    loaded.model.backend.load()
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    samples: collections.Counter[str] = collections.Counter()
    sampling = threading.Event()

    def sample() -> None:  # what each of the runner's threads is doing, every millisecond
        names = {t.ident: t.name for t in threading.enumerate()}
        while sampling.is_set():
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident() or names.get(ident) == "MainThread":
                    continue
                stack = []
                while frame is not None and len(stack) < 3:
                    stack.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
                    frame = frame.f_back
                samples[f"{names.get(ident, ident)}: " + " < ".join(stack)] += 1
            time.sleep(0.001)

    def streams(count: int) -> float:
        done = [threading.Event() for _ in range(count)]
        started = time.perf_counter()
        for i, event in enumerate(done):
            seq = runner.new_sequence(f"Story {i}: once upon a time, in a land far away, there lived",
                                      SequenceOptions(sampler=Sampler(temperature=0), num_predict=64))
            runner.add(seq, lambda piece, event=event: event.set() if piece is None else None)
        for event in done:
            event.wait(60)
        return round(64 * count / (time.perf_counter() - started), 1)

    try:
        streams(1)  # warm-up: the first graphs of each shape
        built.clear()
        sampling.set()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rates = {"1": streams(1), "4": streams(4)}
        sampling.clear()
        sampler.join()
    finally:
        runner.close()
        loaded.close()
        graphs.Graph.__init__ = build
    total = sum(samples.values()) or 1
    return {"status": "report" if not errors else "error", "model": name, "tokens_per_s": rates,
            "graphs_built": dict(built), "errors": [repr(e) for e in errors],
            "thread_samples": {k: round(v / total, 3) for k, v in samples.most_common(15)}}


def step_gpudiff(args: argparse.Namespace) -> dict[str, Any]:
    """`ollama-engine diff --gpu`: both engines with every layer on the GPU, tensor by tensor, on the 8B and
    stories260K: the first tensor past diff's tolerance is where the GPU parity gap begins."""
    results: dict[str, Any] = {"status": "report", "models": {}}
    models = model_paths(args)
    for name in ("stories260K", SYNTHETIC_8B):  # the small one first: its answer comes even if the 8B runs out
        done = subprocess.run([sys.executable, "-m", "ollama_engine", "diff", str(models[name]), "--prompt",
                               "The capital of France is a city that", "--gpu", "--json", "-n", "4"],
                              capture_output=True, text=True, timeout=170, cwd=ROOT)
        if not done.stdout.strip().startswith("{"):
            results["models"][name] = {"error": done.stderr[-800:]}
            continue
        found = json.loads(done.stdout)
        results["models"][name] = {k: found.get(k) for k in ("first_over", "output_max_abs", "greedy_agree",
                                                              "ours_argmax", "llama_argmax")}
        results["models"][name]["largest"] = sorted(found["tensors"], key=lambda t: -(t["rel"] or 0))[:8]
    return results


def step_serve(args: argparse.Namespace) -> dict[str, Any]:
    """bench/serve_bench.py on the 8B model: serve, the runner it loaded driven directly (the hop alone), a runner
    alone and llama-server, 1, 4 and 8 streams, one round; with --spy under py-spy (every Python process's busy
    stacks, to <out>/serve-stacks.txt): it slows the runners' start, so only when the stacks are the question."""
    path = model_paths(args)[SYNTHETIC_8B]
    out = Path("/tmp/device-check-serve.json")
    command = [sys.executable, str(HERE / "serve_bench.py"), "--model", str(path), "--llama-server",
               str(llama_tool("llama-server")), "--streams", "1,4,8", "--concurrency-only", "--runner", "--its-runner",
               "--rounds", "1", "--n-predict", "64", "--out", str(out)]
    spy = Path("/tmp/device-check-site/bin/py-spy")
    stacks = args.out / "serve-stacks.txt"
    if args.spy and spy.exists():  # --nonblocking: a paused process at every sample slowed a runner start further
        command = [str(spy), "record", "--subprocesses", "--threads", "--nonblocking", "-r", "100", "-f", "raw",
                   "-o", str(stacks), "--", *command]
    out.unlink(missing_ok=True)
    code = subprocess.run(command).returncode
    result = {"status": "report", "serve_bench": json.loads(out.read_text())} if out.exists() else {
        "status": "error", "reason": f"serve_bench.py exit {code}: see steps.log"}
    if stacks.exists():
        result["busiest_stacks"] = busiest_stacks(stacks)
    return result


def busiest_stacks(raw: Path, count: int = 20) -> dict[str, int]:
    """py-spy's raw samples by process, thread and innermost 4 frames: where the busy threads were."""
    import collections

    totals: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = stack.split(";")
        commands = [f.partition(":")[2].strip('"').split() for f in frames if f.startswith("process ")]
        words = commands[-1] if commands and commands[-1] else ["?"]  # the innermost: serve_bench, serve, a runner
        process = next((w for w in ("serve", "runner") if w in words), Path(words[min(1, len(words) - 1)]).name)
        thread = next((f for f in frames if f.startswith("thread ")), "?")
        inner = [f for f in frames if not f.startswith(("process ", "thread "))][-4:]
        totals[f"{process} {thread}: " + " < ".join(reversed(inner))] += int(samples) if samples.isdigit() else 0
    return dict(totals.most_common(count))


def step_bigbatch(args: argparse.Namespace) -> dict[str, Any]:
    """Half the layers on the GPU: a 512-row batch's work on the CPU's layers computed on the GPU (ggml's op
    offload: the weights are copied over for it) or where the weights are; decodes (1 row) stay on the CPU
    either way. Ours (load_model's op_offload) and llama-bench (-nopo), pp512 and tg128, both ways."""
    path = model_paths(args)[SYNTHETIC_8B]
    bench = llama_tool("llama-bench")
    layers = len(gpu_layout(Path(path), None)[0].layers)
    results: dict[str, Any] = {"model": SYNTHETIC_8B, "ngl": layers // 2, "cases": {}}
    for case, offload in (("offload", True), ("no_offload", False)):
        out = subprocess.run([str(bench), "-m", str(path), "-p", "512", "-n", "128", "-ngl", str(layers // 2),
                              "-nopo", str(int(not offload)), "-r", "1", "-o", "json"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        theirs = {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(out)}
        results["cases"][case] = {"llama_bench": theirs, "ours": ours_speed(Path(path), layers // 2, offload)}
    results["status"] = "report"
    return results


STEP_FUNCTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "parity": step_parity, "memory": step_memory, "layout": step_layout, "speed": step_speed,
    "runner": step_runner, "gpudiff": step_gpudiff, "serve": step_serve, "bigbatch": step_bigbatch,
}


# ---------------------------------------------------------------- driver


def run_step(step: Step, args: argparse.Namespace, out: Path, left: float) -> dict[str, Any]:
    """The step in a child process under its time bound (and the run's budget); its JSON result, or why
    there is none."""
    if args.cpu and step.needs_cuda:
        return {"status": "skip", "reason": "needs the CUDA build (llama-bench / llama-server on a GPU)"}
    if args.quick and not step.quick:
        return {"status": "skip", "reason": "not in --quick"}
    if args.only and step.name not in args.only.split(","):
        return {"status": "skip", "reason": "not in --only"}
    bound = min(step.cpu_seconds if args.cpu and not args.quick else step.seconds, left)
    if bound < 10:
        return {"status": "skip", "reason": f"the run's --budget of {args.budget} s is spent"}
    result_file = out / f".step-{step.name}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--step", step.name, "--result", str(result_file), "--out", str(out)]
    command += [flag for flag, on in (("--cpu", args.cpu), ("--quick", args.quick), ("--spy", args.spy)) if on]
    command += ["--models", str(args.models)] if args.models else []
    command += ["--only", args.only] if args.only else []
    started = time.monotonic()
    with (out / "steps.log").open("a") as steps_log:
        steps_log.write(f"==== {step.name}\n")
        steps_log.flush()
        try:
            code = run_bounded(command, bound, steps_log)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "reason": f"over its bound of {bound:.0f} s",
                    "seconds": round(time.monotonic() - started, 1)}
    if not result_file.exists():
        return {"status": "error", "reason": f"exit {code}; see steps.log",
                "seconds": round(time.monotonic() - started, 1)}
    result = json.loads(result_file.read_text())
    result_file.unlink()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def child(args: argparse.Namespace) -> int:
    """One step, in this process: write its result (or the exception that ended it) to --result."""
    if PACK.joinpath("llama_cpp").exists() and not args.cpu:
        install_pack()
    try:
        result = STEP_FUNCTIONS[args.step](args)
    except Exception as err:  # the step's failure is its result; the run goes on with the next step
        import traceback

        traceback.print_exc()
        result = {"status": "error", "reason": f"{type(err).__name__}: {err}"[:600]}
    Path(args.result).write_text(json.dumps(result, indent=2, default=str))
    return 0


def summary(report: dict[str, Any]) -> str:
    lines = [f"# Device check ({report['mode']})", "", f"machine: {report['machine']}", "",
             "| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    for name, result in report["steps"].items():
        note = result.get("reason", "")
        if name == "parity" and "models" in result:
            note = "; ".join(f"{m}: {r['status']}" + (f" Δ{r['max_logprob_diff']:.1e}" if "max_logprob_diff" in r
                                                      else "") for m, r in result["models"].items())
        elif name == "speed" and "cases" in result:
            note = "; ".join(f"{c}: " + ", ".join(f"{k} {r['ours'][k]:.0f} vs {r['llama_bench'].get(k, 0):.0f} t/s"
                                                   for k in ("pp512", "tg128")) for c, r in result["cases"].items())
        elif name == "memory" and "cases" in result:
            note = "; ".join(f"{c}: {r['status']}" + (f", measured/estimate {r['measured_over_estimate']}"
                                                     if "measured_over_estimate" in r else "")
                             for c, r in result["cases"].items())
        elif name == "layout" and "cases" in result:
            note = "; ".join(f"{c}: {r['status']} {r['offloaded']}/{r['total']}" + (
                f" (llama.cpp: {r['llama_cpp_fit']})" if "llama_cpp_fit" in r else "")
                for c, r in result["cases"].items())
        elif "cases" in result:
            note = "; ".join(f"{c}: {r.get('status', '')}" for c, r in result["cases"].items())
        lines.append(f"| {name} | {result['status']} | {result.get('seconds', '')} | {note} |")
    lines += ["", f"total: {report['seconds']} s; failed: {', '.join(report['failed']) or 'none'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["run", "pack", "prebuild"], default="run")
    parser.add_argument("--cpu", action="store_true", help="no CUDA build: the steps that need none, here")
    parser.add_argument("--quick", action="store_true", help="no builds, SmolLM2 only, fewest steps (CI)")
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else bench/out/device-check)")
    parser.add_argument("--models", type=Path, help="folder holding the real GGUF files (default: their cache)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--budget", type=int,
                        help="seconds for the whole run, build included (default: 540 on the device, whose tool "
                             "allows 600 a command; 3600 with --cpu); a step gets what is left when its bound is more")
    parser.add_argument("--no-wheels", action="store_true", help="pack: leave out the wheels")
    parser.add_argument("--real-layers", type=int, default=2,
                        help="pack: SmolLM2's first N layers as a model that travels (default 2, ~35 MB; 0: none)")
    parser.add_argument("--only", help="the steps to run, comma-separated (default: all)")
    parser.add_argument("--spy", action="store_true", help="serve step: under py-spy (slower runner starts)")
    parser.add_argument("--arch", default="90", help="prebuild: the CUDA architecture (default 90: H100, H200)")
    parser.add_argument("--step", choices=list(STEP_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "pack":
        return pack(wheels=not args.no_wheels, real_layers=args.real_layers)
    if args.command == "prebuild":
        return prebuild(args.arch, args.jobs)
    if not args.cpu and "DEVICE_CHECK_LIBRARIES" not in os.environ:  # the loader reads its path at start only
        folders = cuda_library_dirs()
        os.environ["DEVICE_CHECK_LIBRARIES"] = os.pathsep.join(folders)
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*folders, os.environ.get("LD_LIBRARY_PATH", "")])
        os.execv(sys.executable, [sys.executable, *sys.argv])
    out_env = os.environ.get("OUT")  # the device tool's folder; outside it unset
    out = args.out or (Path(out_env) if out_env else HERE / "out" / "device-check")
    out.mkdir(parents=True, exist_ok=True)
    args.out = out
    if args.step:
        return child(args)
    args.budget = args.budget or (3600 if args.cpu else 540)
    (out / "steps.log").write_text("")
    started = time.monotonic()
    report: dict[str, Any] = {"mode": "cpu" + (" quick" if args.quick else "") if args.cpu else "cuda",
                              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                              "steps": {}}
    if not args.cpu:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True) if shutil.which("nvidia-smi") else None
        report["machine"] += f"; GPU: {gpu.stdout.strip() if gpu else 'none (no nvidia-smi)'}"  # named in results
        report["cuda_library_dirs"] = os.environ.get("DEVICE_CHECK_LIBRARIES", "")
        report["steps"]["build"] = build_step(args, out)
        if report["steps"]["build"]["status"] != "pass":
            return finish(report, out, started)
    for step in STEPS:
        log(f"step {step.name}")
        left = args.budget - (time.monotonic() - started)
        report["steps"][step.name] = run_step(step, args, out, left)
        log(f"step {step.name}: {report['steps'][step.name]['status']}")
    return finish(report, out, started)


def build_step(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The CUDA build (or prebuild's binaries), then the synthetic 8B model written (its own process, ~20 s:
    its writer imports the engine, so it needs the bindings the build compiles)."""
    try:
        if PACK.joinpath("wheels").exists():
            install_pack()
        tree = source_tree()  # also where the model's writer finds its vocabulary
        result = {"status": "pass", **build(tree, args.jobs, out / "build.log", min(BUILD_SECONDS, args.budget))}
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"over {min(BUILD_SECONDS, args.budget)} s: run again on the warm "
                "machine, ninja goes on where it stopped (build/device-cuda stays there)"}
    except Exception as err:  # the build's log says why; the steps need the build
        return {"status": "error", "reason": f"{type(err).__name__}: {err}"[:600]}
    with (out / "build.log").open("a") as log_file:
        try:
            code = run_bounded([sys.executable, "-c", "import sys; sys.path[:0]=['bench', '.']; import bench; "
                                f"bench.ensure_model({SYNTHETIC_8B!r})"], 120, log_file)
        except subprocess.TimeoutExpired:  # a half-written model must not pass for a whole one in a rerun
            code = "timeout"
            for partial in (HERE / "out").glob(f"{SYNTHETIC_8B}-*.gguf"):
                partial.unlink()
    if code:  # the steps on the 8B model will say they lack it; the log says why
        result["model_writer"] = f"exit {code}: see build.log"
    return result


def finish(report: dict[str, Any], out: Path, started: float) -> int:
    report["seconds"] = round(time.monotonic() - started, 1)
    report["failed"] = [n for n, r in report["steps"].items() if r["status"] in ("fail", "error", "timeout")]
    (out / "device-check.json").write_text(json.dumps(report, indent=2, default=str))
    text = summary(report)
    (out / "summary.md").write_text(text)
    print(text)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
