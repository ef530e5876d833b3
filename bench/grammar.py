"""What structured outputs cost: a decode step under a JSON schema against an unconstrained one, and the
setup of a grammar per request, on the Llama-3.2-1B-shaped synthetic model (Llama 3 vocabulary, 128k).

Usage:
    .venv/bin/python bench/grammar.py [--rounds 10] [--steps 32] [--threads 2]

Both modes decode the same positions of one sequence in-process (model forward + sampling), alternating
round by round so that a drift of the machine hits both alike; the ratio is the median over rounds of
constrained / unconstrained time per step. The model has random weights, so its favourite token is almost
never one the schema allows: nearly every constrained step computes the full 128k-token mask. That is the
worst case; a trained model's sampled token usually passes the one-token check. A document that is complete
starts a new one (that setup is timed apart). Samplers: greedy, and Ollama's defaults (temperature 0.8,
top-k 40, top-p 0.9).

Setup is timed per request: the vocabulary for llguidance (once per model), then a schema never seen
before (format -> grammar -> checked -> compiled matcher), and the same schema again (a copy of the
compiled matcher).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (bench/bench.py: the synthetic models)
from ollama_engine.kvcache import Batch  # noqa: E402
from ollama_engine.ml import DType  # noqa: E402
from ollama_engine.models import load_model  # noqa: E402
from ollama_engine.sample import GrammarVocab, Sampler, format_grammar  # noqa: E402

MODEL = "llama-3.2-1b"
PROMPT_TOKENS = 32


def schema(n: int) -> dict:
    """A nested schema; `n` makes each one new to the compiled-grammar cache."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16 + n},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["name", "age"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per mode per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    path = bench.ensure_model(MODEL)
    model = load_model(path, num_threads=args.threads)
    model.backend.load()
    tokenizer = model.tokenizer
    model.cache.init(model.backend, DType.F16, 1, PROMPT_TOKENS + args.steps + 1, PROMPT_TOKENS)
    bench.log(f"{MODEL}: {tokenizer.vocab_size} tokens, {args.threads} threads, load {os.getloadavg()[0]:.1f}")

    started = time.perf_counter()
    vocab = GrammarVocab.of(tokenizer)
    vocab_seconds = time.perf_counter() - started
    fresh, cached = [], []
    for n in range(20):
        started = time.perf_counter()
        vocab.matcher(format_grammar(schema(n)))
        fresh.append(time.perf_counter() - started)
        started = time.perf_counter()
        vocab.matcher(format_grammar(schema(n)))
        cached.append(time.perf_counter() - started)

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1000, 100000, PROMPT_TOKENS)]
    first = model.graphs.compute(Batch(positions=np.arange(PROMPT_TOKENS), sequences=np.zeros(PROMPT_TOKENS),
                                       outputs=[PROMPT_TOKENS - 1], tokens=prompt), copy=True)[0]
    grammar = format_grammar(schema(0))

    # a document that follows the schema, and its tokens: steering the logits towards them stands in for a
    # trained model, whose favourite token the schema usually allows
    document = json.dumps({"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "W1"},
                           "tags": ["math", "engines"]})
    steer = tokenizer.encode_continuation(document)

    def decode(sampler: Sampler, constrained: bool, steered: bool) -> tuple[list[float], list[float], int]:
        """Per-step seconds (whole step, and sampling alone), and how many steps computed a full mask."""
        model.cache.remove(0, PROMPT_TOKENS)  # every run decodes the same positions after the prompt
        logits, steps, sampling, masked, at = first, [], [], 0, 0
        matcher = vocab.matcher(grammar) if constrained else None
        for step in range(args.steps):
            if steered:
                logits = logits.copy()
                logits[steer[at % len(steer)]] += 100.0
            started = time.perf_counter()
            if matcher is None:
                token = sampler.sample(logits)
            else:  # what the batch loop does for a constrained sequence
                token = matcher.sample(sampler, logits)
                if not tokenizer.is_eog(token):
                    matcher.accept(token)
            sampled = time.perf_counter()
            batch = Batch(positions=[PROMPT_TOKENS + step], sequences=[0], outputs=[0], tokens=[token])
            logits = model.graphs.compute(batch, copy=False)[0]
            steps.append(time.perf_counter() - started)
            sampling.append(sampled - started)
            at += 1
            if matcher is not None and (matcher.finished or tokenizer.is_eog(token)):
                masked += matcher.masks_computed
                matcher, at = vocab.matcher(grammar), 0  # a new request (its setup is timed below)
            elif matcher is None and at == len(steer):
                at = 0
        return steps, sampling, masked + (matcher.masks_computed if matcher is not None else 0)

    print(f"## Structured outputs: {MODEL} ({tokenizer.vocab_size} tokens), {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps} steps, load average {os.getloadavg()[0]:.1f} at start\n")
    print("| logits | sampler | step ms: plain | step ms: schema | ratio (median [quartiles]) "
          "| sampling ms: plain | sampling ms: schema | full masks |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    samplers = [("greedy", lambda: Sampler(temperature=0)), ("Ollama defaults", lambda: Sampler(seed=1))]
    for steered in (True, False):
        for name, make in samplers:
            ratios, steps, sampling, masked = [], {False: [], True: []}, {False: [], True: []}, 0
            decode(make(), False, steered), decode(make(), True, steered)  # warm-up
            for _ in range(args.rounds):
                medians = {}
                for constrained in (False, True):
                    times, sample_times, masks = decode(make(), constrained, steered)
                    steps[constrained] += times
                    sampling[constrained] += sample_times
                    masked += masks if constrained else 0
                    medians[constrained] = statistics.median(times)
                ratios.append(medians[True] / medians[False])
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            ms = {c: statistics.median(steps[c]) * 1e3 for c in steps}
            sms = {c: statistics.median(sampling[c]) * 1e3 for c in sampling}
            print(f"| {'steered (trained-like)' if steered else 'random (worst case)'} | {name} | {ms[False]:.2f} | "
                  f"{ms[True]:.2f} | {statistics.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}] | {sms[False]:.3f} | "
                  f"{sms[True]:.3f} | {masked}/{args.rounds * args.steps} |")

    print("\n| grammar setup | median ms | max ms |")
    print("|---|---:|---:|")
    print(f"| vocabulary for llguidance (once per model) | {vocab_seconds * 1e3:.0f} | — |")
    print(f"| new JSON schema (format -> grammar -> matcher) | {statistics.median(fresh) * 1e3:.2f} | "
          f"{max(fresh) * 1e3:.2f} |")
    print(f"| same schema again (compiled grammar copied) | {statistics.median(cached) * 1e3:.2f} | "
          f"{max(cached) * 1e3:.2f} |")
    bench.log(f"done, load {os.getloadavg()[0]:.1f}")
    model.close()


if __name__ == "__main__":
    main()
