"""Grammar-constrained sampling with llguidance: one matcher per sequence, the sampled token checked first.

What llguidance needs to know of a vocabulary (the bytes every token emits, which tokens are special, the
end-of-generation ids) is built once per tokenizer and kept while the tokenizer lives (about 1 s for 128k
tokens). Grammars are compiled once per text (a few ms) and copied for each sequence.

Sampling follows llama.cpp and Ollama: sample as usual, check that one token against the grammar (about
1 µs), and only when it is rejected compute the mask of allowed tokens (0.1-1 ms for 128k tokens) and
sample again from the allowed ones. End-of-generation tokens are allowed only where the grammar may end;
once nothing can follow, the sequence is complete.

llguidance is imported at the first grammar, not with this module: a runner that serves no constrained
request never loads it (3 MiB of resident memory and 14 ms of every start).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from ollama_engine.sample.grammar_text import GrammarError, reason, to_llguidance
from ollama_engine.sample.sampler import Sampler
from ollama_engine.tokenizer import Tokenizer
from ollama_engine.tokenizer.vocab import TokenAttr

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger(__name__)

# Tokens that never stand for text: llama.cpp's llguidance integration names them 0xFF + their text, which
# no grammar over UTF-8 can match (but Lark's <|name|> syntax can).
SPECIAL_MARK = b"\xff"
_SPECIAL_ATTRS = int(TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.UNUSED)
_COMPILED_PER_TOKENIZER = 32  # grammars kept compiled, most recently used first


def token_bytes(tokenizer: Tokenizer) -> tuple[list[bytes], list[int]]:
    """The bytes each token emits (llama.cpp's token_to_piece), and the ids of special tokens.

    Control, unknown and unused tokens, tokens that emit nothing, and tokens that start with the byte 0xFF
    (never part of UTF-8 text, and llguidance's own mark) are special: 0xFF + their text.
    """
    vocab = tokenizer.vocab
    pieces: list[bytes] = []
    special: list[int] = []
    for i, (text, attr) in enumerate(zip(vocab.tokens, vocab.attrs, strict=True)):
        piece = b"" if int(attr) & _SPECIAL_ATTRS else vocab.piece(i)
        if not piece or piece.startswith(SPECIAL_MARK):
            piece = SPECIAL_MARK + text.encode()
            special.append(i)
        pieces.append(piece)
    return pieces, special


class _Source:
    """What llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokens, self.special_token_ids = token_bytes(tokenizer)
        eog = sorted(tokenizer.eos_ids)
        self.eos_token_id = tokenizer.vocab.eos_id if tokenizer.vocab.eos_id is not None else (eog or [0])[0]
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, data: bytes) -> list[int]:
        """Text to ids; llguidance needs decode(tokenize(text)) == text (no leading space added)."""
        return self._tokenizer.encode_continuation(data.decode("utf-8", errors="replace"))


class GrammarVocab:
    """llguidance's view of one tokenizer and the grammars compiled for it. `of(tokenizer)` builds it once."""

    _cache: weakref.WeakKeyDictionary[Tokenizer, GrammarVocab] = weakref.WeakKeyDictionary()
    _cache_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer | None = None, *, source: Any = None) -> None:
        """From a model's tokenizer, or from a ready llguidance source (its eos_token_id ends generation)."""
        import llguidance

        if tokenizer is not None:
            self.eog_ids, self.n_vocab, source = frozenset(tokenizer.eos_ids), tokenizer.vocab_size, _Source(tokenizer)
        else:
            self.eog_ids, self.n_vocab = frozenset([source.eos_token_id]), len(source.tokens)
        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(source), n_vocab=self.n_vocab,
                                          eos_token=sorted(self.eog_ids) or None)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> GrammarVocab:
        with cls._cache_lock:
            vocab = cls._cache.get(tokenizer)
            if vocab is None:
                vocab = cls._cache[tokenizer] = cls(tokenizer)
            return vocab

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher for a runner Grammar (GBNF or `%llguidance` Lark); GrammarError if it is invalid."""
        import llguidance

        compiled = to_llguidance(grammar)
        with self._lock:
            prototype = self._compiled.get(compiled)
            if prototype is None:
                prototype = llguidance.LLMatcher(self.llg, compiled, log_level=0)
                if prototype.is_error():
                    raise GrammarError(f"invalid grammar: {reason(prototype.get_error())}")
                for warning in prototype.get_grammar_warnings():
                    log.debug("grammar warning: %s", warning)
                self._compiled[compiled] = prototype
                if len(self._compiled) > _COMPILED_PER_TOKENIZER:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(compiled)
            return GrammarMatcher(prototype.deep_copy(), self)


class GrammarMatcher:
    """One sequence's place in its grammar: picks tokens the grammar allows, follows the ones taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: GrammarVocab) -> None:
        import llguidance.numpy

        self._fill_mask = llguidance.numpy.fill_next_token_bitmask
        self._matcher = matcher
        self._vocab = vocab
        self._mask = np.zeros((1, (vocab.n_vocab + 31) // 32), dtype=np.int32)
        self.masks_computed = 0  # how often the sampled token was rejected (benchmarks report it)

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts the token next (end-of-generation only where the grammar may end)."""
        if not 0 <= token < self._vocab.n_vocab:
            return False
        if token in self._vocab.eog_ids:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token]) == 1

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens (none end-of-generation) the grammar would accept in turn; nothing is consumed."""
        return self._matcher.validate_tokens(tokens)

    def allowed(self) -> np.ndarray:
        """One boolean per token of the vocabulary: may it come next?"""
        self._fill_mask(self._matcher, self._mask)
        self.masks_computed += 1
        if self._matcher.is_error():
            raise GrammarError(self._error())
        bits = np.unpackbits(self._mask.view(np.uint8), count=self._vocab.n_vocab, bitorder="little")
        return bits.view(np.bool_)

    def sample(self, sampler: Sampler, logits: np.ndarray) -> int:
        """Sample as usual; only if the grammar rejects that token, sample again from the allowed ones.

        The second draw runs the sampler on the allowed tokens' logits alone, in id order: the same choice
        as from logits with every other token at -inf, without sorting a vocabulary of -inf values.
        """
        token = sampler.sample(logits)
        if self.allows(token):
            return token
        ids = np.flatnonzero(self.allowed()[: logits.shape[0]])  # ids past the tokenizer's vocabulary: never
        if ids.size == 0:
            raise GrammarError("grammar: no token can continue the output")
        return int(ids[sampler.sample(logits[ids], ids)])

    def accept(self, token: int) -> None:
        """Advance past a token that is not end-of-generation; GrammarError if the grammar cannot take it."""
        if not self._matcher.consume_token(token):
            raise GrammarError(self._error())

    def _error(self) -> str:
        """The matcher's error, its first line (the rest dumps the parser's state)."""
        return "grammar: " + (self._matcher.get_error().split("\n", 1)[0] or "unknown error")

    @property
    def finished(self) -> bool:
        """Whether nothing more can follow: the output is complete."""
        return self._matcher.is_stopped()


class _ByteSource:
    """A vocabulary of the 255 one-byte tokens (0xFF is special, as in token_bytes) and an end token: enough to
    tell whether a grammar can begin any text at all, with no model's tokenizer at hand."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(255)] + [SPECIAL_MARK + b"<0xFF>", SPECIAL_MARK + b"</s>"]
        self.special_token_ids = [255, 256]
        self.eos_token_id = 256
        self.bos_token_id = None

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


_byte_vocab: GrammarVocab | None = None
_checked: OrderedDict[str, str] = OrderedDict()  # grammar -> "" (fine) or why not, most recent last
_check_lock = threading.Lock()


def check_grammar(grammar: str) -> None:
    """GrammarError unless the grammar can start some output: a schema such as {"$ref": "#"} compiles but can
    never produce a token, which the runner would only find at the first token (llguidance's NoExtensionBias).
    """
    global _byte_vocab
    with _check_lock:
        if grammar in _checked:
            _checked.move_to_end(grammar)
            why = _checked[grammar]
        else:
            if _byte_vocab is None:
                _byte_vocab = GrammarVocab(source=_ByteSource())
            why = _first_step_error(_byte_vocab, grammar)
            _checked[grammar] = why
            if len(_checked) > _COMPILED_PER_TOKENIZER:
                _checked.popitem(last=False)
    if why:
        raise GrammarError(why)


def _first_step_error(vocab: GrammarVocab, grammar: str) -> str:
    try:
        matcher = vocab.matcher(grammar)
        if matcher.allowed().any() or matcher.allows(256):
            return ""
        return "no output can match the grammar"
    except GrammarError as err:
        message = str(err).removeprefix("grammar: ").removeprefix("invalid grammar: ")
        if "NoExtensionBias" in message:
            message = "no output can match it (it refers only to itself)"
        return message
