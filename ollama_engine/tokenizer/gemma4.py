"""Gemma 4's tokenizer (tokenizer.ggml.model = gemma4): SentencePiece-style BPE on raw UTF-8.

As llama.cpp's llama-vocab.cpp runs it (LLAMA_VOCAB_PRE_TYPE_GEMMA4): every space becomes U+2581 (▁),
the text is cut into runs of newlines and runs of everything else (no word-level split), and each run is
merged by rank from its characters, not from GPT-2's byte characters. A run of newlines that is a token
of its own is taken whole (llama.cpp PR 21343). A merged piece that is not a token becomes its bytes'
<0xXX> tokens (a byte without one is dropped, as llama.cpp drops it). BOS is always added: llama.cpp
overrides a file's add_bos_token false for Gemma 4 (PR 21500). Decoding is the Vocabulary's: ▁ back to a
space, <0xXX> to its byte.

The merging is the tokenizers library's BPE model (lowest rank first, leftmost among equals: llama.cpp's
order; a character that is not a token falls back to its bytes), built at the first encode as
BytePairSegmenter's is.
"""

from __future__ import annotations

import re
import threading

from tokenizers import Tokenizer, models

from ollama_engine.tokenizer.vocab import Vocabulary

_RUNS = re.compile(r"[^\n]+|\n+")


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """(left, right) in rank order, split at the first space after the first character (llama.cpp's rule:
    ▁ is not a space, so Gemma's merges split there); the first of duplicate pairs keeps its rank."""
    pairs = ((m[:cut], m[cut + 1:]) for m in merges for cut in [m.find(" ", 1)] if cut > 0)
    return list(dict.fromkeys(pairs))


class Gemma4Segmenter:
    """Turns plain text into ids as llama.cpp's BPE session does for a gemma4 vocabulary."""

    clean_spaces = True  # llama.cpp keeps BPE's clean_spaces for gemma4
    add_bos_default = True

    def __init__(self, vocab: Vocabulary) -> None:
        self._vocab = vocab
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._bytes = [vocab.token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    def prepare(self) -> None:
        """Build the BPE model now (idempotent, thread-safe)."""
        if self._tokenizer is not None:
            return
        with self._lock:
            if self._tokenizer is None:
                known = self._vocab.token_to_id
                # a merge whose parts or result are not tokens could only make a piece that is not a token
                # (its bytes then), which tokenizers refuses to build: such merges are left out
                merges = [(a, b) for a, b in _merge_pairs(self._vocab.merges) if a in known and b in known
                          and a + b in known]
                self._tokenizer = Tokenizer(models.BPE(vocab=dict(known), merges=merges, byte_fallback=True))

    def encode(self, text: str, after_special: bool) -> list[int]:
        self.prepare()
        assert self._tokenizer is not None
        ids: list[int] = []
        for run in _RUNS.findall(text.replace(" ", "\u2581")):
            whole = self._vocab.token_to_id.get(run) if run[0] == "\n" else None
            if whole is not None:
                ids.append(whole)
                continue
            for piece in self._tokenizer.model.tokenize(run):
                token = self._vocab.token_to_id.get(piece.value)
                if token is not None:
                    ids.append(token)
                else:
                    ids.extend(b for b in map(self._bytes.__getitem__, piece.value.encode()) if b is not None)
        return ids
