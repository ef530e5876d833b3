"""Log-probabilities of generated tokens, in the shape the /completion stream sends them.

They come from the raw logits (before temperature, top-k or any other sampling step), so they
describe the model, not the sampler settings of the request.
"""

from collections.abc import Callable
from typing import TypedDict

import numpy as np

from ollama_engine.sample import transforms

# Ollama's API accepts top_logprobs from 0 to 20.
MAX_TOP_LOGPROBS = 20


class TokenLogprob(TypedDict):
    token: str
    logprob: float


class Logprob(TokenLogprob, total=False):
    """One generated token; `top_logprobs` is left out when none were asked for (Go's omitempty)."""

    top_logprobs: list[TokenLogprob]


def calculate_logprobs(
    logits: np.ndarray, token: int, top_logprobs: int, decode: Callable[[int], str]
) -> Logprob:
    """The chosen token's log-probability and, if top_logprobs > 0, the most likely tokens' (best first).

    `decode` turns a token id into its text. Only the normaliser touches the whole vocabulary: it is
    summed in float64 after subtracting the maximum logit, as Ollama does.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logprobs: expected one non-empty row of logits, got shape {logits.shape}")
    if not 0 <= token < logits.size:
        raise ValueError(f"logprobs: token {token} is outside the vocabulary of {logits.size}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")

    peak = np.max(logits)
    log_total = np.float32(np.log(np.exp(logits.astype(np.float64) - peak).sum()))

    def entry(i: int) -> TokenLogprob:
        return {"token": decode(i), "logprob": float((logits[i] - peak) - log_total)}

    result = Logprob(**entry(token))
    if top_logprobs > 0:
        result["top_logprobs"] = [entry(int(i)) for i in transforms.top_k(logits, top_logprobs)]
    return result
