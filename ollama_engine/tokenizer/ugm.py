"""Unigram (tokenizer.ggml.model = t5: T5, XLM-RoBERTa, nomic-embed-text v2), as llama.cpp's UGM tokenizer.

Written out rather than handed to the sentencepiece library because llama.cpp's port differs from it
in details the ids depend on: remove_extra_whitespaces puts a space before every run of non-spaces
(the first one too, with or without add_space_prefix), user-defined tokens stop normalisation on any
prefix they share with the text, and unused tokens are matched. Two steps:

- normalise the UTF-8 bytes: at each position the longest user-defined-token prefix is kept as it
  is, else the longest match in the precompiled charsmap (sentencepiece's XOR-compressed double
  array plus NUL-terminated replacements) is replaced, else one character is copied; spaces are then
  merged or kept and written as U+2581;
- Viterbi over the normalised bytes: the best sum of token scores (user-defined tokens score 0), a
  character no token starts with costing the lowest normal score minus 10 as the unknown token, and
  runs of unknown tokens merged into one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ollama_engine.tokenizer.vocab import TokenAttr, Vocabulary

_ESCAPED_SPACE = "\u2581".encode()
_UNKNOWN_PENALTY = np.float32(10.0)


class UnigramSegmenter:
    """Turns plain text into ids the way llama.cpp's UGM tokenizer does."""

    clean_spaces = False
    add_bos_default = False

    def __init__(self, vocab: Vocabulary, charsmap: bytes = b"", remove_extra_whitespaces: bool = False) -> None:
        if vocab.unk_id is None:
            raise ValueError("a Unigram vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
        self._unk_id = vocab.unk_id
        self._add_space_prefix = vocab.add_space_prefix
        self._merge_spaces = remove_extra_whitespaces
        self._charsmap = _CharsMap(charsmap)
        # numpy and C-level loops: a vocabulary may hold 250k tokens (IntFlag operations are slow)
        flags = np.fromiter(map(int, vocab.attrs), dtype=np.int64, count=len(vocab))
        scores = np.array(vocab.scores, dtype=np.float32)
        normal = scores[flags & int(TokenAttr.NORMAL) != 0]
        min_score = normal.min() if normal.size else np.float32(np.finfo(np.float32).max)
        user = flags & int(TokenAttr.USER_DEFINED) != 0
        ids = np.flatnonzero(flags & int(TokenAttr.NORMAL | TokenAttr.USER_DEFINED | TokenAttr.UNUSED))
        texts = [vocab.tokens[i] for i in ids.tolist()]
        keys = [text.encode() for text in texts]
        # user-defined tokens score 0, above every normal token (log probabilities)
        token_scores = np.where(user, 0.0, scores.astype(np.float64))[ids].tolist()
        # matchable token text -> id, score
        self._tokens = dict(zip(keys, zip(ids.tolist(), token_scores, strict=True), strict=True))
        lengths = np.array([len(key) for key in keys], dtype=np.int64)
        by_length = np.argsort(lengths, kind="stable").tolist()
        # first character -> the longest matchable token starting with it (longer ones written last)
        self._longest: dict[bytes, int] = dict(zip((texts[k][0].encode() for k in by_length),
                                                   lengths[by_length].tolist(), strict=True))
        user_defined = [vocab.tokens[i].encode() for i in np.flatnonzero(user).tolist()]
        self._unknown_score = float(min_score - _UNKNOWN_PENALTY)  # float arithmetic, as llama.cpp
        # every prefix of a user-defined token: llama.cpp's trie walk stops at the longest one shared
        self._user_prefixes = {key[:n] for key in user_defined for n in range(1, len(key) + 1)}
        self._user_longest = max(map(len, user_defined), default=0)

    @classmethod
    def from_metadata(cls, vocab: Vocabulary, metadata: Mapping[str, Any]) -> UnigramSegmenter:
        charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
        blob = np.asarray(charsmap, dtype=np.int64).astype(np.uint8).tobytes() if charsmap is not None else b""
        return cls(vocab, blob, bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", False)))

    def encode(self, text: str, after_special: bool) -> list[int]:
        """Encode one fragment of text between special tokens; with add_space_prefix its first word gets a
        leading space, as llama.cpp gives every fragment, except in a continuation of other text
        (after_special False: Tokenizer.encode_continuation)."""
        data = self.normalize(text.encode(), prepend_space=self._add_space_prefix and after_special)
        return self._viterbi(data)

    def normalize(self, data: bytes, prepend_space: bool) -> bytes:
        """llama.cpp's llm_tokenizer_ugm_session::normalize (treat_whitespace_as_suffix is never set)."""
        out = bytearray()
        space_prepended = in_word = False
        offset = 0
        while offset < len(data):
            piece, consumed = self._normalize_prefix(data, offset)
            for c in piece:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (prepend_space and not space_prepended) or self._merge_spaces:
                            out += _ESCAPED_SPACE
                            space_prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self._merge_spaces:
                        out += _ESCAPED_SPACE
            offset += consumed
        return bytes(out)

    def _normalize_prefix(self, data: bytes, offset: int) -> tuple[bytes, int]:
        """The replacement of the longest normalisable prefix at offset, and how many bytes it consumed."""
        shared = 0
        for n in range(min(self._user_longest, len(data) - offset), 0, -1):
            if data[offset:offset + n] in self._user_prefixes:
                shared = n
                break
        if shared:
            return data[offset:offset + shared], shared
        match = self._charsmap.longest_match(data, offset)
        if match is not None:
            return match
        n = _utf8_len(data[offset])
        char = data[offset:offset + n]
        try:
            char.decode()
        except UnicodeDecodeError:
            return "\ufffd".encode(), 1
        return char, n

    def _viterbi(self, data: bytes) -> list[int]:
        """The best-scoring ids for normalised bytes, scored and tie-broken exactly as llama.cpp: characters
        in order, candidate tokens shortest first, a later candidate winning only with a higher score."""
        n = len(data)
        if n == 0:
            return []
        # per end offset: best score so far, the token ending there and where it starts
        score = [-np.inf] * (n + 1)
        token = [self._unk_id] * (n + 1)
        start = [0] * (n + 1)
        score[0] = 0.0
        tokens, longest = self._tokens, self._longest
        offset = 0
        while offset < n:
            units = min(_utf8_len(data[offset]), n - offset)
            best = score[offset]
            single = False
            for end in range(offset + 1, min(offset + longest.get(data[offset:offset + units], 0), n) + 1):
                found = tokens.get(data[offset:end])
                if found is None:
                    continue
                if end - offset == units:
                    single = True
                challenger = best + found[1]
                if challenger > score[end]:
                    score[end], token[end], start[end] = challenger, found[0], offset
            if not single:
                end = offset + units
                challenger = best + self._unknown_score
                if challenger > score[end]:
                    score[end], token[end], start[end] = challenger, self._unk_id, offset
            offset += units
        ids: list[int] = []
        end, previous_unknown = n, False
        while True:  # backwards from the end, runs of unknown tokens kept as one
            unknown = token[end] == self._unk_id
            if not (previous_unknown and unknown):
                ids.append(token[end])
            if start[end] == 0:
                break
            previous_unknown = unknown
            end = start[end]
        ids.reverse()
        return ids


class _CharsMap:
    """sentencepiece's precompiled_charsmap: a uint32 size, an XOR-compressed compact double array (XCDA)
    of that many bytes mapping byte sequences to offsets, and the NUL-terminated replacement strings."""

    def __init__(self, blob: bytes) -> None:
        self._nodes: list[int] = []
        self._replacements = b""
        if not blob:
            return
        size = int.from_bytes(blob[:4], "little")
        if len(blob) < 4 or size + 4 >= len(blob):
            raise ValueError("tokenizer.ggml.precompiled_charsmap is shorter than its header says")
        self._nodes = np.frombuffer(blob[4:4 + size], dtype="<u4").tolist()
        self._replacements = blob[4 + size:]

    def longest_match(self, data: bytes, offset: int) -> tuple[bytes, int] | None:
        """The replacement for the longest sequence at offset the map has, and its length; None if none."""
        if not self._nodes:
            return None
        length = replacement = 0
        index = _base(self._node(0))
        for position in range(offset, len(data)):
            c = data[position]
            if c == 0:
                break
            index ^= c
            node = self._node(index)
            if node & 0x800000FF != c:  # LCHECK: not a child of the previous node
                break
            leaf = (node >> 8) & 1
            index ^= _base(node)
            if leaf:
                length = position - offset + 1
                replacement = self._node(index) & 0x7FFFFFFF
        if not length:
            return None
        end = self._replacements.find(b"\0", replacement)
        if replacement >= len(self._replacements) or end < 0:
            raise ValueError("tokenizer.ggml.precompiled_charsmap has a replacement out of bounds")
        return self._replacements[replacement:end], length

    def _node(self, index: int) -> int:
        if index >= len(self._nodes):
            raise ValueError("tokenizer.ggml.precompiled_charsmap: index out of the double array")
        return self._nodes[index]


def _base(node: int) -> int:
    return (node >> 10) << ((node & (1 << 9)) >> 6)


def _utf8_len(lead: int) -> int:
    """Bytes of the UTF-8 character this byte starts (llama.cpp's unicode_len_utf8)."""
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]
