"""Token sampling and log-probabilities for the runner (numpy on one row of logits)."""

from ollama_engine.sample.logprobs import MAX_TOP_LOGPROBS, Logprob, TokenLogprob, calculate_logprobs
from ollama_engine.sample.sampler import Sampler

__all__ = ["MAX_TOP_LOGPROBS", "Logprob", "Sampler", "TokenLogprob", "calculate_logprobs"]
