"""Speculative decoding with a draft model: a second, small model with the target's vocabulary proposes tokens.

The draft model has a KV cache of its own with one sequence per runner slot. Each slot remembers the tokens
its cells hold; to draft after a sequence's history, the draft model keeps the longest common prefix of
what it holds and the history, removes its cells past that point (the drafts the target rejected, or a
previous request's text), evaluates the rest of the history in prompt-sized batches, then decodes greedily
one token at a time. Which tokens it proposes does not change what the target generates (the target
verifies every draft, runner/speculate.py), so the draft model's own batches need no exactness: only speed.

Every sequence that drafts after a step of the runner drafts in the same batches (`DraftModel.draft_many`):
their catch-up rows share a prompt-sized batch, and each greedy step is one batch with a row per sequence
still drafting, as the target decodes several sequences at once. A step then costs little more than one
sequence's (decoding reads the weights once for every row).

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
        """Measured seconds per draft step (a row per drafting sequence; moving average, 0 before the first)."""

    def draft_together(self, requests: list[tuple[ModelDrafter, int]]) -> list[list[int]]:
        """runner/speculate.DraftGroup: the drafts of several sequences' drafters, in shared batches."""
        return self.draft_many([(drafter.slot, drafter.tokens, limit) for drafter, limit in requests])

    def draft(self, slot: int, history: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens the draft model expects after `history` (greedy, stopping where it is unsure)."""
        return self.draft_many([(slot, history, limit)])[0]

    def draft_many(self, requests: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (slot, history, limit), up to `limit` greedy tokens after `history`: every sequence's
        catch-up and draft steps in shared batches (one row per sequence and step)."""
        drafts: list[list[int]] = [[] for _ in requests]
        logits: dict[int, np.ndarray] = {}  # request -> the logits after its history's last token
        wanted = [i for i, (_, history, limit) in enumerate(requests) if limit > 0 and history]
        for i in wanted:
            self._keep_common_prefix(*requests[i][:2])
        behind = list(wanted)
        while behind:  # evaluate what the caches lack, `batch_size` rows at a time
            rows: list[tuple[int, list[int]]] = []
            room = self.batch_size
            for i in behind:
                slot, history, _ = requests[i]
                held = self._held[slot]
                chunk = history[len(held):len(held) + room]
                rows.append((i, chunk))
                room -= len(chunk)
                if room == 0:
                    break
            out = self._compute([(requests[i][0], chunk) for i, chunk in rows])
            for (i, chunk), row in zip(rows, out, strict=True):
                slot, history, _ = requests[i]
                self._held[slot].extend(chunk)
                if len(self._held[slot]) == len(history):
                    logits[i] = row.copy()  # the next batch overwrites the output buffer
            behind = [i for i in behind if i not in logits]
        while logits:  # one greedy step for every sequence still drafting
            stepping: list[int] = []
            for i, row in logits.items():
                token, sure = sure_greedy(row)
                drafts[i].append(token)
                if len(drafts[i]) < requests[i][2] and sure:
                    stepping.append(i)
            if not stepping:
                break
            started = time.monotonic()
            out = self._compute([(requests[i][0], [drafts[i][-1]]) for i in stepping])
            self.record_step(time.monotonic() - started)
            for i in stepping:
                self._held[requests[i][0]].append(drafts[i][-1])
            logits = dict(zip(stepping, out, strict=True))
        return drafts

    def _keep_common_prefix(self, slot: int, history: list[int]) -> None:
        """Remove the slot's cells past what it shares with the history (always re-evaluating the history's last
        token: drafting needs its logits)."""
        held = self._held[slot]
        common = 0
        for a, b in zip(held, history, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)
        if common < len(held):
            self.model.cache.remove(slot, common)
            del held[common:]

    def record_step(self, seconds: float) -> None:
        """One draft step took this long."""
        self.step_seconds = seconds if not self.step_seconds else DECAY * self.step_seconds + (1 - DECAY) * seconds

    def _compute(self, rows: list[tuple[int, list[int]]]) -> np.ndarray:
        """Evaluate each (slot, tokens) at the slot's next positions, in one batch; per entry, the logits of its
        last token (a view, valid until the next compute)."""
        positions, sequences, outputs, tokens = [], [], [], []
        for slot, chunk in rows:
            start = len(self._held[slot])
            positions.extend(range(start, start + len(chunk)))
            sequences.extend([slot] * len(chunk))
            tokens.extend(chunk)
            outputs.append(len(tokens) - 1)
        batch = Batch(positions=positions, sequences=sequences, outputs=outputs, tokens=tokens)
        logits = self.model.graphs.compute(batch, copy=False)
        assert logits is not None
        return logits

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

    @property
    def group(self) -> DraftModel:
        """Every sequence's drafter shares the draft model: they draft in one batch."""
        return self.model

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def ready(self, limit: int) -> bool:
        return limit > 0

    def draft(self, limit: int) -> list[int]:
        return self.model.draft(self.slot, self.tokens, limit)
