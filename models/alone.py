"""A float weight's matrix product whose rows are each computed as their sequence's batch alone computes them.

ggml's CPU matmul of an F32/F16/BF16 weight sends a contiguous input of two rows or more through llamafile's
tiled sgemm and a single row (a decode step) through one dot product per row (ggml_vec_dot_*); the two sum
a row's products in another order, so their results differ in the last bit (on AVX2 and AVX-512 alike;
sgemm's rows do not depend on how many there are, nor on where they sit). The batch loop puts a sequence's
decode step in one batch with other sequences' rows; computed as one product, that step gets sgemm's
rounding, not the one it gets alone. Quantized GGUFs keep a mixture's router (ffn_gate_inp) in F32, so its
logits, and through the expert weights every later layer, differed from a solo run's.

matmul_alone computes each run of 1-row sequences apart through a strided view of the input (ggml takes
the per-row dot product for a non-contiguous input, as for a single row) and each run of longer
sequences as a contiguous block (sgemm), then joins the results in row order. A batch of one sequence
(llama.cpp's case, whose kernels the reference tests match bit for bit) is one plain product.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ollama_engine.ml import DType, Tensor

FLOAT_WEIGHTS = (DType.F32, DType.F16, DType.BF16)
_GAP = 16  # elements padded after each input row: a view of the rows' first features is then not contiguous


def sequence_rows(sequences: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    """How many consecutive rows each sequence has, for a batch's `sequences` (the runner keeps a sequence's
    rows together; a graph is reused only for batches of the same layout, which includes these counts) or,
    once a model keeps only the rows that want logits, for `sequences[outputs]`."""
    sequences = np.asarray(sequences)
    if len(sequences) < 2:  # a decode step's one row (np.r_ and np.diff cost ~40 us a step here)
        return (1,) if len(sequences) else ()
    bounds = [0, *(np.flatnonzero(sequences[1:] != sequences[:-1]) + 1).tolist(), len(sequences)]
    return tuple(end - begin for begin, end in zip(bounds[:-1], bounds[1:], strict=True))


def matmul_alone(weight: Tensor, x: Tensor, rows: Sequence[int]) -> Tensor:
    """weight.matmul(x) for x (k, n) holding consecutive runs of `rows` rows, one per sequence, with each
    row rounded as in a batch of its sequence alone."""
    singles = [count == 1 for count in rows]
    if weight.dtype not in FLOAT_WEIGHTS or len(rows) < 2 or not any(singles) or x.ne[2] * x.ne[3] != 1:
        return weight.matmul(x)
    k = x.ne[0]
    if x.strides[1] != x.strides[0] * k:
        x = x.contiguous()
    strided = x.pad(_GAP)
    parts, begin = [], 0
    for single, group in itertools.groupby(rows, key=lambda count: count == 1):
        count = sum(group)
        source = strided if single else x
        parts.append(weight.matmul(source.view(begin * source.strides[1], (k, count), (source.strides[1],))))
        begin += count
    out = parts[0]
    for part in parts[1:]:
        out = out.concat(part, 1)
    return out
