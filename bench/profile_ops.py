"""Where the time goes, op by op, in our engine and in llama.cpp: the tool behind RESULTS.md's notes on pp.

Usage:
    .venv/bin/python bench/profile_ops.py [--model smollm2-135m] [--tokens 512] [--rounds 8] [--threads 2]
    .venv/bin/python bench/profile_ops.py --generate 64     # decode steps instead of a prompt

Both engines load the same GGUF into one process (as in interleaved.py) and take turns, round by round,
at the same prompt (or at generating the same number of tokens one by one). ggml's scheduler eval
callback asks for every node, so each node is computed on its own and timed; the table sums the
seconds per kind of node (matmuls by weight type and shape) per round. Node by node is slower than a
whole graph, equally for both engines: compare rows, not totals with bench.py.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from interleaved import _KEEP_ALIVE, N_CTX, LlamaCpp, Ours  # noqa: E402
from workers import WorkerArgs  # noqa: E402

from bench import ensure_model  # noqa: E402


def llama_cpp_with_timer(path: Path, threads: int, times: dict[str, float]) -> LlamaCpp:
    """llama.cpp with an eval callback that times every node into `times`: the same callback as ours."""
    import llama_cpp as api

    from ollama_engine import ggml
    from ollama_engine.ggml.backend import NodeTimer

    def record(node, seconds: float) -> None:
        times[ggml.node_kind(node)] += seconds

    timer = NodeTimer(record)
    _KEEP_ALIVE.append(timer)
    args = WorkerArgs(engine="llamacpp", task="single", model=str(path), prompts={}, threads=threads,
                      t0=time.time(), gpu=False, streams=[], verbose=False)
    return LlamaCpp(args, N_CTX, 1, eval_callback=api.ggml_backend_sched_eval_callback(timer.address))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generate", type=int, default=0, help="profile this many decode steps instead")
    args = parser.parse_args()

    path = ensure_model(args.model)
    ours = Ours(path, args.threads)
    theirs_times: dict[str, float] = collections.defaultdict(float)
    theirs = llama_cpp_with_timer(path, args.threads, theirs_times)
    _KEEP_ALIVE.append(theirs)  # one ggml in this process: llama.cpp's callbacks must outlive it
    tokens = np.random.default_rng(0).integers(100, min(ours.model.tokenizer.vocab_size, theirs.n_vocab),
                                               args.tokens).tolist()

    def work(engine) -> None:
        if args.generate:
            engine.generate(tokens[0], args.generate)
        else:
            engine.prompt(tokens)
        engine.clear()

    for engine in (ours, theirs):  # warm-up, and graphs built before timing
        work(engine)
    theirs_times.clear()
    with ours.model.backend.time_ops() as ours_times:
        for round_ in range(args.rounds):
            for engine in (ours, theirs) if round_ % 2 == 0 else (theirs, ours):
                work(engine)

    kinds = sorted(set(ours_times) | set(theirs_times), key=lambda k: -theirs_times.get(k, 0.0))
    task = f"{args.generate} decode steps" if args.generate else f"a prompt of {args.tokens} tokens"
    print(f"{args.model}, {task}, {args.threads} threads: ms per round (mean of {args.rounds})\n")
    print("| node | ours ms | llama.cpp ms | ours / llama.cpp |")
    print("|---|---:|---:|---:|")
    for kind in [*kinds, "total"]:
        a = (sum(ours_times.values()) if kind == "total" else ours_times.get(kind, 0.0)) * 1000 / args.rounds
        b = (sum(theirs_times.values()) if kind == "total" else theirs_times.get(kind, 0.0)) * 1000 / args.rounds
        print(f"| {kind} | {a:.1f} | {b:.1f} | {a / b if b else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
