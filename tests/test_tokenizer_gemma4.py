"""Gemma 4's tokenizer (tokenizer.ggml.model "gemma4", ollama_engine/tokenizer/gemma4.py) against llama.cpp.

The vocabulary is llama.cpp's own test file (models/ggml-vocab-gemma-4.gguf: Gemma 4's 262k tokens and
merges) with its inputs and expected ids; the reference test tokenizes random text with the pinned
llama.cpp itself (add_special and parse_special on and off), detokenizes, and compares token pieces.
"""

from __future__ import annotations

import pytest
from test_tokenizer import _compare_with_reference, _random_texts, _tokenizer, _vocab_path, _vocab_tests

from ollama_engine.tokenizer import from_metadata, read_tokenizer_metadata

NAME = "gemma-4"


def test_llama_cpp_vocab_file() -> None:
    tok = _tokenizer(NAME)
    for text, expected in _vocab_tests(_vocab_path(NAME)):
        assert tok.encode(text, add_special=False, parse_special=False) == expected, text


def test_spaces_newlines_and_bytes() -> None:
    """Spaces are ▁ inside pieces (no word split), a newline run may be one token, and a character that is
    not a token is its UTF-8 bytes' <0xXX> tokens; decoding gives the text back."""
    tok = _tokenizer(NAME)
    vocab = tok.vocab
    ids = tok.encode("Hello  world\n\n\nnext", add_special=False)
    pieces = [vocab.tokens[i] for i in ids]
    assert "".join(pieces) == "Hello\u2581\u2581world\n\n\nnext"
    assert "\n\n\n" in pieces
    rare = "\U0001d11e"  # MUSICAL SYMBOL G CLEF
    if rare not in vocab.token_to_id:
        assert [vocab.tokens[i] for i in tok.encode(rare, add_special=False)] == [
            f"<0x{b:02X}>" for b in rare.encode()]
    for text in ("Hello  world\n\n\nnext", rare, " leading space", "tabs\tand  marks"):
        assert tok.decode(tok.encode(text, add_special=False)) == text


def test_bos_is_added_even_where_the_file_says_not() -> None:
    """llama.cpp overrides add_bos_token false for Gemma 4 (its PR 21500)."""
    metadata = read_tokenizer_metadata(_vocab_path(NAME))
    tok = from_metadata({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert tok.encode("hi")[0] == tok.bos_id == tok.vocab.token_to_id["<bos>"]


@pytest.mark.reference
def test_random_text_matches_llama_cpp() -> None:
    tok = _tokenizer(NAME)
    texts = ["", " ", "\n", "\n\n", " \n \n", "Hello world", "<start_of_turn>user\nhi<end_of_turn>\n"]
    _compare_with_reference(tok, _vocab_path(NAME), texts + _random_texts(tok, seed=4, count=150))
