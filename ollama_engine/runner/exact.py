"""Exact prompt-cache reuse: which cached inputs a new prompt may reuse so that its result is a cold run's.

ggml's CPU kernels compute a row one way or another depending on the batch around it, and the two ways
round differently in the last bits, which grow into different logprobs:

- matmul: repacked weights (Q4_0, Q4_K, IQ4_NL, ...) send the last `rows % 4` rows of a batch through
  a one-row kernel; K-quants that are not repacked use another kernel below 8 rows; F32 and F16 weights
  another for a single row. A row is computed by the "many-row" kernels when the batch has at least 8
  rows and the row is not among its last `rows % 4`.
- flash attention: a sequence with at least 64 query rows in the batch goes through the tiled kernel
  (GGML_FA_TILE_Q), fewer through the one-row kernel.

A cold run evaluates a prompt in batches of `batch_size` from position 0. Each input's keys and values
are cached with the kernel class of the row that computed them (`row_kernels`); a prompt reuses a cached
input only if its class is the one a cold run gives that position, and `resume_point` picks where
evaluation restarts (a multiple of 4, usually 8 to 11 inputs before the end) so that the batches the rest
is cut into (at multiples of batch_size, as a cold run cuts) give every row the cold run's class. Inputs
computed while generating (one row per batch) are never a cold run's: a chat's previous answer is
evaluated again as prompt on its next turn.

A cache that can continue a sequence only at some positions (a hybrid's recurrent states, kvcache/recurrent.py)
keeps checkpoints where a later prompt extending this one will resume (`extension_resumes`).
"""

from __future__ import annotations

from collections.abc import Sequence

UNKNOWN = 0  # not recorded: never reused
MIN_MANY_ROWS = 8
GROUP_ROWS = 4
TILED_ATTENTION_ROWS = 64


def row_kernels(rows: Sequence[int], batch_rows: int, sequence_rows: int) -> bytes:
    """The kernel class of each of a sequence's rows (indices into a batch of batch_rows rows): rows of one
    class are computed alike, whatever else is in their batch."""
    many = batch_rows - batch_rows % GROUP_ROWS
    shared = 1 + (batch_rows >= MIN_MANY_ROWS) + 4 * (batch_rows == 1) + 8 * (sequence_rows >= TILED_ATTENTION_ROWS)
    return bytes(shared + 2 * (row >= many) for row in rows)


def _cold_kernels(begin: int, end: int, length: int, batch_size: int) -> bytes:
    """The classes a cold run of a `length`-input prompt gives positions [begin, end)."""
    out = bytearray()
    for first in range(begin // batch_size * batch_size, end, batch_size):
        rows = min(first + batch_size, length) - first
        kinds = row_kernels(range(rows), rows, rows)
        out += kinds[max(begin - first, 0) : end - first]
    return bytes(out)


def _valid_resume(resume: int, length: int, batch_size: int) -> bool:
    """Whether evaluating [resume, length) in batches cut at multiples of batch_size gives every row its
    cold class. Only the first batch can differ from a cold run's (the others are cut alike)."""
    if resume % batch_size == 0:
        return True
    end = min(-(-resume // batch_size) * batch_size, length)
    rows = end - resume
    return row_kernels(range(rows), rows, rows) == _cold_kernels(resume, end, length, batch_size)


MAX_CANDIDATES = 16  # resume points tried before falling back to a cold evaluation (always exact)


def resume_point(kernels: bytes | bytearray, common: int, length: int, batch_size: int) -> int:
    """Where a prompt of `length` inputs resumes, of which `common` match the cache, whose inputs were
    computed with `kernels`."""
    limit = min(common, len(kernels))
    wanted = _cold_kernels(0, limit, length, batch_size)
    reusable = 0
    while reusable < limit and kernels[reusable] != UNKNOWN and kernels[reusable] == wanted[reusable]:
        reusable += 1
    resume = reusable // GROUP_ROWS * GROUP_ROWS
    for _ in range(MAX_CANDIDATES):
        if resume <= 0 or _valid_resume(resume, length, batch_size):
            return max(resume, 0)
        resume -= GROUP_ROWS
    return 0


def extension_resumes(length: int, batch_size: int, first: int = 0, row: int = 0,
                      batch_rows: int | None = None) -> tuple[int, ...]:
    """Where a later prompt extending a `length`-input prompt resumes, the prompt's last batch holding its
    positions first..length - 1 in rows row.. of batch_rows (default: that batch is the prompt alone).

    Its last reusable input is the last multiple of GROUP_ROWS among those computed by the many-row matmul
    (the batch's last `batch_rows % 4` rows were a one-row matmul's). The later prompt resumes there if it adds
    at least TILED_ATTENTION_ROWS inputs after it and stays in the batch a cold run cuts there; else
    TILED_ATTENTION_ROWS earlier (it adds fewer), or TILED_ATTENTION_ROWS before that batch's end (it goes past
    it): so that the rows evaluated again reach the tiled attention a cold run gives them. The prompt's last
    batch must have had as many rows as a cold run of the later prompt gives it (at least TILED_ATTENTION_ROWS
    each, or fewer each) for any of them to be reused. Positive positions only, ascending."""
    rows = length - first + row if batch_rows is None else batch_rows
    reusable = min(length, first + rows - rows % GROUP_ROWS - row)
    last = reusable - reusable % GROUP_ROWS
    end = (first // batch_size + 1) * batch_size - TILED_ATTENTION_ROWS
    end -= end % GROUP_ROWS
    return tuple(sorted({p for p in (last - TILED_ATTENTION_ROWS, min(end, last), last) if p > 0}))
