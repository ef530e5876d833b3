"""Speculative decoding by prompt lookup (n-grams): draft tokens from the sequence's own text, verify them in one batch.

Editing, extraction, RAG and code answers repeat long runs of their prompt. After each sampled token the
sequence looks up the last few tokens (an n-gram, longest first) where they occurred before in its prompt
or output, and proposes the tokens that followed there. The next batch then holds the sampled token and
the drafts; the sampler walks the rows in order and keeps a draft only if it samples exactly that token
from the row before, so every kept token was chosen from the same logits as in plain decoding. The KV
cells of the rejected drafts are removed, so the sequence continues as if they had never been computed.

Why the logits are the plain run's, bit for bit (see runner/exact.py for the kernel classes):
- attention: every verified row is its own segment (`Batch.apart`): its own history, padding and cells,
  and the one-row flash-attention kernel (split over the cache for long histories) a decode step takes;
- matmul: a row's class depends on the rows of the whole batch. Repacked weights (Q4_0, Q4_K, IQ4_NL on
  the CPU) send the last `rows % 4` rows through the one-row kernel: a batch of at most 3 rows computes
  every row as a decode step does. Other quantized types are computed row by row below 8 rows. F32/F16/BF16
  matmul weights take another kernel for a single row: no speculation for them; and none on GPU layouts,
  whose kernels this analysis does not cover. `verify_rows` gives the cap, the batch loop keeps to it.

Sampling: with an n-gram draft the draft distribution is a point mass q(d) = 1. The standard rule (accept d
with probability min(1, p(d)/q(d)) = p(d), else draw from the residual max(p - q, 0), which is p without d,
renormalised) is then the same as: draw t from p as usual and keep the draft iff t == d, where t is the
token generated either way. So a sampled request draws one number per generated token, in order, exactly as
without speculation: same seed, same tokens, and the output distribution is the target's.

A grammar only trims drafts (llguidance's validate_tokens): each row is sampled under the grammar anyway.

Adaptive: a sequence whose drafts are mostly rejected stops looking (for 16, then 32 ... 256 tokens), so a
request that does not repeat itself runs as plain decoding, with the batch pipeline's overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ollama_engine.ml import DType

log = logging.getLogger(__name__)

NGRAM_SIZES = (4, 3, 2)
"""n-gram lengths looked up, longest first (a longer match predicts better)."""
DEFAULT_DRAFT = 8
"""Drafted tokens per step when the request does not set draft_num_predict (the row cap may lower it)."""
MAX_DRAFT = 32
ROWS_REPACKED = 3  # every row of a batch of at most 3 takes a repacked type's one-row kernel
ROWS_QUANTIZED = 7  # below 8 rows, other quantized types use the kernel a decode step uses
LOW_ACCEPTANCE = 0.3
"""Below this share of accepted drafts (moving average) a sequence pauses speculation."""
FIRST_PAUSE, LONGEST_PAUSE = 16, 256
_FULL_PRECISION = {DType.F32, DType.F16, DType.BF16}


def verify_rows(model) -> int:
    """The most rows a batch holding drafts may have so that each row is computed as a decode step computes
    it (0: speculation cannot be exact for this model)."""
    backend = model.backend
    if model.cache is None or any(backend.layer_device(i).is_gpu for i in range(backend.block_count + 1)):
        return 0
    if any(len(t.ne) >= 2 and t.ne[1] > 1 and t.dtype in _FULL_PRECISION for t in backend.weights.values()):
        return 0
    return ROWS_REPACKED if backend.repacked_weights() else ROWS_QUANTIZED


class NgramIndex:
    """The tokens of one sequence and, per n-gram, where it last ended (the position of the token after it)."""

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
    """One sequence's drafting state: its n-gram index, the drafts in flight and its acceptance record."""

    index: NgramIndex
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
    _average: float = 1.0
    _pause: int = 0
    _next_pause: int = FIRST_PAUSE

    @classmethod
    def of(cls, prompt: list[int], max_draft: int) -> Speculator:
        return cls(NgramIndex(prompt), max_draft)

    def propose(self, limit: int) -> list[int]:
        """Drafts to follow the last token (at most `limit`); records whether the next step should wait."""
        if self._pause > 0:
            self._pause -= 1
            self.want = False
            return []
        drafts = self.index.draft(min(limit, self.max_draft)) if limit > 0 else []
        self.want = bool(drafts)
        return drafts

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: `accepted` of `drafted` tokens kept. Pauses the sequence if acceptance is low."""
        if drafted == 0:
            return
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self._average = 0.7 * self._average + 0.3 * (accepted / drafted)
        if self._average < LOW_ACCEPTANCE:
            self._pause, self._next_pause = self._next_pause, min(2 * self._next_pause, LONGEST_PAUSE)
            self._average = 1.0
            self.want = False
        elif accepted == drafted:
            self._next_pause = FIRST_PAUSE

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
