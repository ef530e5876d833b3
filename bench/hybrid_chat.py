"""Time to first token of each turn of a multi-turn chat on a hybrid (recurrent) model, exact reuse on.

Usage:
    .venv/bin/python bench/hybrid_chat.py [--model lfm2-350m] [--turns 4] [--rounds 2] [--threads 2]

Each turn's prompt is the conversation so far (a system prompt, then user messages and the greedy answers).
"after": the runner as it is, the batch ending each prompt keeping recurrent checkpoints where the next turn
resumes (runner/exact.extension_resumes); "before": the same runner with those checkpoints turned off
(cache.resume_rule = None), as before issue 34's last gap was closed: a turn finds a checkpoint only at the
previous prompt's end, where exact reuse cannot resume, and evaluates its whole history. Both in this process,
alternating which goes first each round; turn 1 (nothing cached) is the same in both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import ensure_model, log  # noqa: E402

SYSTEM = "You are a patient storyteller. " + "Answer in short plain sentences about the sea and its people. " * 12
MESSAGE = "Tell me more about the old fisherman, his boat, his nets and the harbour on day {}. " * 3


def chat(path: Path, turns: int, threads: int, keep: bool) -> list[tuple[float, int, int]]:
    """(seconds to the first token, prompt inputs, cached inputs) of each turn."""
    from ollama_engine.runner.allocate import LoadParams, open_model
    from ollama_engine.runner.loop import Runner
    from ollama_engine.runner.sequence import SequenceOptions
    from ollama_engine.sample import Sampler

    loaded = open_model(str(path), LoadParams(parallel=1, batch_size=512, kv_size=4096, num_threads=threads),
                        allocate=True)
    loaded.model.backend.load()
    loaded.input_cache.exact = True
    if not keep:
        loaded.model.cache.resume_rule = None
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    runner.start()
    conversation, out = SYSTEM, []
    try:
        for turn in range(turns):
            conversation += "\nUser: " + MESSAGE.format(*[turn] * 3) + "\nAssistant:"
            seq = runner.new_sequence(conversation, SequenceOptions(sampler=Sampler(temperature=0), num_predict=16))
            done, first, text = threading.Event(), [], []

            def sink(piece, done=done, first=first, text=text) -> None:
                if piece is None:
                    done.set()
                else:
                    first.append(first[0] if first else time.perf_counter())
                    text.append(piece.text)

            start = time.perf_counter()
            runner.add(seq, sink)
            cached = seq.num_prompt_inputs - len(seq.inputs)
            if not done.wait(600) or errors:
                raise RuntimeError(f"no answer: {errors}")
            out.append((first[0] - start, seq.num_prompt_inputs, cached))
            conversation += "".join(text)
    finally:
        runner.close()
        loaded.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lfm2-350m")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = ensure_model(args.model)
    results: dict[str, list[list[tuple[float, int, int]]]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for name in (["after", "before"] if round_ % 2 == 0 else ["before", "after"]):
            results[name].append(chat(path, args.turns, args.threads, keep=name == "after"))
            log(f"round {round_} {name}: {results[name][-1]}")
    print(f"\n{args.model}, {args.threads} threads, exact reuse on; time to first token per turn, median of "
          f"{args.rounds} rounds\n")
    print("| turn | prompt inputs | before: cached | before ms | after: cached | after ms | before / after |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for turn in range(args.turns):
        b = [r[turn] for r in results["before"]]
        a = [r[turn] for r in results["after"]]
        bm, am = 1000 * statistics.median(x[0] for x in b), 1000 * statistics.median(x[0] for x in a)
        print(f"| {turn + 1} | {a[0][1]} | {b[0][2]} | {bm:.0f} | {a[0][2]} | {am:.0f} | {bm / am:.2f} |")


if __name__ == "__main__":
    main()
