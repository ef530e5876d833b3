"""Every pre-tokenizer (tokenizer.ggml.pre) that llama.cpp has no vocab test file for splits text as llama.cpp does.

llama.cpp's models/ folder has vocab files for a dozen pre-tokenizers (test_tokenizer.py); the others
(gpt-oss's and Llama 4's gpt-4o, Mistral's tekken, DeepSeek V3's, ...) are checked here on GPT-2's byte-level
vocabulary relabelled with each pre-tokenizer name: the splitting regexes decide where tokens may start, so any
difference from llama.cpp shows as different ids on text that mixes cases, scripts, digits and punctuation.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from test_tokenizer import _random_texts, _reference_detokenize

from ollama_engine.tokenizer import from_gguf, from_metadata, read_tokenizer_metadata
from ollama_engine.tokenizer.bpe import PRE_TOKENIZERS

CHECKED_BY_VOCAB_FILES = {"", "default", "llama-bpe", "gpt-2", "qwen2", "qwen35", "deepseek-coder", "deepseek-llm",
                          "falcon", "mpt", "refact", "starcoder", "command-r"}
TEXTS = [
    "HelloWorld and HELLOworld, don't I'M we'LL", "ÉCOLE école Straße İstanbul ǅemal", "e\u0301te\u0301 naïve café",
    "1234567 89 3.14159 1,000,000", "こんにちは、カタカナ！ 漢字テスト 한국어 텍스트",
    "path/to/file.txt\r\nnext\n\n\tline", "漢字かな混じりABCdef中文Ünïcode",
    "   leading and trailing   ", "emoji 🦙🚀 mixed: a+b=c; x<y>z", "«Quoted» — “curly” ‘single’ …", "Ǆ ǅ ǆ ᾈ ᾀ",
    "Привет МИР мир", "مرحبا بالعالم ١٢٣", "नमस्ते दुनिया", "snake_case camelCase PascalCase kebab-case",
]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _write_vocab(folder: Path, pre: str, bos: bool = True) -> Path:
    """A byte-level vocabulary where every substring of up to 4 characters of TEXTS is a token with its merge:
    a piece of text merges across whatever boundary the pre-tokenizer did not cut, so ids show every cut."""
    chars = _byte_chars()
    tokens = list(chars)
    merges: list[str] = []
    known = set(tokens)
    for length in range(2, 5):
        for text in TEXTS:
            encoded = "".join(chars[b] for b in text.encode())
            for i in range(len(encoded) - length + 1):
                piece = encoded[i:i + length]
                if piece not in known:
                    known.add(piece)
                    tokens.append(piece)
                    merges.append(f"{piece[:-1]} {piece[-1]}")
    tokens.append("<|endoftext|>")
    path = folder / f"vocab-{pre}-{bos}.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    if bos:
        writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _one_name_each() -> list[str]:
    """One name per distinct pre-tokenizer (the others are aliases of it) not covered by a vocab file."""
    covered = {PRE_TOKENIZERS[name] for name in CHECKED_BY_VOCAB_FILES}
    names: dict[object, str] = {}
    for name, pre in PRE_TOKENIZERS.items():
        if pre not in covered:
            names.setdefault(pre, name)
    return sorted(names.values())


@pytest.mark.reference
@pytest.mark.parametrize("pre", _one_name_each())
def test_pre_tokenizer_matches_llama_cpp(tmp_path: Path, pre: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = _write_vocab(tmp_path, pre)
    tok = from_gguf(path)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS + _random_texts(tok, seed=len(pre), count=40):
            for add_special in (True, False):
                expected = llm.tokenize(text.encode(), add_bos=add_special, special=True)
                assert tok.encode(text, add_special=add_special) == expected, (pre, text, add_special)
            detokenized = _reference_detokenize(llm, expected, special=False).decode(errors="replace")
            assert tok.decode(expected) == detokenized, (pre, text)
    finally:
        llm.close()


def test_ollama_gpt_oss_files_split_as_gpt_4o(tmp_path: Path) -> None:
    """Ollama writes tokenizer.ggml.pre "default" into its gpt-oss files and splits them with o200k's regex."""
    gpt_4o = from_gguf(_write_vocab(tmp_path, "gpt-4o"))
    metadata = read_tokenizer_metadata(_write_vocab(tmp_path, "default"))
    as_llama = from_metadata(metadata)
    as_ollama_gpt_oss = from_metadata({**metadata, "general.architecture": "gptoss"})
    for text in TEXTS:
        assert as_ollama_gpt_oss.encode(text) == gpt_4o.encode(text), text
    assert any(as_llama.encode(text) != gpt_4o.encode(text) for text in TEXTS)  # the names do differ


@pytest.mark.reference
@pytest.mark.parametrize("pre", ["chatglm-bpe", "glm4"])
def test_glm_has_no_bos_unless_the_file_names_one(tmp_path: Path, pre: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    for bos in (False, True):
        path = _write_vocab(tmp_path, pre, bos=bos)
        tok = from_gguf(path)
        assert (tok.bos_id is not None) == bos
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        try:
            for text in TEXTS[:4]:
                assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), (pre, bos)
        finally:
            llm.close()
