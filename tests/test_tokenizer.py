"""Tokenizers from GGUF vocabularies must tokenize exactly as llama.cpp does.

The vocab test files are llama.cpp's own (models/ggml-vocab-*.gguf.inp/.out, tokenized with add_special and
parse_special off); the reference tests compare with llama.cpp itself on random text.
"""

from __future__ import annotations

import ctypes
import functools
import random
import unicodedata
from pathlib import Path
from typing import Any

import assets
import pytest

from ollama_engine.tokenizer import Tokenizer, from_gguf, from_metadata, read_tokenizer_metadata

# Every vocabulary in llama.cpp's models/ folder with test files and a tokenizer kind we support.
# Not here: gemma-4 (tokenizer.ggml.model "gemma4": test_tokenizer_gemma4.py); nomic-bert-moe ("t5",
# Unigram) has no test files (test_tokenizer_ugm.py compares it with llama.cpp); aquila, baichuan and
# gpt-neox have no test files.
VOCABS = ["llama-spm", "phi-3", "bert-bge", "gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-coder",
          "deepseek-llm", "falcon", "mpt", "refact", "starcoder", "command-r"]
SEPARATOR = "\n__ggml_vocab_test__\n"


def _vocab_path(name: str) -> Path:
    return assets.vocab(name)


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    return from_gguf(_vocab_path(name))


def _vocab_tests(path: Path) -> list[tuple[str, list[int]]]:
    """Inputs split on the marker line (no newline translation), outputs one line of ids per input."""
    raw = Path(f"{path}.inp").read_bytes().decode()
    inputs = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        inputs.pop()
    outputs = [[int(t) for t in line.split()] for line in Path(f"{path}.out").read_text().splitlines()]
    assert len(inputs) == len(outputs) > 0
    return list(zip(inputs, outputs, strict=True))


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vocab_files(name: str) -> None:
    tok = _tokenizer(name)
    for text, expected in _vocab_tests(_vocab_path(name)):
        assert tok.encode(text, add_special=False, parse_special=False) == expected, text


def test_constructor_from_metadata_matches_file(stories_path: Path) -> None:
    metadata = read_tokenizer_metadata(stories_path)
    from_dict, from_file = from_metadata(metadata), from_gguf(stories_path)
    text = "Once upon a time, there was a little girl named Lily."
    assert from_dict.encode(text) == from_file.encode(text)
    assert from_dict.vocab_size == from_file.vocab_size == 512


def test_spm_bos_eos_and_leading_space() -> None:
    tok = _tokenizer("llama-spm")
    assert (tok.bos_id, tok.add_bos, tok.add_eos) == (1, True, False)
    plain = tok.encode("Hello world", add_special=False)
    assert tok.encode("Hello world") == [1, *plain]
    assert tok.vocab.tokens[plain[0]] == "\u2581Hello"
    assert tok.decode(plain) == "Hello world"
    assert tok.decode([1, *plain]) == " Hello world"  # llama.cpp keeps the space when BOS leads
    assert tok.is_eog(2) and tok.eos_ids == {2}


def test_spm_byte_fallback_and_partial_utf8() -> None:
    tok = _tokenizer("llama-spm")
    text = "\U0001f999"  # no token for this emoji: four byte tokens
    ids = tok.encode(text, add_special=False)
    pieces = [tok.token_piece(i) for i in ids]
    assert [tok.vocab.tokens[i] for i in ids[-4:]] == [f"<0x{b:02X}>" for b in text.encode()]
    assert all(len(p) == 1 for p in pieces[-4:])
    assert b"".join(pieces).lstrip(b" ") == text.encode()
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut character decodes to U+FFFD, no error


def test_special_tokens_in_text() -> None:
    tok = _tokenizer("qwen2")
    start, end = tok.vocab.token_to_id["<|im_start|>"], tok.vocab.token_to_id["<|im_end|>"]
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tok.encode(text)
    assert parsed[0] == start and parsed[-1] == end and parsed.count(start) == 1
    literal = tok.encode(text, parse_special=False)
    assert start not in literal and end not in literal
    assert tok.decode(literal) == text
    assert tok.decode(parsed) == "user\nhi"  # control tokens are left out unless asked for
    assert tok.decode(parsed, special=True) == text
    assert tok.token_piece(end) == b"<|im_end|>"


def test_end_of_generation_ids() -> None:
    llama3 = _tokenizer("llama-bpe")
    named = {llama3.vocab.token_to_id[t] for t in ("<|eot_id|>", "<|end_of_text|>")}
    assert named <= llama3.eos_ids and all(llama3.is_eog(i) for i in named)
    assert not llama3.is_eog(llama3.vocab.token_to_id["<|begin_of_text|>"])
    assert llama3.encode("hi")[0] == llama3.bos_id == llama3.vocab.token_to_id["<|begin_of_text|>"]
    qwen = _tokenizer("qwen2")
    assert {qwen.vocab.token_to_id[t] for t in ("<|im_end|>", "<|endoftext|>")} <= qwen.eos_ids
    assert qwen.encode("hi") == qwen.encode("hi", add_special=False)  # qwen2 adds no BOS


def test_bert_wraps_in_cls_and_sep() -> None:
    tok = _tokenizer("bert-bge")
    ids = tok.encode("Hello, World!")
    assert tok.vocab.tokens[ids[0]] == "[CLS]" and tok.vocab.tokens[ids[-1]] == "[SEP]"
    assert ids[1:-1] == tok.encode("hello, world!", add_special=False)
    assert tok.decode(ids[1:-1]) == " hello, world!"  # every word piece starts with U+2581


def test_byte_level_pieces_are_raw_bytes() -> None:
    tok = _tokenizer("gpt-2")
    text = "naïve café 🦙"
    ids = tok.encode(text)
    assert b"".join(tok.token_piece(i) for i in ids) == text.encode()
    assert tok.decode(ids) == text


def test_bad_metadata_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported tokenizer model 'rwkv'"):
        from_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="unsupported pre-tokenizer 'nonesuch'"):
        from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonesuch",
                       "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": []})
    with pytest.raises(ValueError, match="tokenizer.ggml.merges must hold strings, not bool"):  # found by fuzzing
        from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [True]})
    with pytest.raises(ValueError, match="no 'tokenizer.ggml.model'"):
        from_metadata({"general.architecture": "llama"})
    with pytest.raises(IndexError):
        _tokenizer("gpt-2").token_piece(10**6)


# --- differential tests against llama.cpp ---------------------------------------------------------------

# Characters assigned in this Python's Unicode database, so both sides agree on their categories.
_ASSIGNED = [chr(c) for c in range(0x20, 0x30000)
             if unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")]
_SNIPPETS = [" ", "  ", "\n", "\n\n", "\t", " \n ", "'s", "'LL", "123456", "Hello", " world", "ÄÖü", "😁",
             "🦙.cpp", "我想", "нещо", "!!", "...", "\r\n", "▁"]


def _random_texts(tok: Tokenizer, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    specials = [tok.vocab.tokens[i] for i in tok.vocab.special_ids[:50]]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.4:
                parts.append(rng.choice(_SNIPPETS))
            elif roll < 0.5 and specials:
                parts.append(rng.choice(specials))
            elif roll < 0.75:
                parts.append("".join(chr(rng.randint(0x20, 0x7E)) for _ in range(rng.randint(1, 8))))
            else:
                parts.append("".join(rng.choice(_ASSIGNED) for _ in range(rng.randint(1, 5))))
        texts.append("".join(parts))
    return texts




def _reference_detokenize(llm: Any, ids: list[int], special: bool) -> bytes:
    """llama_detokenize itself (Llama.detokenize re-implements it differently in Python)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buf, size, False, special)
    assert 0 <= n <= size
    return buf.raw[:n]


def _reference_piece(llm: Any, token_id: int) -> bytes:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token_id, buf, 256, 0, True)
    assert 0 <= n <= 256
    return buf.raw[:n]


def _compare_with_reference(tok: Tokenizer, path: Path, texts: list[str]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        _compare_all(tok, llm, texts)
    finally:
        llm.close()


def _compare_all(tok: Tokenizer, llm: Any, texts: list[str]) -> None:
    for text in texts:
        for add_special in (True, False):
            for parse_special in (True, False):
                expected = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
                got = tok.encode(text, add_special=add_special, parse_special=parse_special)
                assert got == expected, (text, add_special, parse_special)
        ids = tok.encode(text)
        for special in (False, True):
            assert tok.decode(ids, special=special) == _reference_detokenize(llm, ids, special).decode(
                "utf-8", errors="replace"), (text, special)
    for token_id in [*range(0, tok.vocab_size, max(1, tok.vocab_size // 2000)), *tok.vocab.special_ids]:
        assert tok.token_piece(token_id) == _reference_piece(llm, token_id), token_id


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("name", VOCABS)
def test_random_text_matches_llama_cpp(name: str) -> None:
    tok = _tokenizer(name)
    _compare_with_reference(tok, _vocab_path(name), _random_texts(tok, seed=VOCABS.index(name), count=150))


@pytest.mark.reference
def test_stories260k_matches_llama_cpp(stories_path: Path) -> None:
    tok = from_gguf(stories_path)
    texts = ["Once upon a time, there was a little girl named Lily.", "", " ", "Tom said: \"Hi!\"\n\nThe end."]
    _compare_with_reference(tok, stories_path, texts + _random_texts(tok, seed=260, count=100))
