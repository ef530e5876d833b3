"""llama.cpp through its low-level API, fed exactly the batches our engine computes.

The high-level llama_cpp.Llama evaluates one sequence; comparing multi-sequence batches and cache
types needs the context parameters and llama_batch directly. One KV stream per sequence
(kv_unified=False) is the layout our cache uses, so the same batches are the same ggml operations.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model

CACHE_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type values


class Reference:
    """A llama.cpp context on one GGUF: decode(batch) returns the logits of the rows that ask for them."""

    def __init__(self, path: Path, *, n_ctx: int = 1024, n_batch: int = 512, sequences: int = 1,
                 flash_attention: bool = False, cache_type: str = "f16", value_cache_type: str | None = None,
                 threads: int = 2):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * sequences
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = sequences
        params.kv_unified = False
        params.swa_full = False  # llama-server's default: sliding-window layers keep n_swa + n_ubatch cells
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = 1 if flash_attention else 0
        params.type_k = CACHE_TYPES[cache_type]
        params.type_v = CACHE_TYPES[value_cache_type or cache_type]
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create the context")
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], sequences: Sequence[int],
               outputs: Sequence[int]) -> np.ndarray:
        """One llama_decode of these tokens; logits (len(outputs), vocab) in the order of `outputs`."""
        batch, wanted = self.batch, set(outputs)
        batch.n_tokens = len(tokens)
        for i, (token, position, seq) in enumerate(zip(tokens, positions, sequences, strict=True)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i in wanted
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for i in outputs:
            pointer = self.lib.llama_get_logits_ith(self.ctx, i)
            rows.append(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                              shape=(self.vocab_size,)).copy())
        return np.stack(rows)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


PROMPTS = ("In a small village by the sea, there lived", "Once upon a time there was a king who")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_schedule(path: Path, *, flash: bool, cache_type: str, sequences: int, steps: int = 8,
                     tolerance: float = 1e-4, threads: int = 2, prompts: Sequence[str] = PROMPTS,
                     value_cache_type: str | None = None) -> float:
    """Ours and llama.cpp on one schedule: the prompts of `sequences` sequences (different lengths) in
    one batch, then `steps` batches decoding one token for each. Every logprob within `tolerance` and
    identical greedy tokens; returns the largest logprob difference seen.

    Prompts of different lengths would make llama.cpp split the batch (one equal share per sequence, then
    the rest in a second graph), and ggml's kernels round a row differently in batches of other sizes on
    some CPUs: so both engines are fed llama.cpp's split (`equal_shares`), batch for batch."""
    model = load_model(path, num_threads=threads, flash_attention=flash)
    model.rows_alone = False  # llama.cpp rounds a row by its whole batch's size: replay that, batch for batch
    model.backend.load()
    model.cache.init(model.backend, cache_dtype(cache_type), sequences, 512, 64,
                     value_dtype=cache_dtype(value_cache_type or cache_type))
    reference = Reference(path, n_ctx=512, n_batch=64, sequences=sequences, flash_attention=flash,
                          cache_type=cache_type, value_cache_type=value_cache_type, threads=threads)
    worst = 0.0
    try:
        texts = [model.tokenizer.encode(prompt, add_special=True) for prompt in prompts[:sequences]]
        for step in range(steps + 1):
            ours, theirs = [None] * sequences, [None] * sequences
            for batch in equal_shares(texts) if step == 0 else [decode_batch(texts)]:
                last = [int(s) for s in batch.sequences[batch.outputs]]
                for seq, mine, other in zip(last, model.graphs.compute(batch), reference.decode(
                        batch.tokens, batch.positions, batch.sequences, batch.outputs), strict=True):
                    ours[seq], theirs[seq] = mine, other
            ours, theirs = np.stack(ours), np.stack(theirs)
            difference = float(np.abs(log_softmax(ours) - log_softmax(theirs)).max())
            worst = max(worst, difference)
            assert difference < tolerance, f"step {step}: logprobs differ by {difference}"
            assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all(), f"step {step}: greedy tokens differ"
            for text, row in zip(texts, ours, strict=True):
                text.append(int(row.argmax()))
    finally:
        reference.close()
        model.close()
    return worst


def decode_batch(texts: Sequence[list[int]]) -> Batch:
    """One decode step: the last token of every sequence."""
    return Batch(positions=[len(t) - 1 for t in texts], sequences=range(len(texts)), outputs=range(len(texts)),
                 tokens=[t[-1] for t in texts])


def equal_shares(texts: Sequence[list[int]]) -> list[Batch]:
    """The prompts in the batches llama.cpp's split_equal cuts them into (one KV stream per sequence): each
    batch takes an equal share of every sequence that has tokens left, its last one asking for logits."""
    batches, done = [], 0
    while any(len(t) > done for t in texts):
        active = [s for s, t in enumerate(texts) if len(t) > done]
        share = min(len(texts[s]) for s in active) - done
        rows = [(s, p) for s in active for p in range(done, done + share)]
        ends = [i for i, (s, p) in enumerate(rows) if p == len(texts[s]) - 1]
        batches.append(Batch(positions=[p for _, p in rows], sequences=[s for s, _ in rows], outputs=ends,
                             tokens=[texts[s][p] for s, p in rows]))
        done += share
    return batches


_KV_REPORT = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")


def llama_kv_report(path: Path, *, n_ctx: int, n_batch: int, sequences: int = 1, flash_attention: bool = False,
                    cache_type: str = "f16", value_cache_type: str | None = None) -> list[tuple[float, int, int]]:
    """llama.cpp's own report of the KV caches it allocates for a context: (MiB, cells, layers) per cache."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        Reference(path, n_ctx=n_ctx, n_batch=n_batch, sequences=sequences, flash_attention=flash_attention,
                  cache_type=cache_type, value_cache_type=value_cache_type).close()
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    return [(float(m[1]), int(m[2]), int(m[3])) for m in map(_KV_REPORT.search, lines) if m]
