"""The steps of Ollama's sampling chain, each a small vectorised function.

`top_k` orders token ids by logit; every later step works on values in that descending order, so
`top_p` and `min_p` only ever keep a prefix, and the caller slices its ids to the same length.
"""

import numpy as np

# Ollama divides by max(temperature, 1e-7) so a temperature of 0 passed here cannot divide by zero.
MIN_TEMPERATURE = 1e-7


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first; k <= 0 or k >= vocab keeps (and sorts) them all.

    Equal logits are ordered by id (which of several tied at the k-th place are kept is up to
    numpy's partition, but always the same for the same input), so a seeded run is reproducible.
    """
    n = logits.shape[0]
    if k <= 0 or k >= n:
        return np.argsort(-logits, kind="stable")
    ids = np.argpartition(logits, n - k)[n - k :]
    ids.sort()
    return ids[np.argsort(-logits[ids], kind="stable")]


def temperature(values: np.ndarray, temp: float) -> np.ndarray:
    return values / np.float32(max(temp, MIN_TEMPERATURE))


def softmax(values: np.ndarray) -> np.ndarray:
    """Probabilities in float32; exponentials are taken in float64 after subtracting the maximum."""
    exps = np.exp(values.astype(np.float64) - np.max(values)).astype(np.float32)
    return exps / exps.sum(dtype=np.float32)


def top_p(probs: np.ndarray, p: float) -> np.ndarray:
    """The shortest prefix whose running sum exceeds p (p = 1 keeps all, p = 0 keeps one)."""
    if p == 1.0:
        return probs
    over = np.cumsum(probs, dtype=np.float32) > np.float32(p)
    if not over.any():
        return probs
    return probs[: int(np.argmax(over)) + 1]


def min_p(probs: np.ndarray, p: float) -> np.ndarray:
    """The leading tokens whose probability is at least p times the largest (the first one)."""
    below = probs < probs[0] * np.float32(p)
    if not below.any():
        return probs
    return probs[: int(np.argmax(below))]


def rows_of(tokens: np.ndarray, ids: np.ndarray | None, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row of each token id, whether it has one) in a row of `size` logits: the id itself over the whole
    vocabulary, or its place in `ids` (ascending token ids) when the row covers only those."""
    if ids is None:
        return tokens, tokens < size
    if ids.size == 0:
        return np.zeros_like(tokens), np.zeros(tokens.shape, dtype=bool)
    rows = np.minimum(np.searchsorted(ids, tokens), ids.size - 1)
    return rows, ids[rows] == tokens
