"""Batch: the tokens of one forward pass, as the runner forms it and the cache and model read it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _int_vector(name: str, values: object) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=np.int32)
    if array.ndim != 1:
        raise ValueError(f"batch {name} must be a 1-D sequence of integers, got shape {array.shape}")
    return array


@dataclass(frozen=True, eq=False)
class Batch:
    """One entry per token: its position in its sequence and the sequence (slot) it belongs to.

    `outputs` lists the batch indices whose hidden states the caller needs (logits or embeddings), so
    the model can drop the other rows before the output layer. `tokens` holds the token ids; it is None
    where the caller feeds the model (or the cache, in tests) something other than tokens.
    Every array is int32, one dimension. `apart` names sequences whose rows each attend as a one-row
    decode step would (own segment, history and kernel): speculative decoding verifies drafted tokens so.
    """

    positions: np.ndarray
    sequences: np.ndarray
    outputs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    tokens: np.ndarray | None = None
    apart: frozenset[int] = frozenset()
    embeddings: tuple[tuple[int, np.ndarray], ...] = ()
    """(first row, (rows, n_embd) float32) pairs: rows whose input is an embedding (an image's) given in place
    of a token's; their token ids are placeholders (Ollama's batch.Multimodal)."""
    rope_positions: np.ndarray | None = None
    """(4, rows) int32, for models rotating by multimodal RoPE (Model.position_components 4): each row's time,
    height, width and spare components, where an image's rows have their own; None: a text row's p, p, p, 0."""

    def __post_init__(self) -> None:
        positions = _int_vector("positions", self.positions)
        sequences = _int_vector("sequences", self.sequences)
        outputs = _int_vector("outputs", self.outputs)
        if len(positions) != len(sequences):
            raise ValueError(f"batch has {len(positions)} positions but {len(sequences)} sequences")
        # Python's min()/max() over lists: numpy's reductions cost more for the few tokens of a decode step
        if len(positions) and min(min(positions.tolist()), min(sequences.tolist())) < 0:
            raise ValueError("batch positions and sequences must be non-negative")
        rows = outputs.tolist()
        if rows and (min(rows) < 0 or max(rows) >= len(positions)):
            raise ValueError(f"batch outputs {rows} outside 0..{len(positions) - 1}")
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "sequences", sequences)
        object.__setattr__(self, "outputs", outputs)
        if self.tokens is not None:
            tokens = _int_vector("tokens", self.tokens)
            if len(tokens) != len(positions):
                raise ValueError(f"batch has {len(tokens)} tokens but {len(positions)} positions")
            object.__setattr__(self, "tokens", tokens)
        if self.rope_positions is not None:
            rope = np.ascontiguousarray(self.rope_positions, dtype=np.int32)
            if rope.shape != (4, len(positions)):
                raise ValueError(f"batch rope positions of shape {rope.shape} for {len(positions)} rows: (4, rows)")
            object.__setattr__(self, "rope_positions", rope)
        for first, rows in self.embeddings:
            if rows.ndim != 2 or first < 0 or first + len(rows) > len(positions):
                raise ValueError(f"batch embeddings of shape {rows.shape} at row {first}: rows 0..{len(positions) - 1}")

    def __len__(self) -> int:
        return len(self.positions)

    def runs(self) -> list[tuple[int, int, int]]:
        """(sequence, first row, rows) for each run of consecutive rows of one sequence, in order."""
        sequences = self.sequences.tolist()
        runs, begin = [], 0
        for i in range(1, len(sequences) + 1):
            if i == len(sequences) or sequences[i] != sequences[begin]:
                runs.append((sequences[begin], begin, i - begin))
                begin = i
        return runs
