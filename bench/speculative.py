"""Speculative decoding (n-grams, or a draft model) against plain decoding, in one process, A/B interleaved.

Usage:
    .venv/bin/python bench/speculative.py [--models smollm2-135m-instruct,gemma-3-270m] [--rounds 4]
        [--threads 2] [--llama-cpp] [--draft LAYERS[:TYPE]]

Two tasks, greedy, through the runner's batch loop (runner/loop.py, in process, no HTTP):
  (a) copy: a ~1000-token text (this repository's DESIGN notes) to be repeated exactly; 256 tokens generated;
  (b) chat: a free story prompt; 160 tokens generated.
Each round runs every (task, plain|spec) once, the order of plain and spec swapped every round, so that the
drift of a shared machine hits both sides of a round alike; a prompt-cache hit makes every prompt evaluation
after the first short, and only the decode phase is timed (first token to last, sampling and lookups
included). Reported: the median tokens/s of each side, the median of the per-round ratios, the acceptance
(accepted / drafted tokens), and that the spec run's tokens equal the plain run's.

--draft: the speculating side is a second runner loaded with a draft model instead of n-grams; the draft is cut
from the target (tests/synthetic/draft.py: its first LAYERS layers, requantized to TYPE if given), as no smaller
real model shares SmolLM2's vocabulary. Drafts are written once under ~/.cache/ollama-engine/drafts.

--llama-cpp adds llama-cpp-python's own prompt-lookup speculation (Llama(draft_model=
LlamaPromptLookupDecoding)), same GGUF and threads, plain and speculative, interleaved the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from synthetic.draft import write_draft  # noqa: E402

from ollama_engine.fs.real_models import fetch  # noqa: E402
from ollama_engine.runner.allocate import LoadParams, open_model  # noqa: E402
from ollama_engine.runner.loop import Runner  # noqa: E402
from ollama_engine.runner.sequence import SequenceOptions  # noqa: E402
from ollama_engine.sample import Sampler  # noqa: E402

DRAFTS = Path.home() / ".cache" / "ollama-engine" / "drafts"


def copy_text(tokenizer, tokens: int = 1000) -> str:
    """About `tokens` tokens of plain prose from the design notes (their first paragraphs, markup removed)."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line and not line.startswith(("#", "|", "```", "-", "    ", "<"))]
    text = ""
    for line in lines:
        text += line + "\n"
        if len(tokenizer.encode(text, add_special=False)) >= tokens:
            break
    return text


def chat(tokenizer, user: str) -> str:
    """The user message in the model's chat template (SmolLM2's ChatML or Gemma's turns)."""
    if tokenizer.vocab.tokens.count("<start_of_turn>"):
        return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def run(runner: Runner, prompt: str, spec: bool, n: int) -> tuple[float, list[int], int, int]:
    """tokens/s of the decode phase, the tokens, drafted and accepted counts."""
    done, tokens = threading.Event(), []
    options = SequenceOptions(sampler=Sampler(temperature=0), num_predict=n, spec_ngram=spec, logprobs=True)

    def sink(piece) -> None:
        if piece is None:
            done.set()
        else:
            tokens.extend(e["token"] for e in piece.logprobs)

    seq = runner.new_sequence(prompt, options)
    runner.add(seq, sink)
    done.wait()
    seconds = seq.last_updated_at - (seq.started_at or 0)
    drafted, accepted = (seq.spec.drafted, seq.spec.accepted) if seq.spec else (0, 0)
    return (seq.num_predicted - 1) / seconds, tokens, drafted, accepted


class LlamaCppSide:
    """llama-cpp-python's high-level Llama, with and without its speculation: its prompt-lookup draft model, or
    (draft given) the same draft GGUF as ours decoding greedily in a second Llama (`llama_cpp_draft`)."""

    def __init__(self, path: Path, threads: int, draft: Path | None = None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                      verbose=False, flash_attn=True)
        self.plain = Llama(**common)
        drafter = llama_cpp_draft(draft, threads) if draft else LlamaPromptLookupDecoding(num_pred_tokens=10)
        self.spec = Llama(**common, draft_model=drafter, logits_all=True)  # its loop reads every row's logits

    def run(self, prompt: str, spec: bool, n: int) -> float:
        llm = self.spec if spec else self.plain
        llm.create_completion(prompt, max_tokens=1, temperature=0)  # the prompt evaluated (and cached)
        start = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=n, temperature=0)
        return out["usage"]["completion_tokens"] / (time.perf_counter() - start)


def llama_cpp_draft(path: Path, threads: int, k: int = 6):
    """A LlamaDraftModel for llama-cpp-python's speculative loop: a second Llama on the draft GGUF keeps the
    common prefix of its cache and the text, evaluates the rest and proposes k greedy tokens (no llama-server
    binary here to run llama.cpp's own `--model-draft`)."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads,
                             n_threads_batch=threads, verbose=False, flash_attn=True)

        def __call__(self, input_ids, /, **kwargs):
            llm, ids = self.llm, input_ids.tolist()
            common = 0
            for a, b in zip(llm.input_ids[:llm.n_tokens].tolist(), ids[:-1], strict=False):
                if a != b:
                    break
                common += 1
            llm.n_tokens = common  # eval removes the cells past it
            llm.eval(ids[common:])
            drafts: list[int] = []
            while True:
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                drafts.append(int(np.argmax(logits)))
                if len(drafts) == k:
                    return np.array(drafts, dtype=np.intc)
                llm.eval(drafts[-1:])

    return GreedyDraft()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--draft", default="", help="LAYERS[:TYPE]: a draft model cut from the target")
    parser.add_argument("--scale", type=float, default=1.0, help="generated tokens scaled (a quick trial run)")
    args = parser.parse_args()
    for name in args.models.split(","):
        path = fetch(name, quiet=True)
        runner, loaded = start_runner(path, args.threads, "")
        sides = {False: (runner, False), True: (runner, True)}  # (runner, spec_ngram)
        if args.draft:
            layers, _, qtype = args.draft.partition(":")
            DRAFTS.mkdir(parents=True, exist_ok=True)
            draft = write_draft(path, DRAFTS / f"{path.stem}-{layers}{qtype and '-' + qtype}.gguf", int(layers),
                                qtype or None)
            draft_runner, draft_loaded = start_runner(path, args.threads, str(draft))
            sides[True] = (draft_runner, False)
        tokenizer = loaded.model.tokenizer
        text = copy_text(tokenizer)
        tasks = {
            "copy": (chat(tokenizer, "Repeat the following text exactly, word for word:\n\n" + text), 256),
            "chat": (chat(tokenizer, "Write a short story about a dragon who learns to bake bread."), 160),
        }
        n_prompt = {task: len(tokenizer.encode(prompt, add_special=True)) for task, (prompt, _) in tasks.items()}
        llama = LlamaCppSide(path, args.threads, draft if args.draft else None) if args.llama_cpp else None
        for task, (prompt, n) in tasks.items():
            n = max(int(n * args.scale), 8)
            for side_runner, _ in sides.values():
                run(side_runner, prompt, False, 4)  # warm: the prompt in the cache
            plain, spec, ratios, accept, same = [], [], [], [], True
            lc_plain, lc_spec = [], []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                results = {}
                for side in order:
                    started = time.perf_counter()
                    results[side] = run(sides[side][0], prompt, sides[side][1], n)
                    print(f"  round {r} {task} {'spec' if side else 'plain'}: {results[side][0]:.1f} tok/s "
                          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
                    if llama is not None:
                        (lc_spec if side else lc_plain).append(llama.run(prompt, side, n))
                plain.append(results[False][0])
                spec.append(results[True][0])
                ratios.append(results[True][0] / results[False][0])
                drafted, accepted = results[True][2], results[True][3]
                accept.append(accepted / drafted if drafted else 0.0)
                same &= results[True][1] == results[False][1]
            line = (f"{name} {task} (prompt {n_prompt[task]}, {n} generated): plain {statistics.median(plain):.1f} "
                    f"tok/s, spec {statistics.median(spec):.1f} tok/s, ratio median {statistics.median(ratios):.2f} "
                    f"(min {min(ratios):.2f}, max {max(ratios):.2f}), acceptance {statistics.median(accept):.0%}, "
                    f"tokens equal: {same}, rows cap {runner.spec_rows}{', draft ' + args.draft if args.draft else ''}")
            if llama is not None:
                line += (f"; llama-cpp-python plain {statistics.median(lc_plain):.1f}, "
                         f"{'draft model' if args.draft else 'prompt lookup'} "
                         f"{statistics.median(lc_spec):.1f} tok/s "
                         f"(x{statistics.median(s / p for s, p in zip(lc_spec, lc_plain, strict=True)):.2f})")
            print(line, flush=True)
        runner.close()
        loaded.close()
        if args.draft:
            draft_runner.close()
            draft_loaded.close()


def start_runner(path: Path, threads: int, draft: str) -> tuple[Runner, object]:
    params = LoadParams(parallel=1, batch_size=512, kv_size=4096, num_threads=threads, flash_attention=1,
                        draft_path=draft)
    loaded = open_model(str(path), params, allocate=True)
    loaded.load()
    runner = Runner(loaded, lambda err: sys.exit(f"runner failed: {err}"))
    runner.start()
    return runner, loaded


if __name__ == "__main__":
    main()
