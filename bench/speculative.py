"""Speculative decoding (n-grams, or a draft model) against plain decoding, in one process, A/B interleaved.

Usage:
    .venv/bin/python bench/speculative.py [--models smollm2-135m-instruct,gemma-3-270m] [--rounds 4]
        [--threads 2] [--llama-cpp] [--llama-server [PATH]] [--llama-spec ARGS] [--draft LAYERS[:TYPE]]

Two tasks, greedy, through the runner's batch loop (runner/loop.py, in process, no HTTP):
  (a) copy: a ~1000-token text (this repository's DESIGN notes) to be repeated exactly; 256 tokens generated;
  (b) chat: a free story prompt; 160 tokens generated.
Each round runs every (task, plain|spec) once, the order of plain and spec swapped every round, so that the
drift of a shared machine hits both sides of a round alike; a prompt-cache hit makes every prompt evaluation
after the first short, and only the decode phase is timed (first token to last, sampling and lookups
included). Reported: the median tokens/s of each side, the median of the per-round ratios, the acceptance
(accepted / drafted tokens), and that the spec run's output equals the plain run's (ours: the text, without
logprobs, which would cost ours a log-softmax over the vocabulary per token that llama-server's side does not
pay; the tests compare logprobs bitwise; llama-server: its token ids).

--draft: the runner is loaded with a draft model, which the speculating side's requests use instead of n-grams
(the plain side's requests drop their speculator); the draft is cut from the target (tests/synthetic/draft.py:
its first LAYERS layers, requantized to TYPE if given), as no smaller real model shares SmolLM2's vocabulary.
Drafts are written once under ~/.cache/ollama-engine/drafts.

--llama-cpp adds llama-cpp-python's own prompt-lookup speculation (Llama(draft_model=
LlamaPromptLookupDecoding)), same GGUF and threads, plain and speculative, interleaved the same way.

--llama-server adds llama.cpp's own speculation in its server (built from the pinned source by
`bench/serve_bench.py --build-llama-server`): two llama-server processes on the same GGUF and threads, one
plain and one speculating (--llama-spec, default `--spec-type ngram-simple`, its n-gram lookup with its
defaults; with --draft, `-md` and the same draft GGUF as ours with `--spec-type draft-simple`, without which
the pinned llama-server loads the draft and never drafts; llama.cpp's draft defaults), each request
/completion greedy with the prompt cached, in the same rounds right after our run of the same side. Its
tokens/s is its own `timings.predicted_per_second` (tokens after the first over the time from the first to
the last, as ours), its acceptance `draft_n_accepted / draft_n`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from serve_bench import LLAMA_SERVER, wait_http  # noqa: E402
from serve_process import free_port  # noqa: E402
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


def run(runner: Runner, prompt: str, spec: bool, n: int) -> tuple[float, list[str], int, int]:
    """tokens/s of the decode phase, the text (one string), drafted and accepted counts. spec: n-grams, or the
    runner's draft model where it has one; without, plain decoding (a draft model's runner then drops the request's
    speculator)."""
    done, pieces = threading.Event(), []
    options = SequenceOptions(sampler=Sampler(temperature=0), num_predict=n, spec_ngram=spec)

    def sink(piece) -> None:
        if piece is None:
            done.set()
        else:
            pieces.append(piece.text)

    seq = runner.new_sequence(prompt, options)
    if not spec:
        seq.spec = None
    runner.add(seq, sink)
    done.wait()
    seconds = seq.last_updated_at - (seq.started_at or 0)
    drafted, accepted = (seq.spec.drafted, seq.spec.accepted) if seq.spec else (0, 0)
    return (seq.num_predicted - 1) / seconds, ["".join(pieces)], drafted, accepted


class LlamaCppSide:
    """llama-cpp-python's high-level Llama, with and without its speculation: its prompt-lookup draft model, or
    (draft given) the same draft GGUF as ours decoding greedily in a second Llama (`llama_cpp_draft`)."""

    def __init__(self, path: Path, threads: int, draft: Path | None, flash: bool) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                      verbose=False, flash_attn=flash)
        self.plain = Llama(**common)
        drafter = llama_cpp_draft(draft, threads, flash) if draft else LlamaPromptLookupDecoding(num_pred_tokens=10)
        self.spec = Llama(**common, draft_model=drafter, logits_all=True)  # its loop reads every row's logits

    def run(self, prompt: str, spec: bool, n: int) -> float:
        llm = self.spec if spec else self.plain
        llm.create_completion(prompt, max_tokens=1, temperature=0)  # the prompt evaluated (and cached)
        start = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=n, temperature=0)
        return out["usage"]["completion_tokens"] / (time.perf_counter() - start)


class LlamaServerSide:
    """llama.cpp's server, plain and speculating (two processes, the same GGUF, threads and context as ours)."""

    def __init__(self, urls: dict[bool, str]) -> None:
        self.urls = urls

    @classmethod
    @contextlib.contextmanager
    def started(cls, binary: Path, model: Path, threads: int, spec_args: list[str],
                flash: bool) -> Iterator[LlamaServerSide]:
        with contextlib.ExitStack() as stack:
            urls = {spec: stack.enter_context(llama_server(binary, model, threads, spec_args if spec else [], flash))
                    for spec in (False, True)}
            yield cls(urls)

    def run(self, prompt: str, spec: bool, n: int) -> tuple[float, list[int], int, int]:
        """tokens/s of the decode phase (its own timings), the tokens, drafted and accepted counts."""
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": True, "return_tokens": True}
        request = urllib.request.Request(self.urls[spec] + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            out = json.load(response)
        timings = out["timings"]
        return (timings["predicted_per_second"], out["tokens"], timings.get("draft_n", 0),
                timings.get("draft_n_accepted", 0))


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, threads: int, extra: list[str], flash: bool) -> Iterator[str]:
    """One llama-server with our runner's settings (one slot, 4096 context, batch 512, f16 cache, flash attention
    on or off)."""
    port = free_port()
    command = [str(binary), "-m", str(model), "--port", str(port), "-np", "1", "-c", "4096", "-t", str(threads),
               "-tb", str(threads), "-b", "512", "-ctk", "f16", "-ctv", "f16", "-fa", "on" if flash else "off",
               "--no-webui", *extra]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", server)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()


def llama_cpp_draft(path: Path, threads: int, flash: bool, k: int = 6):
    """A LlamaDraftModel for llama-cpp-python's speculative loop: a second Llama on the draft GGUF keeps the
    common prefix of its cache and the text, evaluates the rest and proposes k greedy tokens (no llama-server
    binary here to run llama.cpp's own `--model-draft`)."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = Llama(model_path=str(path), n_ctx=4096, n_batch=512, n_threads=threads,
                             n_threads_batch=threads, verbose=False, flash_attn=flash)

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
    parser.add_argument("--llama-server", type=Path, nargs="?", const=LLAMA_SERVER, default=None,
                        help="also llama.cpp's server, plain and speculating (its binary; default the pinned build)")
    parser.add_argument("--llama-spec", default="--spec-type ngram-simple",
                        help="llama-server's speculation arguments without --draft (with it: -md DRAFT)")
    parser.add_argument("--draft", default="", help="LAYERS[:TYPE]: a draft model cut from the target")
    parser.add_argument("--flash-attention", choices=("off", "on"), default="off",
                        help="on every side (off: serve's default; on: llama-server's `auto` on the CPU)")
    parser.add_argument("--scale", type=float, default=1.0, help="generated tokens scaled (a quick trial run)")
    args = parser.parse_args()
    for name in args.models.split(","):
        with contextlib.ExitStack() as stack:
            bench_model(name, args, stack)


def bench_model(name: str, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    """Every task on one model: ours plain and speculating, and the llama.cpp sides asked for, interleaved."""
    path = fetch(name, quiet=True)
    flash = args.flash_attention == "on"
    draft = None
    if args.draft:
        layers, _, qtype = args.draft.partition(":")
        DRAFTS.mkdir(parents=True, exist_ok=True)
        draft = write_draft(path, DRAFTS / f"{path.stem}-{layers}{qtype and '-' + qtype}.gguf", int(layers),
                            qtype or None)
    # one runner for both sides: with a draft model, its plain requests drop their speculator. Two runners are two
    # compute threads, two OpenMP pools in one process: libgomp then stops spinning between parallel regions
    # (RESULTS, "The slow single stream after four streams"), and the plain side ran at 24 tok/s beside a second
    # runner, 40 alone
    runner, loaded = stack.enter_context(started_runner(path, args.threads, str(draft or ""), flash))
    tokenizer = loaded.model.tokenizer
    text = copy_text(tokenizer)
    tasks = {
        "copy": (chat(tokenizer, "Repeat the following text exactly, word for word:\n\n" + text), 256),
        "chat": (chat(tokenizer, "Write a short story about a dragon who learns to bake bread."), 160),
    }
    n_prompt = {task: len(tokenizer.encode(prompt, add_special=True)) for task, (prompt, _) in tasks.items()}
    llama = LlamaCppSide(path, args.threads, draft, flash) if args.llama_cpp else None
    server = None
    if args.llama_server is not None:
        spec_args = ["-md", str(draft), "--spec-type", "draft-simple"] if draft else shlex.split(args.llama_spec)
        server = stack.enter_context(LlamaServerSide.started(args.llama_server, path, args.threads, spec_args, flash))
    for task, (prompt, n) in tasks.items():
        n = max(int(n * args.scale), 8)
        run(runner, prompt, False, 4)  # warm: the prompt in the cache
        if server is not None:
            for spec in (False, True):
                server.run(prompt, spec, 4)
        ours, theirs, lc = Sides(), Sides(), Sides()
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for side in order:
                started = time.perf_counter()
                ours.add(side, run(runner, prompt, side, n))
                print(f"  round {r} {task} {'spec' if side else 'plain'}: {ours.rows[side][-1][0]:.1f} tok/s "
                      f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
                if server is not None:
                    theirs.add(side, server.run(prompt, side, n))
                    print(f"  round {r} {task} llama-server {'spec' if side else 'plain'}: "
                          f"{theirs.rows[side][-1][0]:.1f} tok/s", file=sys.stderr, flush=True)
                if llama is not None:
                    lc.add(side, (llama.run(prompt, side, n), [], 0, 0))
        costs = ", ".join(f"{rows}: {1e3 * s:.1f}" for rows, s in runner.step_cost.measured().items())
        if draft is not None:
            costs += f"; a draft step {1e3 * loaded.draft.step_seconds:.1f}"
        line = (f"{name} {task} (prompt {n_prompt[task]}, {n} generated): {ours.summary()}, rows cap "
                f"{runner.spec_rows}{', draft ' + args.draft if args.draft else ''}, ms per step by rows {{{costs}}}")
        if server is not None:
            line += f"; llama-server ({' '.join(spec_args)}): {theirs.summary()}"
        if llama is not None:
            line += (f"; llama-cpp-python plain {statistics.median(lc.speeds(False)):.1f}, "
                     f"{'draft model' if args.draft else 'prompt lookup'} {statistics.median(lc.speeds(True)):.1f} "
                     f"tok/s (x{statistics.median(lc.ratios()):.2f})")
        print(line, flush=True)


class Sides:
    """One engine's runs of a task, plain (False) and speculating (True), round by round."""

    def __init__(self) -> None:
        self.rows: dict[bool, list[tuple[float, list[int], int, int]]] = {False: [], True: []}

    def add(self, spec: bool, result: tuple[float, list[int], int, int]) -> None:
        self.rows[spec].append(result)

    def speeds(self, spec: bool) -> list[float]:
        return [row[0] for row in self.rows[spec]]

    def ratios(self) -> list[float]:
        return [s / p for s, p in zip(self.speeds(True), self.speeds(False), strict=True)]

    def summary(self) -> str:
        """Median tokens/s of each side, the median (min-max) of the rounds' ratios, acceptance, same tokens."""
        ratios = self.ratios()
        accept = [row[3] / row[2] if row[2] else 0.0 for row in self.rows[True]]
        same = all(s[1] == p[1] for s, p in zip(self.rows[True], self.rows[False], strict=True))
        return (f"plain {statistics.median(self.speeds(False)):.1f} tok/s, spec "
                f"{statistics.median(self.speeds(True)):.1f} tok/s, ratio median {statistics.median(ratios):.2f} "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f}), acceptance {statistics.median(accept):.0%} "
                f"({sum(r[3] for r in self.rows[True])}/{sum(r[2] for r in self.rows[True])}), "
                f"output equal: {same}")


@contextlib.contextmanager
def started_runner(path: Path, threads: int, draft: str, flash: bool) -> Iterator[tuple[Runner, object]]:
    runner, loaded = start_runner(path, threads, draft, flash)
    try:
        yield runner, loaded
    finally:
        runner.close()
        loaded.close()


def start_runner(path: Path, threads: int, draft: str, flash: bool) -> tuple[Runner, object]:
    params = LoadParams(parallel=1, batch_size=512, kv_size=4096, num_threads=threads, flash_attention=int(flash),
                        draft_path=draft)
    loaded = open_model(str(path), params, allocate=True)
    loaded.load()
    runner = Runner(loaded, lambda err: sys.exit(f"runner failed: {err}"))
    runner.start()
    return runner, loaded


if __name__ == "__main__":
    main()
