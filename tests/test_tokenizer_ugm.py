"""The Unigram tokenizer (tokenizer.ggml.model = t5) must tokenize and detokenize exactly as llama.cpp's UGM.

Two vocabularies: nomic-embed-text v2's real one (XLM-RoBERTa's 250k pieces and sentencepiece's nmt_nfkc
charsmap, llama.cpp's models/ggml-vocab-nomic-bert-moe.gguf), and small synthetic ones that turn the
switches the real one leaves fixed: no space prefix, spaces kept, no charsmap, user-defined, unused and
byte tokens, and few pieces so that unknown characters are common.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import assets
import gguf
import pytest
from test_tokenizer import _compare_with_reference, _random_texts

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.tokenizer import Tokenizer, from_metadata

# Each line hits one rule: charsmap (NFKC, full width, ligatures, combining marks, control and zero-width
# characters), whitespace (runs, leading/trailing, tabs and newlines), scripts, emoji, unknown characters
# and special tokens inside the text.
TABLE = [
    "Hello world", " Hello  world ", "", " ", "   ", "\n", "\t\tx\n\ny", "\r\n win", "a\u3000b",
    "café naïve Ångström", "a\u0301 e\u0300 o\u0308", "ＦＵＬＬ　ｗｉｄｔｈ １２３！", "①②③ ﬁ ﬂ ™ ½ ㎏ Ⅻ",
    "我想在这里吃饭。", "ㄱㄴ한국어 텍스트", "Ελληνικά κείμενα", "नमस्ते दुनिया", "русский текст", "عربى ﷺ",
    "😁🦙.cpp 👩‍👩‍👧 🇫🇷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛", "\u200b\u200d zero\u00a0width", "\x00\x01\x7f ctl", "\U000e0001tag \U0010fffd",
    "<s>hi</s> <mask> there", "<unk><pad>", "x<mask>y", "a   <mask>   b", "x" * 60, "...!!!???", "don't 'quote'",
    "search_query: What is the capital of France?", "A\u030a\u212b\u00c5", "ǅ ǈ ß ẞ İ ı",
]


@functools.cache
def _nomic() -> tuple[Path, Tokenizer]:
    path = assets.vocab("nomic-bert-moe")
    return path, from_metadata(GGUFFile.open(path).metadata)


def test_real_vocabulary_settings() -> None:
    _, tok = _nomic()
    assert tok.vocab.model == "t5" and tok.vocab_size == 250048
    assert (tok.bos_id, tok.add_bos, tok.add_eos, tok.vocab.eos_id, tok.vocab.unk_id) == (0, True, True, 2, 3)
    ids = tok.encode("Hello world")
    assert [tok.vocab.tokens[i] for i in ids] == ["<s>", "\u2581Hello", "\u2581world", "</s>"]
    assert tok.decode(ids[1:]) == "Hello world"
    assert tok.decode(ids) == " Hello world"  # llama.cpp strips the space of the first piece only


def test_round_trip() -> None:
    _, tok = _nomic()
    for text in ("Hello world, café 我想 😁", "naïve résumé: 3.14159!"):
        assert tok.decode(tok.encode(text, add_special=False)) == text
    # nmt_nfkc and remove_extra_whitespaces change the text: spaces merged, full width folded
    assert tok.decode(tok.encode("  a \t\n b  ", add_special=False)) == "a b"
    assert tok.decode(tok.encode("ＡＢＣ", add_special=False)) == "ABC"


def test_unknown_characters_merge_into_one_token() -> None:
    _, tok = _nomic()
    ids = tok.encode("\U000e0001\U000e0002\U000e0003x", add_special=False)
    assert ids.count(tok.vocab.unk_id) == 1


@pytest.mark.reference
def test_real_vocabulary_matches_llama_cpp() -> None:
    path, tok = _nomic()
    _compare_with_reference(tok, path, TABLE + _random_texts(tok, seed=17, count=150))


# --- synthetic vocabularies ----------------------------------------------------------------------------

# "mn" first and "m", "nq" last: "mnq" is m+nq only while the unknown penalty is over 9.25
_PIECES = ["mn", "\u2581", "\u2581the", "\u2581a", "\u2581hello", "hello", "\u2581world", "world", "wor", "ld",
           "\u2581w", "e", "l", "o", "h", "d", "r", "w", "a", "t", "x", "\u2581x", "xx", "café", "\u2581caf", "é", "我",
           "想", "我想", "\u2581我", "!", "\u2581!", ".", "...", "1", "2", "12", "m", "nq"]
_USER_DEFINED = ["<tag>", "é!", "\u2581user"]  # "é!" shares its first byte with "è": normalisation stops there


def _write_vocab(path: Path, *, add_space_prefix: bool, remove_extra_whitespaces: bool, charsmap: bool) -> Path:
    """A t5 vocabulary of a few pieces (scores falling with their index), every token type, and the real
    file's architecture keys so that llama.cpp loads it vocab-only."""
    real = GGUFFile.open(assets.vocab("nomic-bert-moe"))
    tokens = ["<pad>", "</s>", "<unk>", "<s>", *_PIECES, *_USER_DEFINED, "\u2581unused", "<0x41>"]
    types = [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL,
             *[gguf.TokenType.NORMAL] * len(_PIECES), *[gguf.TokenType.USER_DEFINED] * len(_USER_DEFINED),
             gguf.TokenType.UNUSED, gguf.TokenType.BYTE]
    scores = [0.0] * 4 + [-1.0 - 0.25 * i for i in range(len(_PIECES))] + [0.0] * (len(_USER_DEFINED) + 2)
    writer = gguf.GGUFWriter(path, real.metadata["general.architecture"])
    for key, value in real.metadata.items():
        if not key.startswith(("tokenizer.", "general.architecture")):
            writer.add_key_value(key, value, *real.value_types[key])
    writer.add_tokenizer_model("t5")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_scores(scores)
    writer.add_bos_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_remove_extra_whitespaces(remove_extra_whitespaces)
    if charsmap:
        value = real.metadata["tokenizer.ggml.precompiled_charsmap"]
        writer.add_key_value("tokenizer.ggml.precompiled_charsmap", value,
                             *real.value_types["tokenizer.ggml.precompiled_charsmap"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.mark.reference
@pytest.mark.parametrize(("add_space_prefix", "remove_extra_whitespaces", "charsmap"),
                         [(True, True, True), (False, False, True), (True, False, False), (False, True, False)])
def test_synthetic_vocabularies_match_llama_cpp(tmp_path: Path, add_space_prefix: bool,
                                               remove_extra_whitespaces: bool, charsmap: bool) -> None:
    path = _write_vocab(tmp_path / "ugm.gguf", add_space_prefix=add_space_prefix,
                        remove_extra_whitespaces=remove_extra_whitespaces, charsmap=charsmap)
    tok = from_metadata(GGUFFile.open(path).metadata)
    extra = ["hello world", "x<tag>y <tag> z", "è! é! é!x", " user user", "unused A", "\u2581 hello", "xxxxx12!",
             "mnq", "amnq mnqb"]
    _compare_with_reference(tok, path, TABLE + extra + _random_texts(tok, seed=71, count=60))


def test_defaults_without_keys() -> None:
    """llama.cpp's defaults for t5: EOS 1, unknown 2, no BOS, EOS added, no space prefix."""
    tok = from_metadata(_minimal(["<pad>", "</s>", "<unk>", "\u2581a", "a"]))
    assert (tok.bos_id, tok.add_bos, tok.add_eos, tok.vocab.unk_id) == (None, False, True, 2)
    assert tok.encode("a a") == [4, 3, 1]


def test_bad_charsmap_is_rejected() -> None:
    with pytest.raises(ValueError, match="precompiled_charsmap"):
        from_metadata({**_minimal(["<pad>", "</s>", "<unk>"]),
                       "tokenizer.ggml.precompiled_charsmap": [255, 0, 0, 0, 1]})


def _minimal(tokens: list[str]) -> dict[str, Any]:
    types = [3, 3, 2] + [1] * (len(tokens) - 3)
    return {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [-1.0] * (len(tokens) - 3)}
