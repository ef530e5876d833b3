"""WordPiece (tokenizer.ggml.model = bert) on the tokenizers library.

GGUF BERT vocabularies mark word-initial pieces with a leading U+2581 instead of marking continuations with
"##". llama.cpp prefixes every word with U+2581 and takes the longest matching token at each position, which
is tokenizers' WordPiece with an empty continuation prefix. The word splitting before it is llama.cpp's own
(its accent stripping keeps only the first character of each character's NFD, which BertNormalizer does not
do), so it is done here.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

from tokenizers import Tokenizer, models

from ollama_engine.tokenizer.vocab import Vocabulary

_WORD_START = "\u2581"
# llama.cpp's whitespace set (the Unicode White_Space property).
_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                        + "".join(map(chr, range(0x2000, 0x200B))))
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


class WordPieceSegmenter:
    """Turns plain text into ids the way llama.cpp's WPM tokenizer does."""

    clean_spaces = True
    add_bos_default = True

    def __init__(self, vocab: Vocabulary) -> None:
        if vocab.unk_id is None:
            raise ValueError("a WordPiece vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
        self._lowercase = vocab.lowercase
        self._strip_accents = vocab.strip_accents
        model = models.WordPiece(vocab=dict(vocab.token_to_id), unk_token=vocab.tokens[vocab.unk_id],
                                 continuing_subword_prefix="", max_input_chars_per_word=2**31 - 1)
        self._tokenizer = Tokenizer(model)

    def encode(self, text: str, after_special: bool) -> list[int]:
        words = [_WORD_START + word for word in self._split_words(text)]
        if not words:
            return []
        return self._tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False).ids

    def _split_words(self, text: str) -> list[str]:
        """Normalise and split into words: whitespace separates, punctuation and CJK stand alone."""
        words: list[str] = []
        word: list[str] = []
        for char in text:
            kind, mapped = _classify(char, self._lowercase, self._strip_accents)
            if kind == "keep":
                word.append(mapped)
                continue
            if kind == "drop":  # dropped characters do not end the word
                continue
            if word:
                words.append("".join(word))
                word = []
            if kind == "alone":
                words.append(mapped)
        if word:
            words.append("".join(word))
        return words


@lru_cache(maxsize=65536)
def _classify(char: str, lowercase: bool, strip_accents: bool) -> tuple[str, str]:
    """('split' | 'drop' | 'alone' | 'keep', the character after normalisation) for one character."""
    if strip_accents:
        char = unicodedata.normalize("NFD", char)[0]
    if char in _WHITESPACE:
        return "split", ""
    category = unicodedata.category(char)
    if char in "\0\ufffd" or category in ("Cc", "Cf", "Co", "Cs"):
        return "drop", ""
    if strip_accents and category.startswith("M"):
        return "drop", ""
    code = ord(char)
    if lowercase:
        char = char.lower()[0]  # the simple lowercase mapping; only U+0130 lowers to two characters
    if category.startswith("P") or (code < 0x7F and category.startswith("S")) or any(
            lo <= code <= hi for lo, hi in _CJK_RANGES):
        return "alone", char
    return "keep", char
