"""Stop conditions: every end-of-generation token the vocabulary marks, and the stop strings to add.

A chat model ends a turn with a token that is not always `eos` (Llama 3's `<|eot_id|>`, ChatML's
`<|im_end|>`, Llama 3.1's `<|eom_id|>`). The vocabulary already collects them as llama.cpp does
(eos, eot, eom ids plus known end-of-turn texts); here they become the stops a request uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ollama_engine.tokenizer import Vocabulary


def end_of_generation(vocab: Vocabulary) -> dict[int, str]:
    """Token id -> token text for every end-of-generation token, sorted by id."""
    return {token_id: vocab.tokens[token_id] for token_id in sorted(vocab.eog_ids)}


def stop_words(vocab: Vocabulary, params: Mapping[str, Any] | None = None,
               request_stop: Iterable[str] | None = None) -> list[str]:
    """Stop strings for a request: the request's `options.stop` if given, else the Modelfile's `stop`
    parameter (Ollama's precedence: the request replaces the list as a whole), plus the texts of the
    end-of-generation tokens (which also stop generation by id), without duplicates, in that order.
    """
    chosen = list(request_stop) if request_stop is not None else list((params or {}).get("stop") or [])
    words: list[str] = []
    for word in [*chosen, *end_of_generation(vocab).values()]:
        if word and word not in words:
            words.append(word)
    return words
