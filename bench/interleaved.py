"""Our engine and llama.cpp in one process, measured in alternation: ratios that survive a noisy machine.

Usage:
    .venv/bin/python bench/interleaved.py [--models smollm2-135m,llama-3.2-1b] [--threads 2] [--rounds 10]

bench.py runs every measurement in a fresh process, which is what time to ready and peak RSS need, but
on a shared virtual machine the speed of the whole machine drifts by 10-50% between processes. Here both
engines load the same GGUF into one process and take turns, round by round (each round measures pp512
and tg128 for both, the order swapped every round), so a drift hits both sides of a round alike. The
ratio reported is the median over rounds of ours / llama.cpp, with its spread. Settings are bench.py's:
n_ctx 4096, batch 512, f16 KV cache, flash attention off, the same threads for both.

Python's share of a decode step is measured on our side: the time outside ggml's graph compute
(Backend.compute_seconds) over the time of the whole step, the argmax of the logits included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workers import BATCH, N_CTX, LlamaCpp, WorkerArgs  # noqa: E402

from bench import ensure_model, log  # noqa: E402

N_PP, N_TG = 512, 128
# Both engines end up on one libggml in this process (the same SONAME, built from the same source), so
# llama.cpp's log callback is ggml's: the objects that hold it must outlive every later ggml call.
_KEEP_ALIVE: list[LlamaCpp] = []


class Ours:
    def __init__(self, path: Path, threads: int):
        from ollama_engine.ml import DType
        from ollama_engine.models import load_model

        self.model = load_model(path, num_threads=threads)
        self.model.backend.load()
        self.model.cache.init(self.model.backend, DType.F16, 1, N_CTX, BATCH)

    def prompt(self, tokens: list[int]) -> None:
        from ollama_engine.generate import prefill

        prefill(self.model, tokens, 0, BATCH)

    def generate(self, first: int, n: int) -> None:
        from ollama_engine.generate import prefill

        token = first
        for position in range(n):
            token = int(np.argmax(prefill(self.model, [token], position, copy=False)))

    def clear(self) -> None:
        self.model.cache.remove(0, 0)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, threads: int, rounds: int) -> dict:
    path = ensure_model(name)
    rng = np.random.default_rng(0)
    ours = Ours(path, threads)
    theirs = LlamaCpp(WorkerArgs(engine="llamacpp", task="single", model=str(path), prompts={}, threads=threads,
                                 t0=time.time(), gpu=False, streams=[], verbose=False), N_CTX, 1)
    vocab = min(ours.model.tokenizer.vocab_size, theirs.n_vocab)
    tokens = rng.integers(100, vocab, N_PP).tolist()
    engines = {"ours": ours, "llama.cpp": theirs}
    for engine in engines.values():  # warm-up
        engine.prompt(tokens[:32])
        engine.clear()
        engine.generate(tokens[0], 4)
        engine.clear()
    times: dict[str, dict[str, list[float]]] = {e: {"pp": [], "tg": []} for e in engines}
    python_share = []
    for round_ in range(rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for label in order:
            engine = engines[label]
            times[label]["pp"].append(seconds(lambda: engine.prompt(tokens)))  # noqa: B023 - called at once
            engine.clear()
            in_ggml = ours.model.backend.compute_seconds
            tg = seconds(lambda: engine.generate(tokens[0], N_TG))  # noqa: B023
            times[label]["tg"].append(tg)
            if engine is ours:
                python_share.append(1 - (ours.model.backend.compute_seconds - in_ggml) / tg)
            engine.clear()
        log(f"{name} round {round_ + 1}/{rounds}: pp ours/llama.cpp "
            f"{times['llama.cpp']['pp'][-1] / times['ours']['pp'][-1]:.3f}, tg "
            f"{times['llama.cpp']['tg'][-1] / times['ours']['tg'][-1]:.3f}")
    ours.model.close()
    theirs.close()
    _KEEP_ALIVE.append(theirs)
    result = {"model": name, "rounds": rounds, "python_share": statistics.median(python_share)}
    for kind, n in (("pp", N_PP), ("tg", N_TG)):
        ratios = sorted(t / o for o, t in zip(times["ours"][kind], times["llama.cpp"][kind], strict=True))
        result[kind] = {
            "ours_tps": n / statistics.median(times["ours"][kind]),
            "llamacpp_tps": n / statistics.median(times["llama.cpp"][kind]),
            "ratio_median": statistics.median(ratios),
            "ratio_quartiles": (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,llama-3.2-1b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    results = [measure(name, args.threads, args.rounds) for name in args.models.split(",")]
    print(f"Interleaved in one process, {args.threads} threads, {args.rounds} rounds; ratio = ours / llama.cpp "
          "(median over rounds, quartiles in brackets)\n")
    print("| model | pp512 ours t/s | pp512 llama.cpp t/s | pp ratio | tg128 ours t/s | tg128 llama.cpp t/s "
          "| tg ratio | Python per decode step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        cells = [r["model"]]
        for kind in ("pp", "tg"):
            m = r[kind]
            low, high = m["ratio_quartiles"]
            ratio = f"{m['ratio_median']:.3f} [{low:.2f}-{high:.2f}]"
            cells += [f"{m['ours_tps']:.1f}", f"{m['llamacpp_tps']:.1f}", ratio]
        cells.append(f"{100 * r['python_share']:.1f}%")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
