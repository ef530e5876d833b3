"""A GGUF vocabulary with llama.cpp's rules for special tokens, added BOS/EOS and token pieces.

Everything here is shared by the tokenizer kinds; what differs between them (how plain text becomes ids)
lives in spm.py, bpe.py, wpm.py and ugm.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntFlag
from itertools import compress, repeat
from typing import Any


class TokenAttr(IntFlag):
    """llama.cpp's per-token attributes (llama_token_attr)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


# tokenizer.ggml.token_type values (gguf.TokenType) -> attributes.
_ATTR_OF_TYPE = {
    1: TokenAttr.NORMAL,
    2: TokenAttr.UNKNOWN,
    3: TokenAttr.CONTROL,
    4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED,
    6: TokenAttr.BYTE,
}

# Default special ids per tokenizer.ggml.model, before the GGUF keys override them.
_DEFAULT_IDS: dict[str, dict[str, int | None]] = {
    "llama": {"bos": 1, "eos": 2, "unk": 0, "sep": None, "pad": None},
    "bert": {"bos": 101, "eos": None, "unk": 100, "sep": 102, "pad": 0},
    "gpt2": {"bos": 11, "eos": 11, "unk": None, "sep": None, "pad": None},
    "t5": {"bos": None, "eos": 1, "unk": 2, "sep": None, "pad": 0},
    "gemma4": {"bos": None, "eos": None, "unk": None, "sep": None, "pad": None},  # all from the file
}
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id",
    "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}

# Texts llama.cpp recognises as end-of-turn / end-of-message / FIM tokens when the GGUF does not name them;
# a token found this way is treated as a control token.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts that end generation whatever the GGUF says (llama.cpp's special_eog_ids heuristic).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})


@dataclass(frozen=True)
class SpecialFragment:
    """A special token found inside the text: it is emitted as one id, never tokenized."""

    token_id: int


Fragment = str | SpecialFragment


class Vocabulary:
    """Token texts, scores, attributes and special ids read from GGUF metadata, as llama.cpp loads them."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self.model: str = _get(metadata, "tokenizer.ggml.model", str)
        if self.model not in _DEFAULT_IDS:
            raise ValueError(f"unsupported tokenizer model {self.model!r} (tokenizer.ggml.model); "
                             f"supported: {', '.join(_DEFAULT_IDS)}")
        self.pre: str = _get(metadata, "tokenizer.ggml.pre", str, "")
        self.general_name: str = _get(metadata, "general.name", str, "")
        self.architecture: str = _get(metadata, "general.architecture", str, "")
        if self.architecture == "gptoss" and self.pre in ("", "default"):
            self.pre = "gpt-4o"  # Ollama's own gpt-oss files say "default" and Ollama splits them with o200k's regex

        # A 128k vocabulary is read at every load (a runner's time to ready): the per-token lists and the index
        # are built with map/zip at C speed rather than a Python loop per token (128k tokens: 0.074 -> 0.05 s CPU).
        tokens = _as_texts(_get(metadata, "tokenizer.ggml.tokens", list), "tokenizer.ggml.tokens")
        self.tokens: list[str] = tokens if all(tokens) else [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(self.tokens)
        if n == 0:
            raise ValueError("tokenizer.ggml.tokens is empty")
        self.token_to_id: dict[str, int] = dict(zip(self.tokens, range(n), strict=True))
        if len(self.token_to_id) != n:
            raise ValueError("tokenizer.ggml.tokens contains duplicate tokens")

        scores = _get(metadata, "tokenizer.ggml.scores", list, None)
        self.scores: list[float] = list(map(float, scores)) if scores is not None else [0.0] * n
        types = _get(metadata, "tokenizer.ggml.token_type", list, None)
        if types is None:
            self.attrs: list[TokenAttr] = [TokenAttr.NORMAL] * n
        else:
            self.attrs = list(map(_ATTR_OF_TYPE.get, map(int, types), repeat(TokenAttr.UNDEFINED)))
        if len(self.scores) < n or len(self.attrs) < n:
            raise ValueError("tokenizer.ggml.scores / token_type are shorter than tokenizer.ggml.tokens")
        self.scores, self.attrs = self.scores[:n], self.attrs[:n]
        self.merges: list[str] = _as_texts(_get(metadata, "tokenizer.ggml.merges", list, []), "tokenizer.ggml.merges")

        ids = self._special_ids(metadata)
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]
        self.sep_id: int | None = ids["sep"]
        self.pad_id: int | None = ids["pad"]
        self.eog_ids: frozenset[int] = self._end_of_generation_ids(ids)
        self._apply_name_attributes()
        # Longest first: a longer special token wins over a shorter one it contains.
        special = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
        is_special = {attr for attr in set(self.attrs) if attr & special}.__contains__  # a few distinct values
        self.special_ids: list[int] = sorted(compress(range(n), map(is_special, self.attrs)),
                                             key=lambda i: -len(self.tokens[i]))

        # None when the GGUF does not say: the default then depends on the tokenizer kind.
        self.add_bos: bool | None = _get(metadata, "tokenizer.ggml.add_bos_token", bool, None)
        self.add_eos: bool = _get(metadata, "tokenizer.ggml.add_eos_token", bool, self.model == "t5")
        self.add_space_prefix: bool = _get(metadata, "tokenizer.ggml.add_space_prefix", bool,
                                           self.model == "llama")
        self.lowercase: bool = _get(metadata, "tokenizer.ggml.normalizer.lowercase", bool, True)
        self.strip_accents: bool = _get(metadata, "tokenizer.ggml.normalizer.strip_accents", bool,
                                        self.lowercase)

    def __len__(self) -> int:
        return len(self.tokens)

    def _special_ids(self, metadata: Mapping[str, Any]) -> dict[str, int | None]:
        n = len(self.tokens)
        ids: dict[str, int | None] = dict.fromkeys(_ID_KEYS)
        ids.update({k: v if v is not None and v < n else None for k, v in _DEFAULT_IDS[self.model].items()})
        if self.pre in ("chatglm-bpe", "glm4", "glm5"):
            ids["bos"] = None  # llama.cpp: GLM has no BOS unless the file names one
        for name, key in _ID_KEYS.items():
            value = metadata.get(key)
            if value is not None and 0 <= int(value) < n:  # out-of-range ids keep the default, as llama.cpp
                ids[name] = int(value)
        # Name-based detection of eot/eom/fim tokens; each found token also becomes a control token.
        detect = {"eot": _EOT_TEXTS, "eom": _EOM_TEXTS, **_FIM_TEXTS}
        for name, texts in detect.items():
            if ids.get(name) is not None:
                continue
            for text in texts:
                if text in self.token_to_id:
                    ids[name] = self.token_to_id[text]
                    self.attrs[ids[name]] |= TokenAttr.CONTROL
                    break
        return ids

    def _end_of_generation_ids(self, ids: dict[str, int | None]) -> frozenset[int]:
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom") if ids[k] is not None}
        for text in _EOG_TEXTS & self.token_to_id.keys():
            token_id = self.token_to_id[text]
            eog.add(token_id)
            self.attrs[token_id] |= TokenAttr.CONTROL
        # gpt-oss renders these tokens, and its <|end|> separates messages rather than ending generation.
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in self.token_to_id:
                self.attrs[self.token_to_id[text]] = TokenAttr.USER_DEFINED
        texts = {self.tokens[i] for i in eog}
        has_call = bool(texts & {"<|call|>", "<|calls|>"})
        if "<|end|>" in texts and has_call and texts & {"<|return|>", "<|flush|>"}:
            end_id = self.token_to_id["<|end|>"]
            eog.discard(end_id)
            self.attrs[end_id] = TokenAttr.USER_DEFINED
        # Gemma 4 and PLaMo have a plain </s> (llama.cpp: "'</s>' is a normal token here")
        if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
            s_id = self.token_to_id["</s>"]
            eog.discard(s_id)
            self.attrs[s_id] = TokenAttr.NORMAL
        return frozenset(eog)

    def _apply_name_attributes(self) -> None:
        """llama.cpp strips spaces around some special tokens, chosen by model name."""
        name = self.general_name.lower()
        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in self.architecture for s in ("nomic-bert-moe", "jina-bert-v3")):
            self._set_attr("<mask>", TokenAttr.LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            special = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
            for i, attr in enumerate(self.attrs):
                if attr & special:
                    self.attrs[i] |= TokenAttr.RSTRIP
            self._set_attr("</s>", TokenAttr.RSTRIP, True)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                self._set_attr(text, TokenAttr.RSTRIP, False)
        elif "modern-bert" in name:
            self._set_attr("[MASK]", TokenAttr.LSTRIP, True)

    def _set_attr(self, text: str, attr: TokenAttr, value: bool) -> None:
        if text not in self.token_to_id:
            return
        i = self.token_to_id[text]
        self.attrs[i] = self.attrs[i] | attr if value else self.attrs[i] & ~attr

    def split_special(self, text: str, parse_special: bool) -> list[Fragment]:
        """Cut special tokens out of the text (llama.cpp's tokenizer_st_partition).

        User-defined tokens are always matched; control and unknown tokens only with parse_special.
        """
        fragments: list[Fragment] = [text] if text else []
        for token_id in self.special_ids:
            attr = self.attrs[token_id]
            if not parse_special and attr & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
                continue
            piece = self.tokens[token_id]
            if not any(isinstance(f, str) and piece in f for f in fragments):
                continue
            split: list[Fragment] = []
            for fragment in fragments:
                if not isinstance(fragment, str) or piece not in fragment:
                    split.append(fragment)
                    continue
                parts = fragment.split(piece)
                for k, part in enumerate(parts):
                    if k > 0 and attr & TokenAttr.RSTRIP:
                        part = part.lstrip(_C_SPACE)
                    if k < len(parts) - 1:
                        if attr & TokenAttr.LSTRIP:
                            part = part.rstrip(_C_SPACE)
                        split.extend([part, SpecialFragment(token_id)] if part else [SpecialFragment(token_id)])
                    elif part:
                        split.append(part)
            fragments = split
        return fragments

    def piece(self, token_id: int, special: bool = True) -> bytes:
        """The raw bytes one token stands for (llama.cpp's token_to_piece with lstrip 0)."""
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} out of range for a vocabulary of {len(self.tokens)}")
        attr = self.attrs[token_id]
        text = self.tokens[token_id]
        if attr & (TokenAttr.UNKNOWN | TokenAttr.CONTROL):
            return text.encode() if special else b""
        if attr & TokenAttr.USER_DEFINED:
            return text.encode()
        if attr & TokenAttr.NORMAL:
            if self.model == "gpt2":
                return byte_level_decode(text)
            return text.replace("\u2581", " ").encode()
        if attr & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""


# C isspace(): the characters llama.cpp strips next to LSTRIP/RSTRIP tokens.
_C_SPACE = " \t\n\v\f\r"


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: printable character -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_table()


def byte_level_decode(text: str) -> bytes:
    """Map a byte-level BPE token back to its bytes; characters outside the table are marked as llama.cpp does."""
    out = bytearray()
    for char in text:
        if char in _BYTE_OF_CHAR:
            out.append(_BYTE_OF_CHAR[char])
        else:
            out += f"[UNK_BYTE_0x{char.encode().hex()}{text}]".encode()
    return bytes(out)


def _as_text(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _as_texts(values: list[str | bytes], key: str) -> list[str]:
    """_as_text of each; the GGUF reader already gives str, and then the 400k values of a 128k vocabulary and
    its merges are copied at C speed."""
    types = set(map(type, values))
    if not types <= {str, bytes}:
        raise ValueError(f"{key} must hold strings, not {', '.join(sorted(t.__name__ for t in types - {str, bytes}))}")
    if bytes in types:
        return [_as_text(v) for v in values]
    return list(values)


def _get(metadata: Mapping[str, Any], key: str, kind: type, *default: Any) -> Any:
    if key not in metadata:
        if default:
            return default[0]
        raise ValueError(f"GGUF metadata has no {key!r}: not a model with a tokenizer")
    value = metadata[key]
    if kind is str:
        value = _as_text(value)
    elif kind is list and not isinstance(value, (str, bytes)):
        value = list(value)
    if not isinstance(value, kind):
        raise ValueError(f"GGUF metadata {key!r} should be {kind.__name__}, got {type(value).__name__}")
    return value
