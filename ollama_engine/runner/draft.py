"""Speculative decoding with a draft model: a second, small model with the target's vocabulary proposes tokens.

The draft model has a KV cache of its own with one sequence per runner slot. Each slot remembers the tokens
its cells hold; to draft after a sequence's history, the draft model keeps the longest common prefix of
what it holds and the history, removes its cells past that point (the drafts the target rejected, or a
previous request's text), evaluates the rest of the history in prompt-sized batches, then decodes greedily
one token at a time. Which tokens it proposes does not change what the target generates (the target
verifies every draft, runner/speculate.py), so the draft model's own batches need no exactness: only speed.

Drafting stops early where the draft model is unsure (its top token's probability below `P_MIN`, as
llama.cpp's `--draft-p-min`): an unsure draft token is likely rejected, and it costs a draft step and a
verify row. The time a draft step takes is measured, so the speculation controller weighs it
(`Speculator.worth`).
"""

from __future__ import annotations

import time

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.models import Model

P_MIN = 0.6
"""Drafting stops after a token whose probability under the draft model is below this (llama.cpp's p_min)."""
DECAY = 0.8  # weight of the past in the measured seconds per draft step


class VocabularyMismatch(ValueError):
    """The draft model cannot draft for this target: its tokens mean other text."""


def check_vocabulary(target: Model, draft: Model) -> None:
    """Raise VocabularyMismatch unless both models have the same tokenizer type and the same token texts.

    A draft token id must mean the same text for the target, and must be a valid row of its embedding.
    """
    t, d = target.tokenizer.vocab, draft.tokenizer.vocab
    if t.model != d.model:
        raise VocabularyMismatch(f"draft model's tokenizer is {d.model!r}, the model's is {t.model!r}")
    if len(t.tokens) != len(d.tokens):
        raise VocabularyMismatch(f"draft model has {len(d.tokens)} tokens, the model {len(t.tokens)}")
    if t.tokens != d.tokens:
        first = next(i for i, (a, b) in enumerate(zip(t.tokens, d.tokens, strict=True)) if a != b)
        raise VocabularyMismatch(f"draft model's token {first} is {d.tokens[first]!r}, the model's "
                                 f"{t.tokens[first]!r}: not the same vocabulary")


class DraftModel:
    """The loaded draft model and, per slot, the tokens its cache holds. Used by the compute thread only."""

    def __init__(self, model: Model, batch_size: int, parallel: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self._held: list[list[int]] = [[] for _ in range(parallel)]
        self.step_seconds = 0.0
        """Measured seconds per one-token draft step (moving average; 0 before the first)."""

    def draft(self, slot: int, history: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens the draft model expects after `history` (greedy, stopping where it is unsure)."""
        if limit <= 0 or not history:
            return []
        held = self._held[slot]
        common = 0
        for a, b in zip(held, history, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)  # the last token is evaluated again: its logits are needed
        if common < len(held):
            self.model.cache.remove(slot, common)
            del held[common:]
        logits = None
        while len(held) < len(history):
            chunk = history[len(held):len(held) + self.batch_size]
            logits = self._compute(slot, chunk)
            held.extend(chunk)
        drafts: list[int] = []
        while True:
            token, sure = sure_greedy(logits)
            drafts.append(token)
            if len(drafts) == limit or not sure:
                return drafts
            started = time.monotonic()
            logits = self._compute(slot, [token])
            held.append(token)
            self.record_step(time.monotonic() - started)

    def record_step(self, seconds: float) -> None:
        """One draft step took this long."""
        self.step_seconds = seconds if not self.step_seconds else DECAY * self.step_seconds + (1 - DECAY) * seconds

    def _compute(self, slot: int, tokens: list[int]) -> np.ndarray:
        """Evaluate tokens at the slot's next positions; the logits of the last one."""
        start = len(self._held[slot])
        batch = Batch(positions=np.arange(start, start + len(tokens)), sequences=np.full(len(tokens), slot),
                      outputs=[len(tokens) - 1], tokens=np.asarray(tokens))
        logits = self.model.graphs.compute(batch, copy=False)
        assert logits is not None
        return logits[0]

    def close(self) -> None:
        self.model.close()


def sure_greedy(logits: np.ndarray) -> tuple[int, bool]:
    """The most likely token and whether its probability reaches P_MIN."""
    token = int(np.argmax(logits))
    top = logits[token]
    if not np.isfinite(top):
        return token, False
    probability = 1.0 / float(np.exp(logits - top, dtype=np.float32).sum())
    return token, probability >= P_MIN


class ModelDrafter:
    """One sequence's drafter (runner/speculate.Drafter): its history, drafted by the shared draft model."""

    def __init__(self, model: DraftModel, prompt: list[int]) -> None:
        self.model = model
        self.slot = -1
        self.tokens = list(prompt)

    def bind(self, slot: int) -> None:
        """The runner slot the sequence got: the draft cache's sequence that holds its history."""
        self.slot = slot

    @property
    def seconds_per_token(self) -> float:
        return self.model.step_seconds

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def ready(self, limit: int) -> bool:
        return limit > 0

    def draft(self, limit: int) -> list[int]:
        return self.model.draft(self.slot, self.tokens, limit)
