"""How far a prompt-cache hit lands from a cold run, per architecture, with exact reuse and without.

For each architecture (a synthetic model per weight type, or a real GGUF given with --model) it plays a
two-turn conversation the way the runner computes it: turn 1's prompt in batches of --batch, then its
answer decoded one token at a time; turn 2 (turn 1 + answer + a new question) cold, in batches from 0,
and as a hit, resumed where the runner's input cache resumes it (runner/exact.py with exact reuse, the
longest common prefix without). It prints the largest logprob difference of turn 2's first token and of
8 greedy tokens after it, with flash attention on and off.

    .venv/bin/python bench/cache_hit_numerics.py                       # every synthetic architecture
    .venv/bin/python bench/cache_hit_numerics.py --model PATH.gguf     # a real model
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.ml import DType
from ollama_engine.models import load_model
from ollama_engine.runner.exact import resume_point, row_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the synthetic models
from synthetic.models import ARCHITECTURES, write_synthetic  # noqa: E402

TURN1 = "Tell me a short story about a lighthouse keeper and a storm at sea, in a few sentences."
TURN2 = " And what happened to the keeper's cat the next morning?"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class Session:
    """One model, one sequence: evaluate tokens in given cuts, record each input's kernel class."""

    def __init__(self, path: Path, flash: bool, batch: int):
        self.model = load_model(path, num_threads=2, flash_attention=flash)
        self.model.backend.load()
        self.model.cache.init(self.model.backend, DType.F16, 1, 1024, batch)
        self.batch = batch
        self.kernels = bytearray()

    def evaluate(self, tokens: list[int], start: int, cuts: list[int]) -> np.ndarray:
        out = None
        for size in cuts:
            batch = Batch(positions=range(start, start + size), sequences=[0] * size, outputs=[size - 1],
                          tokens=tokens[start:start + size])
            out = self.model.graphs.compute(batch)[0]
            del self.kernels[start:]
            self.kernels += row_kernels(range(size), size, size)
            start += size
        return out

    def prompt(self, tokens: list[int], start: int) -> np.ndarray:
        """tokens[start:] cut at multiples of the batch size, as the runner cuts a prompt."""
        cuts, position = [], start
        while position < len(tokens):
            stop = min((position // self.batch + 1) * self.batch, len(tokens))
            cuts.append(stop - position)
            position = stop
        return self.evaluate(tokens, start, cuts)

    def generate(self, tokens: list[int], logits: np.ndarray, count: int) -> list[np.ndarray]:
        """Greedy tokens appended to `tokens`, each evaluated alone; the log-probabilities of each."""
        out = []
        for _ in range(count):
            out.append(log_softmax(logits))
            tokens.append(int(np.argmax(logits)))
            logits = self.evaluate(tokens, len(tokens) - 1, [1])
        return out

    def close(self) -> None:
        self.model.close()


def measure(path: Path, flash: bool, exact: bool, batch: int) -> float:
    first = Session(path, flash, batch)
    try:
        tokens = first.model.tokenizer.encode(TURN1)
        first.generate(tokens, first.prompt(tokens, 0), 8)  # turn 1: the answer, decoded
        turn2 = tokens[:-1] + first.model.tokenizer.encode(TURN2, add_special=False)
        common = len(tokens) - 1  # the last answer token was sampled, never evaluated
        resume = resume_point(first.kernels, common, len(turn2), batch) if exact else common
        first.model.cache.remove(0, resume)
        hit = first.generate(list(turn2), first.prompt(turn2, resume), 8)
    finally:
        first.close()
    cold_session = Session(path, flash, batch)
    try:
        cold = cold_session.generate(list(turn2), cold_session.prompt(turn2, 0), 8)
    finally:
        cold_session.close()
    return max(float(np.abs(a - b).max()) for a, b in zip(hit, cold, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", default=[], help="a GGUF (repeatable)")
    parser.add_argument("--weight-type", action="append", default=[], help="synthetic weights (default F16, Q4_0)")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        models = [(path.name, path) for path in args.model]
        if not models:
            for weight_type in args.weight_type or ["F16", "Q4_0"]:
                for arch in ARCHITECTURES:
                    if "bert" not in arch:
                        path = write_synthetic(Path(folder) / f"{arch}-{weight_type}.gguf", arch,
                                               weight_type=weight_type)
                        models.append((f"{arch} {weight_type}", path))
        print(f"{'model':28} {'flash on, exact':>16} {'flash on, longest':>18} {'flash off, exact':>17} "
              f"{'flash off, longest':>19}")
        for name, path in models:
            cells = [measure(path, flash, exact, args.batch) for flash in (True, False) for exact in (True, False)]
            print(f"{name:28} " + " ".join(f"{c:>{w}.3g}" for c, w in zip(cells, (16, 18, 17, 19), strict=True)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
