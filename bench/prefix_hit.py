"""Time to first token on a prompt-cache hit: a 2 000-token shared prefix, hybrid (recurrent) model vs dense.

Usage:
    .venv/bin/python bench/prefix_hit.py [--models lfm2-350m,llama-350m] [--prefix 2000] [--rounds 3]

A prompt that shares a long prefix with the slot's previous one (a system prompt, a document asked about
twice) needs only its new tokens evaluated, if the cache can go back to the end of the shared part. An
attention cache can (drop the cells after it); a recurrent state cannot: it has seen every token. Our
runner restores a state checkpoint (kvcache/recurrent.py: at each prompt's end, every 1 664 positions and at
the prompt's last full batch) and evaluates from there; llama.cpp's llama_memory_seq_rm refuses the partial
removal on a recurrent memory, so a program on its API (llama-cpp-python's Llama, the C API as here)
evaluates the whole prompt again. llama-server (not measured here) keeps checkpoints of its own, taken
4 + n_ubatch and 4 tokens before each prompt's end and at user-message starts
(tools/server/server-context.cpp in the pinned source).

Each round, for each engine in turn (the order swapped every round), on one slot:
  other prompt (cold: no common prefix)  -> measured "cold"
  prefix + suffix 1 (cold)               -> measured "cold"
  prefix + suffix 2 (hit on the prefix)  -> measured "hit"
  prefix + suffix 3 (hit on the prefix)  -> measured "hit"
Time to first token: from handing over the (tokenized) prompt to the first sampled token. Ours runs
through the runner's batch loop and prompt cache (runner/loop.py) in this process; llama.cpp through
llama-cpp-python's C API (bench/workers.LlamaCpp) with the same cache bookkeeping llama-server does
before its checkpoints: reuse the common prefix where seq_rm accepts it, else clear and evaluate all.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workers import BATCH, N_CTX, LlamaCpp, WorkerArgs  # noqa: E402

from bench import ensure_model, log  # noqa: E402

WORDS = ("river stone garden window lantern morning harbor violin meadow copper letter engine winter "
         "orchard candle bridge silver market forest ladder").split()
_KEEP_ALIVE: list[LlamaCpp] = []  # llama.cpp's log callback is ggml's in this process: keep it alive


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def text_of(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, words).tolist())


class Ours:
    """The runner's batch loop on one slot (prompt cache on, exact reuse as serve's default)."""

    def __init__(self, path: Path, threads: int):
        from ollama_engine.runner.allocate import LoadParams, open_model
        from ollama_engine.runner.loop import Runner

        self.loaded = open_model(str(path), LoadParams(parallel=1, batch_size=BATCH, kv_size=N_CTX,
                                                       num_threads=threads), allocate=True)
        self.loaded.model.backend.load()
        self.errors: list[BaseException] = []
        self.runner = Runner(self.loaded, self.errors.append)
        self.runner.start()
        self.tokenizer = self.loaded.model.tokenizer

    def first_token(self, text: str) -> tuple[float, int]:
        """Seconds to the first token, and how many prompt inputs the cache supplied."""
        from ollama_engine.runner.sequence import SequenceOptions
        from ollama_engine.sample import Sampler

        seq = self.runner.new_sequence(text, SequenceOptions(sampler=Sampler(temperature=0), num_predict=1))
        done = threading.Event()
        first: list[float] = []

        def sink(piece) -> None:
            if piece is None:
                done.set()
            elif not first:
                first.append(time.perf_counter())

        start = time.perf_counter()
        self.runner.add(seq, sink)
        cached = seq.num_prompt_inputs - len(seq.inputs)
        if not done.wait(600) or self.errors:
            raise RuntimeError(f"no answer: {self.errors}")
        return (first[0] if first else time.perf_counter()) - start, cached

    def close(self) -> None:
        self.runner.close()
        self.loaded.close()


class Theirs:
    """llama.cpp on one sequence, with llama-server's reuse of a common prefix (without its checkpoints)."""

    def __init__(self, path: Path, threads: int):
        self.llm = LlamaCpp(WorkerArgs(engine="llamacpp", task="single", model=str(path), prompts={},
                                       threads=threads, t0=time.time(), gpu=False, streams=[], verbose=False),
                            N_CTX, 1)
        self.cached: list[int] = []

    def first_token(self, tokens: list[int]) -> tuple[float, int]:
        api, llm = self.llm.api, self.llm
        start = time.perf_counter()
        # the last prompt token is evaluated again for its logits
        common = min(common_prefix(self.cached, tokens), len(tokens) - 1)
        if common and not api.llama_memory_seq_rm(llm.memory, 0, common, -1):
            common = 0  # a recurrent memory cannot drop a tail: evaluate everything again
        if not common:
            llm.clear()
        for begin in range(common, len(tokens), BATCH):
            end = min(begin + BATCH, len(tokens))
            llm.decode([(tokens[i], i, 0, i == len(tokens) - 1) for i in range(begin, end)])
        llm.argmax(-1)
        self.cached = list(tokens)
        return time.perf_counter() - start, common

    def close(self) -> None:
        self.llm.close()
        _KEEP_ALIVE.append(self.llm)


def measure(name: str, prefix_words: int, rounds: int, threads: int) -> dict:
    path = ensure_model(name)
    ours, theirs = Ours(path, threads), Theirs(path, threads)
    rng = np.random.default_rng(0)
    encode = ours.tokenizer.encode
    results: dict[str, dict[str, list]] = {e: {"cold": [], "hit": [], "cached": []} for e in ("ours", "llama.cpp")}
    prefix_tokens = 0
    try:
        for round_ in range(rounds + 1):  # round 0 warms both up and is not counted
            prefix = text_of(rng, prefix_words)
            texts = [text_of(rng, prefix_words) + ".", *(prefix + ". " + text_of(rng, 12) + "." for _ in range(3))]
            tokens = [encode(t, add_special=True) for t in texts]
            shared = [common_prefix(tokens[1], t) for t in tokens[2:]]
            prefix_tokens = min(shared)
            order = ["ours", "llama.cpp"] if round_ % 2 == 0 else ["llama.cpp", "ours"]
            for engine in order:
                for i, (text, ids) in enumerate(zip(texts, tokens, strict=True)):
                    seconds, cached = ours.first_token(text) if engine == "ours" else theirs.first_token(ids)
                    if round_:
                        results[engine]["cold" if i < 2 else "hit"].append(seconds)
                        if i >= 2:
                            results[engine]["cached"].append(cached)
            log(f"{name} round {round_}/{rounds}: prompts {[len(t) for t in tokens]} tokens, shared {shared}; "
                + ", ".join(f"{e} cold {results[e]['cold'][-2:]} hit {results[e]['hit'][-2:]} "
                            f"cached {results[e]['cached'][-2:]}" for e in results if results[e]['cold']))
    finally:
        ours.close()
        theirs.close()
    return {"model": name, "prefix_tokens": prefix_tokens, "prompt_tokens": len(tokens[2]),
            **{e: {"cold_ms": 1000 * statistics.median(r["cold"]), "hit_ms": 1000 * statistics.median(r["hit"]),
                   "cached": statistics.median(r["cached"])} for e, r in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lfm2-350m,llama-350m")
    parser.add_argument("--prefix", type=int, default=2000, help="words of shared prefix (~1 token each here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows = [measure(name, args.prefix, args.rounds, args.threads) for name in args.models.split(",")]
    print(f"\nTime to first token, {args.threads} threads, medians of {args.rounds} rounds (2 cold and 2 hit "
          "prompts each); cached = prompt tokens the cache supplied on a hit\n")
    print("| model | shared prefix / prompt tokens | ours cold ms | ours hit ms | ours cached | llama.cpp cold ms "
          "| llama.cpp hit ms | llama.cpp cached | hit: ours / llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        o, t = r["ours"], r["llama.cpp"]
        print(f"| {r['model']} | {r['prefix_tokens']} / {r['prompt_tokens']} | {o['cold_ms']:.0f} | {o['hit_ms']:.0f} "
              f"| {o['cached']:.0f} | {t['cold_ms']:.0f} | {t['hit_ms']:.0f} | {t['cached']:.0f} "
              f"| {o['hit_ms'] / t['hit_ms']:.2f} |")


if __name__ == "__main__":
    main()
