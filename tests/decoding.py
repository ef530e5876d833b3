"""Greedy decoding of several prompts batched together, the logits of every step: what the architectures'
batched == solo tests compare (one copy, for every test file that needs it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model


def decode_together(model, prompts: Sequence[str], seqs: list[int], steps: int) -> dict[int, list[np.ndarray]]:
    """Each sequence's logits over its prompt's last token and `steps - 1` greedy decode steps, the sequences
    prefilled in one batch and decoded together (sequence s reads prompts[s])."""
    texts = {s: model.tokenizer.encode(prompts[s], add_special=True) for s in seqs}
    batch = Batch(positions=[p for s in seqs for p in range(len(texts[s]))],
                  sequences=[s for s in seqs for _ in texts[s]],
                  outputs=np.cumsum([len(texts[s]) for s in seqs]) - 1, tokens=[t for s in seqs for t in texts[s]])
    logits: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
    for _ in range(steps):
        for s, row in zip(seqs, model.graphs.compute(batch), strict=True):
            logits[s].append(row)
            texts[s].append(int(row.argmax()))
        batch = Batch(positions=[len(texts[s]) - 1 for s in seqs], sequences=seqs, outputs=range(len(seqs)),
                      tokens=[texts[s][-1] for s in seqs])
    return logits


def greedy(path: Path, prompts: Sequence[str], seqs: list[int], steps: int,
           flash: bool = False) -> dict[int, list[np.ndarray]]:
    """decode_together on a fresh model (one thread, two slots of 256 cells, batches of 32)."""
    model = load_model(path, num_threads=1, flash_attention=flash)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        return decode_together(model, prompts, seqs, steps)
    finally:
        model.close()
