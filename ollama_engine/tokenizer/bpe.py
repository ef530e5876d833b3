"""Byte-level BPE (tokenizer.ggml.model = gpt2) on the tokenizers library.

llama.cpp splits text with the regexes named by tokenizer.ggml.pre (each regex splits the pieces the one
before it left, keeping the text between matches), maps bytes to GPT-2's printable characters, then merges
by rank. The same pipeline is a tokenizers Sequence of isolated Splits, ByteLevel and a BPE model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from ollama_engine.tokenizer.vocab import Vocabulary

# The regexes are llama.cpp's (src/llama-vocab.cpp), written for Oniguruma: case-insensitive groups spelt out
# as [sS], and "end of text" as \z because Oniguruma's $ also matches before a newline.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[一-龥ࠀ-一가-퟿]+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+\z",
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp spells \p{Lu}-like classes as "a letter that is not a-z" (and \p{Ll}-like as not A-Z).
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# Kimi K2's pattern as llama.cpp's hand-written splitter runs it: letter runs without its case classes.
_KIMI_K2 = (r"\p{Han}+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp treats one tokenizer.ggml.pre value."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False  # a whole pre-token that is in the vocabulary is taken as is
    add_bos: bool = False  # default when the GGUF has no tokenizer.ggml.add_bos_token


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_PRE = PreTokenizer((_GPT2,))
_STARCODER_PRE = PreTokenizer(_STARCODER)
_QWEN2_PRE = PreTokenizer((_QWEN2,), clean_spaces=False)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "": PreTokenizer(_DEFAULT),
    "default": PreTokenizer(_DEFAULT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3_PRE),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM, clean_spaces=False),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER, clean_spaces=False),
    "falcon": PreTokenizer(_FALCON),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), _GPT2_PRE),
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), _STARCODER_PRE),
    "command-r": PreTokenizer(_STARCODER, clean_spaces=False),
    "smollm": PreTokenizer(_STARCODER, clean_spaces=False),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2_PRE),
    "megrez": PreTokenizer((_QWEN2,)),
    "stablelm2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_QWEN35,), clean_spaces=False),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
                    PreTokenizer(_DEEPSEEK3, clean_spaces=False)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
                    PreTokenizer((_GPT4O,), clean_spaces=False)),
    "tekken": PreTokenizer((_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True),
    **dict.fromkeys(("bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    "poro-chat": PreTokenizer((_BLOOM,), clean_spaces=False),
    "viking": PreTokenizer((_BLOOM, r"\p{N}"), clean_spaces=False),
    "seed-coder": PreTokenizer((_SEED_CODER,), clean_spaces=False),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((_BAILINGMOE,), clean_spaces=False)),
    **dict.fromkeys(("trillion", "granite-docling"), PreTokenizer((_GPT2,), clean_spaces=False)),
    **dict.fromkeys(("hunyuan", "solar-open", "grok-2"), PreTokenizer((_QWEN2,), clean_spaces=False)),
    "kimi-k2": PreTokenizer((_KIMI_K2,), clean_spaces=False),
    "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    **dict.fromkeys(("glm4", "glm5"), PreTokenizer((_LLAMA3,), ignore_merges=True)),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2), clean_spaces=False),  # lines first, then Qwen2's split
}


class BytePairSegmenter:
    """Turns plain text into ids the way llama.cpp's BPE tokenizer does.

    The BPE model (a 128k vocabulary's 280k merges: ~0.35 s of GIL-holding work) is built at the first
    encode or by `prepare()`, not here: a runner reports ready when its weights are in and builds it right
    after, so loading a model does not wait for it (a request that comes first waits). The vocabulary and its
    pre-tokenizer are checked here, at load; the build itself leaves out merges tokenizers refuses
    (`_bpe_model`), so it has nothing left to fail on.
    """

    def __init__(self, vocab: Vocabulary) -> None:
        if vocab.pre not in PRE_TOKENIZERS:
            raise ValueError(f"unsupported pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre); "
                             f"supported: {', '.join(sorted(p for p in PRE_TOKENIZERS if p))}")
        pre = PRE_TOKENIZERS[vocab.pre]
        self.clean_spaces = pre.clean_spaces
        self.add_bos_default = pre.add_bos
        self._vocab, self._ignore_merges = vocab, pre.ignore_merges
        self._pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None

    def prepare(self) -> None:
        """Build the BPE model now (idempotent, thread-safe)."""
        if self._tokenizer is not None:
            return
        with self._lock:
            if self._tokenizer is None:
                tokenizer = Tokenizer(_bpe_model(self._vocab, self._ignore_merges))
                tokenizer.pre_tokenizer = self._pre_tokenizer
                self._tokenizer = tokenizer

    def encode(self, text: str, after_special: bool) -> list[int]:
        if self._tokenizer is None:
            self.prepare()
        assert self._tokenizer is not None
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _merge_pairs(vocab: Vocabulary) -> list[tuple[str, str]]:
    """Merges as (left, right) pairs in rank order; the first of duplicate pairs keeps its rank.

    Like llama.cpp, the split is at the first space after the first character. A 128k vocabulary has
    280k merges, split at every load: the common case runs at C speed (a merge and its pair determine
    each other, so duplicates are dropped as strings, whose hashes are cached: 0.155 -> 0.108 s).
    """
    if any(merge.startswith(" ") for merge in vocab.merges):
        split = [(m[:cut], m[cut + 1:]) if cut > 0 else (m,) for m in vocab.merges for cut in [m.find(" ", 1)]]
        return list(dict.fromkeys(p for p in split if len(p) == 2))  # type: ignore[misc]
    return [merge.partition(" ")[::2] for merge in dict.fromkeys(vocab.merges) if " " in merge]  # type: ignore[misc]


def _bpe_model(vocab: Vocabulary, ignore_merges: bool) -> models.BPE:
    """tokenizers refuses a merge whose parts or result are not tokens: such merges are left out (none of
    llama.cpp's test vocabularies has one, so checking 280k merges first would only cost time)."""
    merges = _merge_pairs(vocab)
    try:
        return models.BPE(vocab=dict(vocab.token_to_id), merges=merges, ignore_merges=ignore_merges)
    except Exception:
        known = vocab.token_to_id
        merges = [(a, b) for a, b in merges if a in known and b in known and a + b in known]
        return models.BPE(vocab=dict(known), merges=merges, ignore_merges=ignore_merges)
