"""Speculative decoding: draft tokens cheaply, verify them in one batch of the model.

Where drafts come from is a `Drafter`: two exist. `NgramIndex` (prompt lookup): editing, extraction, RAG and
code answers repeat long runs of their prompt; after each sampled token the sequence looks up the last few
tokens (an n-gram, longest first) where they occurred before in its prompt or output, and proposes the
tokens that followed there. `runner/draft.ModelDrafter`: a small draft model with the same vocabulary
decodes a few tokens greedily. Everything else is one mechanism. The next batch holds the sampled token and
the drafts; the sampler walks the rows in order and keeps a draft only if it samples exactly that token
from the row before, so every kept token was chosen from the same logits as in plain decoding. The KV
cells of the rejected drafts are removed, so the sequence continues as if they had never been computed.

Why the logits are the plain run's, bit for bit (see runner/exact.py for the kernel classes):
- attention: every verified row is its own segment (`Batch.apart`): its own history, padding and cells,
  and the one-row flash-attention kernel (split over the cache for long histories) a decode step takes;
- matmul: a row's kernel depends on how many rows the product has, by weight (`matmul_row_limits`).
  Repacked weights (Q4_0, Q4_K, Q6_K, IQ4_NL ... on the CPU) send the last `rows % 4` rows through the
  one-row kernel: a product of at most 3 rows computes every row as a decode step does. K-quants and IQ
  types not repacked take ggml's tiled kernel from 8 rows on: 7. Q4_1 and Q5_1 always take the one-row
  dot product, and the many-row kernel of Q8_0 and Q5_0 (llamafile's tinyBLAS) sums each element in the
  dot product's order: no limit. Other quantized types: one row at a time. A verify batch's graph computes
  each weight's product in pieces of at most its limit (Context.matmul_row_limits), so a dense model
  verifies up to ROWS_ANY rows; the pieces re-read the limited weights, the others (the output matrix, the
  largest) are read once. A mixture's experts (matmul_id groups rows by expert) cannot be cut so: such a
  model keeps the cap every product allows, 3 with repacked weights, 7 with K-quants. F32/F16/BF16 matmul
  weights take another kernel for a single row: no speculation for them; and none on GPU layouts, whose
  kernels this analysis does not cover. `verify_rows` gives the cap, the batch loop keeps to it.

Sampling: with an n-gram draft, or a greedy draft model's, the draft distribution is a point mass q(d) = 1.
The standard rule (accept d with probability min(1, p(d)/q(d)) = p(d), else draw from the residual
max(p - q, 0), which is p without d, renormalised) is then the same as: draw t from p as usual and keep the
draft iff t == d, where t is the token generated either way. So a sampled request draws one number per
generated token, in order, exactly as without speculation: same seed, same tokens, and the output
distribution is the target's.

A grammar only trims drafts (llguidance's validate_tokens): each row is sampled under the grammar anyway.

Adaptive: on the CPU a verified row can cost nearly what a decode step costs (quantized matmul is computed
row by row; a busy machine is compute-bound), so a wrong draft may be paid in full. The runner measures what
batches of 1, 2, ... rows of decode steps cost (`StepCost`); each sequence estimates the chance that a draft
token is kept, and drafts the k tokens that maximise expected tokens per second,
(1 + a + ... + a^k) / (t(1+k) + k d), where d is what drafting a token costs (0 for a lookup, a draft model's
measured step), only if that beats a decode step's 1 / t(1) by a margin. A sequence whose drafts do not pay
stops looking (for 16, then 32 ... 256 tokens): a request that does not repeat itself runs as plain decoding,
with the pipeline's overlap.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ollama_engine.ml import DType

log = logging.getLogger(__name__)

NGRAM_SIZES = (4, 3)
"""n-gram lengths looked up, longest first (a longer match predicts better)."""
DEFAULT_DRAFT = 16
"""Drafted tokens per step when the request does not set draft_num_predict (the row cap may lower it)."""
MAX_DRAFT = 32
ROWS_REPACKED = 3  # every row of a product of at most 3 takes a repacked type's one-row kernel
ROWS_QUANTIZED = 7  # below 8 rows, K-quants and IQ types use the kernel a decode step uses
ROWS_ANY = DEFAULT_DRAFT + 1
"""The cap where every product can be cut to its kernel's limit. Not MAX_DRAFT + 1: the runner reserves memory for
a verify batch of this many rows whether or not requests speculate, and each row's logits cost a vocabulary of
floats (1 MiB for Gemma's 262 144 tokens)."""
_ROW_BY_ROW = {DType.Q4_1, DType.Q5_1, DType.Q8_0, DType.Q5_0}
"""Weight types whose matmul computes every row as a one-row product does, however many rows it has."""
_TILED = {DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.IQ4_XS, DType.IQ2_XXS, DType.IQ2_XS,
          DType.IQ2_S, DType.IQ3_XXS, DType.IQ3_S, DType.IQ1_S, DType.IQ1_M}
"""Types ggml's CPU computes with its tiled kernel from 8 rows on (ggml-cpu/tiled), when not repacked."""
MARGIN = 1.1
"""Speculate only where the expected tokens per second beat plain decoding's by this factor (a step that waits
for its token loses the pipeline's overlap of graph building and compute)."""
FIRST_PAUSE, LONGEST_PAUSE = 16, 256
DECAY = 0.8  # weight of the past in the acceptance counts
_FULL_PRECISION = {DType.F32, DType.F16, DType.BF16}


def verify_rows(model, batch_size: int | None = None) -> int:
    """The most rows a batch holding drafts may have so that each row is computed as a decode step computes
    it (0 or 1: speculation cannot be exact for this model); at most batch_size, what the cache (a sliding
    window's ring holds the window and one batch) and the memory plan were sized for."""
    backend = model.backend
    if model.cache is None or any(backend.layer_device(i).is_gpu for i in range(backend.block_count + 1)):
        return 0
    matrices = [t for t in backend.weights.values() if len(t.ne) >= 2 and t.ne[1] > 1]
    if any(t.dtype in _FULL_PRECISION for t in matrices):
        return 0
    if all(t.ne[2] == 1 for t in matrices):  # dense: every product can be cut to its limit
        rows = ROWS_ANY
    else:  # experts: the whole batch within each limit
        rows = min(matmul_row_limits(model).values(), default=ROWS_ANY)
    return rows if batch_size is None else min(rows, batch_size)


def matmul_row_limits(model) -> dict[int, int]:
    """The most rows one product of each quantized matrix may have so that every row is computed as in a
    one-row product (by ggml.storage_address of the weight; no entry: no limit)."""
    backend = model.backend
    repacked = backend.repacked_weights()
    limits = {}
    for name, weight in backend.weights.items():
        if len(weight.ne) < 2 or weight.ne[1] == 1 or weight.dtype in _ROW_BY_ROW or weight.dtype in _FULL_PRECISION:
            continue
        if name in repacked:
            limit = ROWS_REPACKED
        elif weight.dtype in _TILED:
            limit = ROWS_QUANTIZED
        else:
            limit = 1
        limits[weight.storage] = limit
    return limits


class StepCost:
    """Seconds a batch of n decode rows (1 + drafts) takes to compute: per n, the median of its last WINDOW steps.

    A median, not a moving average: the costs of 2+ rows are measured only while some sequence speculates, so one
    slow step on a busy machine would otherwise inflate them until speculation stops and never measures again."""

    WINDOW = 9

    def __init__(self) -> None:
        self._seconds: dict[int, deque[float]] = {}

    def record(self, rows: int, seconds: float) -> None:
        self._seconds.setdefault(rows, deque(maxlen=self.WINDOW)).append(seconds)

    def measured(self) -> dict[int, float]:
        """The current estimates, by rows (for reports)."""
        return {rows: statistics.median(self._seconds[rows]) for rows in sorted(self._seconds)}

    def estimate(self, rows: int) -> float | None:
        """Measured, or from the nearest measured sizes (assuming each extra row costs half a step: optimistic,
        so that an unmeasured size gets tried); None before any decode step was measured."""
        if rows in self._seconds:
            return statistics.median(self._seconds[rows])
        below = [n for n in self._seconds if n < rows]
        if not below:
            return None
        n = max(below)
        return statistics.median(self._seconds[n]) * (1 + 0.5 * (rows - n) / n)


class Drafter(Protocol):
    """Where one sequence's drafts come from. It sees every token the sequence generates, in order."""

    @property
    def seconds_per_token(self) -> float:
        """What drafting one token costs (the controller weighs it against the verify rows it saves)."""
        ...

    @property
    def group(self) -> DraftGroup | None:
        """What drafts for this drafter and others together (a draft model, in one batch); None: it drafts alone."""
        ...

    def bind(self, slot: int) -> None:
        """The runner slot the sequence got (a draft model keeps the slot's history in its cache)."""

    def append(self, token: int) -> None:
        """The sequence generated this token."""

    def ready(self, limit: int) -> bool:
        """Whether draft(limit) would propose something (cheap: decides if the next step waits to speculate)."""
        ...

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens expected after the sequence's tokens so far."""
        ...


class DraftGroup(Protocol):
    """Drafts for several sequences at once (runner/draft.DraftModel: their rows in the same batches)."""

    def draft_together(self, requests: list[tuple[Drafter, int]]) -> list[list[int]]:
        """For each (drafter, limit), what drafter.draft(limit) would propose."""
        ...


def draft_all(requests: list[tuple[Drafter, int]]) -> list[list[int]]:
    """For each (drafter, limit), up to `limit` drafts; drafters of one group draft together (one call)."""
    drafts: list[list[int]] = [[] for _ in requests]
    groups: dict[int, tuple[DraftGroup, list[int]]] = {}
    for i, (drafter, limit) in enumerate(requests):
        group = drafter.group
        if group is None:
            drafts[i] = drafter.draft(limit)
        else:
            groups.setdefault(id(group), (group, []))[1].append(i)
    for group, members in groups.values():
        for i, proposed in zip(members, group.draft_together([requests[i] for i in members]), strict=True):
            drafts[i] = proposed
    return drafts


class NgramIndex:
    """The tokens of one sequence and, per n-gram, where it last ended (the position of the token after it)."""

    seconds_per_token = 0.0  # a dictionary lookup
    group = None  # each sequence looks up its own tokens

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Add a token; the n-grams ending just before it now have a continuation."""
        tokens = self.tokens
        end = len(tokens)
        for n in NGRAM_SIZES:
            if end >= n:
                self._ends[tuple(tokens[end - n:end])] = end
        tokens.append(token)

    def bind(self, slot: int) -> None:
        pass

    def ready(self, limit: int) -> bool:
        return bool(self.draft(limit))

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        tokens = self.tokens
        for n in NGRAM_SIZES:
            if len(tokens) <= n:
                continue
            start = self._ends.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []


@dataclass
class Speculator:
    """One sequence's drafting state: its drafter, the drafts in flight and its acceptance record."""

    drafter: Drafter
    max_draft: int
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    waiting: bool = False
    """No placeholder was queued for the next token: the sampler gives the next inputs (token + drafts)."""
    want: bool = False
    """The last lookup found a draft: the next step should wait for its token and speculate."""
    in_flight: list[int] = field(default_factory=list)
    """The drafts in the batch being computed, after the sampled token in its first row."""
    stopped: bool = False
    """No more drafts: the sequence's context shifted, and exactness after a shift is proven for none of the
    repacked-weight models (Gemma 3 270M drifted from plain decoding 10 tokens after one)."""
    _kept: float = 4.0  # decayed counts of kept and rejected draft tokens: the chance a draft token is kept
    _missed: float = 1.0
    _pause: int = 0
    _next_pause: int = FIRST_PAUSE

    @classmethod
    def of(cls, prompt: list[int], max_draft: int) -> Speculator:
        return cls(NgramIndex(prompt), max_draft)

    def propose(self, limit: int, cost: StepCost, draft: bool = True) -> list[int]:
        """Drafts to follow the last token (at most `limit`); records whether the next step should wait.

        draft=False only decides that (the next step's input is already queued: drafts now would be wasted)."""
        k = self.plan(limit, cost, draft)
        if k == 0:
            return []
        drafts = self.drafter.draft(k)
        self.received(drafts)
        return drafts

    def plan(self, limit: int, cost: StepCost, draft: bool = True) -> int:
        """How many tokens to draft now (at most `limit`; 0: none). A sequence whose drafts do not pay pauses.

        draft=False only records whether the next step should wait (`want`) and returns 0."""
        self.want = False
        if self.stopped:
            return 0
        if self._pause > 0:
            self._pause -= 1
            return 0
        k = self.worth(min(limit, self.max_draft), cost)
        if k == 0:
            self._start_pause()
            return 0
        if not draft:
            self.want = self.drafter.ready(k)
            return 0
        return k

    def received(self, drafts: list[int]) -> None:
        """The drafter proposed these after plan(): the next step waits to verify them, if there are any."""
        self.want = bool(drafts)

    def worth(self, limit: int, cost: StepCost) -> int:
        """The draft length with the most expected tokens per second, 0 if none beats plain decoding."""
        single = cost.estimate(1)
        if limit <= 0 or single is None:
            return min(limit, 1)
        chance = self._kept / (self._kept + self._missed)
        drafting = self.drafter.seconds_per_token
        best, best_rate, expected = 0, MARGIN / single, 1.0
        for k in range(1, limit + 1):
            expected += chance**k
            seconds = cost.estimate(1 + k)
            if seconds is not None and expected / (seconds + k * drafting) > best_rate:
                best, best_rate = k, expected / (seconds + k * drafting)
        return best

    def _start_pause(self) -> None:
        self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, LONGEST_PAUSE)
        self._kept, self._missed = 4.0, 1.0  # try again afterwards with the first estimate

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` tokens kept. Pauses the sequence if acceptance is low."""
        if drafted == 0:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self._kept = DECAY * self._kept + accepted
        self._missed = DECAY * self._missed + (accepted < drafted)
        if accepted == drafted:
            self._next_pause = FIRST_PAUSE

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
