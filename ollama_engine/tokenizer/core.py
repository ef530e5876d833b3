"""The tokenizer a runner uses: special tokens, BOS/EOS and decoding around a kind-specific segmenter."""

from __future__ import annotations

from typing import Protocol

from ollama_engine.tokenizer.vocab import SpecialFragment, Vocabulary


class Segmenter(Protocol):
    """Turns a fragment of plain text (no special tokens in it) into ids."""

    clean_spaces: bool  # llama.cpp's clean_up_tokenization_spaces when decoding
    add_bos_default: bool  # whether to add BOS when the GGUF has no tokenizer.ggml.add_bos_token

    def encode(self, text: str, after_special: bool) -> list[int]: ...


class Tokenizer:
    """Encodes and decodes text exactly as llama.cpp does for the same GGUF vocabulary."""

    def __init__(self, vocab: Vocabulary, segmenter: Segmenter) -> None:
        self.vocab = vocab
        self._segmenter = segmenter
        self.add_bos = vocab.add_bos if vocab.add_bos is not None else segmenter.add_bos_default
        self.add_eos = vocab.add_eos
        self._pieces: dict[int, bytes] = {}  # filled as tokens are first decoded (a vocabulary may be 256k)

    def prepare(self) -> None:
        """Build now what the segmenter defers to its first encode (BytePairSegmenter's BPE model); a runner
        calls it once it is ready. Segmenters without a `prepare` build everything up front."""
        build = getattr(self._segmenter, "prepare", None)
        if build is not None:
            build()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS plus end-of-turn/end-of-message tokens."""
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def token_piece(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens as their text); may be part of a UTF-8 character."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self.vocab.piece(token_id)  # raises IndexError out of range
        return piece

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to ids. add_special adds BOS/EOS (BERT: CLS/SEP); parse_special matches control tokens."""
        ids: list[int] = []
        bert = self.vocab.model == "bert"
        if add_special and (self.add_bos or bert):
            ids.append(_required(self.vocab.bos_id, "BOS"))
        after_special = True
        for fragment in self.vocab.split_special(text, parse_special):
            if isinstance(fragment, SpecialFragment):
                ids.append(fragment.token_id)
                after_special = True
            else:
                ids.extend(self._segmenter.encode(fragment, after_special))
                after_special = False
        if add_special and bert:
            ids.append(_required(self.vocab.sep_id, "SEP"))
        elif add_special and self.add_eos:
            ids.append(_required(self.vocab.eos_id, "EOS"))
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of text that continues other text: no BOS/EOS, no leading space added, control tokens not parsed.

        Decoding them gives the text back (constrained decoding relies on it)."""
        ids: list[int] = []
        for fragment in self.vocab.split_special(text, parse_special=False):
            if isinstance(fragment, SpecialFragment):
                ids.append(fragment.token_id)
            else:
                ids.extend(self._segmenter.encode(fragment, after_special=False))
        return ids

    def decode(self, ids: list[int], special: bool = False) -> str:
        """Ids to text, as llama_detokenize(remove_special=False, unparse_special=special).

        Control tokens are left out unless special is set; bytes that do not form whole UTF-8 characters
        (a piece cut in the middle of a character) become U+FFFD.
        """
        out = bytearray()
        for k, token_id in enumerate(ids):
            piece = self.token_piece(token_id) if special else self.vocab.piece(token_id, special=False)
            if k == 0 and self.vocab.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            out += piece
        if self._segmenter.clean_spaces:
            out = _clean_spaces(out)
        return out.decode("utf-8", errors="replace")


def _required(token_id: int | None, name: str) -> int:
    if token_id is None:
        raise ValueError(f"the vocabulary asks for a {name} token but defines none")
    return token_id


def _clean_spaces(text: bytearray) -> bytearray:
    """llama.cpp's clean_up_tokenization_spaces, pass for pass (each edits the buffer in place)."""
    # " ?", " !", " .", " ," lose the space
    for punct in (b"?", b"!", b".", b","):
        text = text.replace(b" " + punct, punct)
    # " ' " becomes "'"
    n, total = len(text), min(len(text), 1)
    i = 1
    while i < n:
        x = text[i]
        if x == ord("'") and i + 1 < n and text[i - 1] == ord(" ") and text[i + 1] == ord(" "):
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    del text[total:]
    # " 's", " 'm", " 're", " 've" lose the space
    n, total = len(text), min(len(text), 1)
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == ord(" ") and x == ord("'") and i + 1 < n:
            x1 = text[i + 1]
            if x1 in b"sm" or (i + 2 < n and text[i + 1:i + 3] in (b"re", b"ve")):
                total -= 1
        text[total] = x
        total += 1
    del text[total:]
    return text
