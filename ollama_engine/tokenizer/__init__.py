"""Tokenizers built from a GGUF vocabulary, tokenizing exactly as llama.cpp does.

`from_gguf(path)` reads the metadata itself; `from_metadata(kv)` takes metadata a model loader already
read (GGUF key -> value, arrays as lists).
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from typing import Any

from ollama_engine.tokenizer.bpe import BytePairSegmenter
from ollama_engine.tokenizer.core import Segmenter, Tokenizer
from ollama_engine.tokenizer.gemma4 import Gemma4Segmenter
from ollama_engine.tokenizer.ugm import UnigramSegmenter
from ollama_engine.tokenizer.vocab import Vocabulary
from ollama_engine.tokenizer.wpm import WordPieceSegmenter

__all__ = ["Tokenizer", "Vocabulary", "from_gguf", "from_metadata", "read_tokenizer_metadata"]


def SentencePieceSegmenter(vocab: Vocabulary) -> Segmenter:  # noqa: N802 - stands in for the class
    """spm.SentencePieceSegmenter, imported when first needed: sentencepiece and protobuf cost every
    runner's start 0.017 s, and only Llama-2-style vocabularies use them."""
    from ollama_engine.tokenizer.spm import SentencePieceSegmenter as segmenter

    return segmenter(vocab)


def from_metadata(metadata: Mapping[str, Any]) -> Tokenizer:
    vocab = Vocabulary(metadata)
    segmenter: Segmenter
    if vocab.model == "llama":
        segmenter = SentencePieceSegmenter(vocab)
    elif vocab.model == "gpt2":
        segmenter = BytePairSegmenter(vocab)
    elif vocab.model == "t5":
        segmenter = UnigramSegmenter.from_metadata(vocab, metadata)
    elif vocab.model == "gemma4":
        segmenter = Gemma4Segmenter(vocab)
    else:
        segmenter = WordPieceSegmenter(vocab)
    tokenizer = Tokenizer(vocab, segmenter)
    if vocab.model == "gemma4":
        tokenizer.add_bos = True  # llama.cpp overrides a Gemma 4 file's add_bos_token false (its PR 21500)
    return tokenizer


def from_gguf(path: str | PathLike[str]) -> Tokenizer:
    return from_metadata(read_tokenizer_metadata(path))


def read_tokenizer_metadata(path: str | PathLike[str]) -> dict[str, Any]:
    """The general.* and tokenizer.* keys of a GGUF file (the rest is not needed to tokenize)."""
    from ollama_engine.fs import GGUFFile  # our parser: gguf-py's reader takes a minute on a 262k vocabulary

    return {key: value for key, value in GGUFFile.open(path).metadata.items()
            if key.startswith(("general.", "tokenizer."))}
