"""A small in-process generator: what `ollama-engine generate` runs, with no runner or server.

Tokenize the prompt, feed it to the model in batches, then sample one token at a time (greedy at
temperature 0) until the model says end of generation, n tokens are out, or the context is full.
Text is written as soon as it forms whole UTF-8 characters; logs go to the logging module (stderr).
"""

from __future__ import annotations

import codecs
import logging
import os
import sys
import time
from typing import TextIO

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.ml import DType
from ollama_engine.models import Model, load_model
from ollama_engine.sample import Sampler

log = logging.getLogger(__name__)

BATCH_SIZE = 512
DEFAULT_CONTEXT = 4096  # when the file states no context length


def prefill(
    model: Model, tokens: list[int], position: int = 0, batch_size: int = BATCH_SIZE, *, copy: bool = True
) -> np.ndarray:
    """Feed tokens from `position` on in batches of batch_size; the logits of the last token.

    With copy=False they may be a view that the model's next computation overwrites (see Graphs.compute).
    """
    if not tokens:
        raise ValueError("nothing to evaluate: no tokens")
    logits = None
    for start in range(0, len(tokens), batch_size):
        chunk = tokens[start : start + batch_size]
        last = start + len(chunk) == len(tokens)
        batch = Batch(
            positions=np.arange(position + start, position + start + len(chunk), dtype=np.int32),
            sequences=np.zeros(len(chunk), dtype=np.int32),
            outputs=np.array([len(chunk) - 1] if last else [], dtype=np.int32),
            tokens=np.array(chunk, dtype=np.int32),
        )
        logits = model.graphs.compute(batch, copy=copy)
    assert logits is not None
    return logits[0]


def generate(
    model_path: str | os.PathLike[str],
    prompt: str,
    n: int = 128,
    temperature: float = 0.0,
    seed: int = -1,
    out: TextIO = sys.stdout,
    *,
    num_threads: int | None = None,
) -> list[int]:
    """Write the continuation of `prompt` to `out` as it is produced; returns the generated token ids.

    n < 0 generates until end of generation or a full context. Temperature above 0 samples with
    Ollama's default top-k 40 and top-p 0.9, reproducibly for a given seed (-1: a random one).
    """
    model = load_model(model_path, num_threads=num_threads)
    try:
        return _generate(model, prompt, n, Sampler(temperature=temperature, seed=seed), out)
    finally:
        model.close()


def _generate(model: Model, prompt: str, n: int, sampler: Sampler, out: TextIO) -> list[int]:
    tokenizer, cache = model.tokenizer, model.cache
    if tokenizer is None or cache is None:
        raise ValueError("generate needs a text model with a tokenizer and a KV cache")
    tokens = tokenizer.encode(prompt)
    context = model.config.get_uint("context_length", DEFAULT_CONTEXT) or DEFAULT_CONTEXT
    if len(tokens) >= context:
        raise ValueError(f"the prompt ({len(tokens)} tokens) does not fit the context of {context} tokens")
    room = context - len(tokens)
    n = room if n < 0 else min(n, room)
    if n == 0:
        return []
    started = time.perf_counter()
    model.backend.load()
    cache.init(model.backend, DType.F16, 1, len(tokens) + n, min(BATCH_SIZE, len(tokens) + n))
    log.info("model loaded in %.2fs", time.perf_counter() - started)

    started = time.perf_counter()
    logits = prefill(model, tokens, 0, min(BATCH_SIZE, len(tokens) + n), copy=False)  # sampled at once
    log.info("prompt: %d tokens in %.2fs", len(tokens), time.perf_counter() - started)

    started = time.perf_counter()
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    generated: list[int] = []
    while True:
        token = sampler.sample(logits)
        if tokenizer.is_eog(token):
            break
        generated.append(token)
        out.write(text.decode(tokenizer.vocab.piece(token, special=False)))
        out.flush()
        if len(generated) == n:
            break
        position = len(tokens) + len(generated) - 1
        batch = Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token])
        logits = model.graphs.compute(batch, copy=False)[0]
    out.write(text.decode(b"", final=True))
    out.flush()
    log.info("generated %d tokens in %.2fs", len(generated), time.perf_counter() - started)
    return generated
