"""Token sampling, log-probabilities and grammar-constrained sampling (numpy on one row of logits)."""

from ollama_engine.sample.grammar import GrammarMatcher, GrammarVocab
from ollama_engine.sample.grammar_text import GrammarError, format_grammar
from ollama_engine.sample.logprobs import MAX_TOP_LOGPROBS, Logprob, TokenLogprob, calculate_logprobs
from ollama_engine.sample.sampler import NonFiniteLogitsError, Sampler

__all__ = ["MAX_TOP_LOGPROBS", "GrammarError", "GrammarMatcher", "GrammarVocab", "Logprob", "NonFiniteLogitsError",
           "Sampler", "TokenLogprob", "calculate_logprobs", "format_grammar"]
