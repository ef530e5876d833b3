"""SentencePiece (tokenizer.ggml.model = llama) on the sentencepiece library.

A GGUF carries no .model protobuf, so one is built from the tokens and scores: a BPE model (merge the
highest-scoring adjacent pair first, leftmost on ties, as llama.cpp's SPM tokenizer does) with byte fallback
and no normalisation, since llama.cpp only swaps spaces for U+2581 and adds the leading space itself.
"""

from __future__ import annotations

import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from ollama_engine.tokenizer.vocab import TokenAttr, Vocabulary

_Piece = model_pb2.ModelProto.SentencePiece
# Appended after the real vocabulary because sentencepiece insists on an unknown piece; with byte fallback
# it is only produced when the vocabulary lacks a byte token.
_UNK_PLACEHOLDER = "<ollama-engine-unknown>"


class SentencePieceSegmenter:
    """Turns plain text into ids the way llama.cpp's SPM tokenizer does."""

    clean_spaces = False
    add_bos_default = True

    def __init__(self, vocab: Vocabulary) -> None:
        self._add_space_prefix = vocab.add_space_prefix
        self._unk_id = len(vocab)
        self._processor = sentencepiece.SentencePieceProcessor(model_proto=_model_proto(vocab))

    def encode(self, text: str, after_special: bool) -> list[int]:
        """Encode one fragment of text; the leading space is added at the start and after special tokens."""
        if self._add_space_prefix and after_special:
            text = " " + text
        ids = self._processor.encode(text.replace(" ", "\u2581"))
        if self._unk_id in ids:
            raise ValueError(f"cannot tokenize {text!r}: the vocabulary has no byte token for some byte")
        return ids


def _model_proto(vocab: Vocabulary) -> bytes:
    model = model_pb2.ModelProto()
    model.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    model.trainer_spec.vocab_size = len(vocab) + 1
    model.trainer_spec.byte_fallback = True
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = False
    for text, score, attr in zip(vocab.tokens, vocab.scores, vocab.attrs, strict=True):
        piece = model.pieces.add()
        piece.piece = text
        piece.score = score
        # llama.cpp may merge into any token whose text matches, control and unused ones included, so only
        # byte tokens keep their own type (sentencepiece needs it for byte fallback).
        piece.type = _Piece.BYTE if attr & TokenAttr.BYTE else _Piece.NORMAL
    unknown = model.pieces.add()
    unknown.piece = _UNK_PLACEHOLDER
    unknown.type = _Piece.UNKNOWN
    return model.SerializeToString()
