"""Structured outputs (issue 15): `format` and GBNF grammars, sampled under llguidance.

Most tests drive a GrammarMatcher with random logits at temperature 1 on real vocabularies (llama.cpp's
vocab files): the adversarial case, since nothing steers the walk towards short or tidy output. Every
finished text is checked by an independent parser (json.loads and a small schema check, or a regular
expression written from the GBNF). tests/test_grammar_runner.py covers the runner and the API.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import assets
import numpy as np
import pytest

from ollama_engine.runner.text import incomplete_utf8
from ollama_engine.sample import GrammarError, GrammarMatcher, GrammarVocab, Sampler, format_grammar
from ollama_engine.sample.grammar import SPECIAL_MARK, token_bytes
from ollama_engine.sample.grammar_text import GRAMMAR_JSON, JSON_OPTIONS, schema_grammar, to_llguidance
from ollama_engine.tokenizer import Tokenizer, from_gguf, from_metadata

GRAMMARS = Path(__file__).resolve().parent / "data" / "grammars"  # from llama.cpp, see data/README.md
FAMILIES = {"spm": "llama-spm", "bpe": "gpt-2"}  # SentencePiece with byte fallback; byte-level BPE
RUNS = 200

# A nested schema with every kind of value; bounds keep random walks short (strings are capped, and
# integers have ranges), not valid: validity is what the tests check.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "address"],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tokenizer(request) -> Tokenizer:
    return from_gguf(assets.vocab(FAMILIES[request.param]))


def generate(tokenizer: Tokenizer, matcher: GrammarMatcher, seed: int, max_tokens: int = 1500,
             boost: float = 0.0) -> tuple[bytes, str]:
    """Random logits at temperature 1 through the grammar: the text and how it ended (eog, complete, cap).

    `boost` is added to the logits of end-of-generation tokens and of one-byte punctuation and whitespace
    tokens, so that walks through open-ended grammars tend to end.
    """
    rng = np.random.default_rng(seed)
    sampler = Sampler(temperature=1.0, top_k=40, top_p=0.9, min_p=0.0, seed=seed)
    favoured = sorted(tokenizer.eos_ids) + structural_tokens(tokenizer) if boost else []
    pieces: list[bytes] = []
    for _ in range(max_tokens):
        logits = rng.random(tokenizer.vocab_size, dtype=np.float32) * 8
        logits[favoured] += boost
        token = matcher.sample(sampler, logits)
        if token in tokenizer.eos_ids:
            return b"".join(pieces), "eog"
        matcher.accept(token)
        pieces.append(tokenizer.token_piece(token))
        if matcher.finished:
            return b"".join(pieces), "complete"
    return b"".join(pieces), "cap"


@functools.cache
def structural_tokens(tokenizer: Tokenizer) -> list[int]:
    """Tokens of one punctuation or whitespace byte."""
    return [i for i, piece in enumerate(token_bytes(tokenizer)[0])
            if len(piece) == 1 and piece.isascii() and not piece.isalnum()]


def check_schema(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """The keywords SCHEMA uses, with Ollama's semantics: no property beyond those declared."""
    if "enum" in schema:
        assert value in schema["enum"], path
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), path
        properties = schema.get("properties", {})
        assert set(value) <= set(properties), f"{path}: undeclared {set(value) - set(properties)}"
        assert set(schema.get("required", [])) <= set(value), f"{path}: missing required properties"
        for key, item in value.items():
            check_schema(item, properties[key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), path
        for i, item in enumerate(value):
            check_schema(item, schema["items"], f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), path
    elif kind in ("integer", "number"):
        assert isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool), path
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), path
    elif kind == "boolean":
        assert isinstance(value, bool), path


def whitespace_outside_strings(text: str) -> int:
    """The longest run of whitespace between JSON tokens."""
    longest = run = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
            continue
        in_string = char == '"'
        run = run + 1 if char in " \t\n\r" else 0
        longest = max(longest, run)
    return longest


# ---------------------------------------------------------------- format -> grammar (the API's side)


def test_format_values_as_ollama_reads_them():
    assert format_grammar(None) == format_grammar("") == ""
    assert format_grammar("json") == GRAMMAR_JSON
    assert format_grammar({"type": "object"}).startswith("%llguidance {}\nstart: %json ")
    for value, raw in [("X", '"\\"X\\""'), ("JSON", '"\\"JSON\\""'), (5, '"5"'), (["a"], '"[\\"a\\"]"')]:
        with pytest.raises(GrammarError) as err:
            format_grammar(value)
        assert str(err.value) == f'invalid format: {raw}; expected "json" or a valid JSON Schema object'


@pytest.mark.parametrize(("schema", "why"), [
    ({"$ref": "#/$defs/missing"}, "Pointer '/$defs/missing' does not exist"),
    ({"type": "frobnicate"}, "Invalid type: frobnicate"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
])
def test_invalid_schema_says_why(schema, why):
    with pytest.raises(GrammarError) as err:
        format_grammar(schema)
    message = str(err.value)
    assert message.startswith("invalid JSON schema in format: ") and why in message
    assert "%llguidance" not in message and "x-guidance" not in message  # our wrapping is not the user's error


def test_schema_objects_get_no_undeclared_properties_unless_they_say_so():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"const": {"properties": {}}}}},
                       "c": {"type": "object", "properties": {}, "additionalProperties": True},
                       "d": {"type": "array", "items": {"type": "object", "properties": {"e": {}}}}},
        "$defs": {"f": {"properties": {"g": {}}}},
        "allOf": [{"properties": {"h": {}}}, {"properties": {"i": {"properties": {}}}}],
    }
    text = schema_grammar(schema)
    closed = json.loads(text.split("%json ", 1)[1])
    assert closed["x-guidance"] == JSON_OPTIONS
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["a"]["properties"]["b"] == {"const": {"properties": {}}}  # data, not a schema
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["properties"]["d"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["f"]["additionalProperties"] is False
    # allOf branches stay open (each declares only part of the properties), their insides do not
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["allOf"][1]["properties"]["i"]["additionalProperties"] is False


# ---------------------------------------------------------------- what llguidance is told of a vocabulary


def test_token_bytes_as_llama_cpp_emits_them(tokenizer):
    pieces, special = token_bytes(tokenizer)
    ids = tokenizer.vocab.token_to_id
    if tokenizer.vocab.model == "llama":  # SentencePiece: U+2581 is a space, byte tokens are their byte
        assert pieces[ids["<0x7B>"]] == b"{" == pieces[ids["{"]]
        assert pieces[ids["\u2581the"]] == b" the"
        assert pieces[ids["<0xFF>"]] == SPECIAL_MARK + b"<0xFF>"  # 0xFF never starts UTF-8 text
        for token_id, name in [(0, b"<unk>"), (1, b"<s>"), (2, b"</s>")]:
            assert pieces[token_id] == SPECIAL_MARK + name and token_id in special
    else:  # byte-level BPE: GPT-2's printable characters mapped back to bytes
        assert pieces[ids["\u0120the"]] == b" the"
        assert pieces[ids["\u010a"]] == b"\n"
        assert pieces[ids["<|endoftext|>"]] == SPECIAL_MARK + b"<|endoftext|>"
    assert special == [i for i, p in enumerate(pieces) if p.startswith(SPECIAL_MARK)]
    assert all(pieces)


def small_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary with two end-of-generation tokens (EOS and an end-of-turn)."""
    tokens = ["<unk>", "<s>", "</s>", "<|eot_id|>", "a", "b", "ab", "{", "}", "\u0120", "[UNUSED]"]
    types = [2, 3, 3, 3, 1, 1, 1, 1, 1, 1, 5]
    return from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["a b"],
                          "tokenizer.ggml.eos_token_id": 2})


def test_end_of_generation_only_where_the_grammar_may_end():
    tokenizer = small_tokenizer()
    ids = tokenizer.vocab.token_to_id
    assert tokenizer.eos_ids == {ids["</s>"], ids["<|eot_id|>"]}
    matcher = GrammarVocab.of(tokenizer).matcher('root ::= "a" "b"*')
    allowed = {tokenizer.vocab.tokens[i] for i in np.flatnonzero(matcher.allowed())}
    assert allowed == {"a", "ab"}  # no end, no control or unused token, no "b"
    assert not matcher.allows(ids["</s>"]) and not matcher.allows(ids["<|eot_id|>"])
    matcher.accept(ids["ab"])
    assert matcher.allows(ids["</s>"]) and matcher.allows(ids["<|eot_id|>"]) and matcher.allows(ids["b"])
    assert not matcher.allows(ids["<s>"]) and not matcher.allows(ids["a"]) and not matcher.finished
    assert not matcher.allows(len(tokenizer.vocab.tokens))  # past the vocabulary (a padded output layer)
    # nothing can follow: the output is complete, and only an end of generation is allowed
    matcher = GrammarVocab.of(tokenizer).matcher('root ::= "{" "}"')
    matcher.accept(ids["{"])
    matcher.accept(ids["}"])
    assert matcher.finished
    assert set(np.flatnonzero(matcher.allowed())) == tokenizer.eos_ids


def test_vocabulary_is_built_once_per_tokenizer():
    tokenizer = small_tokenizer()
    assert GrammarVocab.of(tokenizer) is GrammarVocab.of(tokenizer)
    assert GrammarVocab.of(small_tokenizer()) is not GrammarVocab.of(tokenizer)


def test_a_rejected_sample_is_drawn_again_from_the_allowed_tokens():
    tokenizer = small_tokenizer()
    ids = tokenizer.vocab.token_to_id
    logits = np.zeros(len(tokenizer.vocab.tokens) + 5, dtype=np.float32)  # an output layer wider than the vocab
    logits[-1] = 100  # the best token does not exist in the vocabulary
    logits[ids["b"]] = 50  # the best real one is not allowed first
    logits[ids["ab"]] = 10
    matcher = GrammarVocab.of(tokenizer).matcher('root ::= "a" "b"*')
    assert matcher.sample(Sampler(temperature=0), logits) == ids["ab"]


# JSON Schema's `pattern` is a search, not a full match: an unanchored pattern may sit anywhere in the string.
PATTERN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "tag": {"type": "string", "pattern": "^#[a-z_]{1,6}$"},
        "note": {"type": "string", "pattern": "ok", "maxLength": 6},
        "word": {"type": "string", "pattern": "^\\p{L}{2,5}$"},
    },
    "required": ["code", "tag", "note", "word"],
}


def test_random_generations_match_the_schemas_patterns(tokenizer):
    """`pattern` is enforced, anchored or not (the structured-output complaint most often made of Ollama)."""
    vocab = GrammarVocab.of(tokenizer)
    grammar = format_grammar(PATTERN_SCHEMA)
    for seed in range(40):
        data, end = generate(tokenizer, vocab.matcher(grammar), seed)
        assert end == "complete", (seed, end, data)
        value = json.loads(data)
        assert set(value) == set(PATTERN_SCHEMA["required"])
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", value["code"]), value
        assert re.fullmatch(r"#[a-z_]{1,6}", value["tag"]), value
        assert "ok" in value["note"] and len(value["note"]) <= 6, value
        assert 2 <= len(value["word"]) <= 5 and value["word"].isalpha(), value


def test_a_pattern_llguidance_cannot_compile_is_refused_by_name():
    for pattern, why in [("(?=a)a", "look-around"), ("(a", "unclosed group")]:
        with pytest.raises(GrammarError) as err:
            format_grammar({"type": "string", "pattern": pattern})
        assert str(err.value).startswith("invalid JSON schema in format: ") and why in str(err.value)


def test_keywords_not_enforced_are_named_in_a_warning(caplog):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"},
                                                       "uniqueItems": True},
                                               "when": {"type": "string", "format": "not-a-format"}}}
    with caplog.at_level("WARNING", logger="ollama_engine.sample.grammar_text"):
        assert format_grammar(schema)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "uniqueItems" in warned and "not-a-format" in warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="ollama_engine.sample.grammar_text"):
        format_grammar(PATTERN_SCHEMA)  # every keyword enforced: nothing to say
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


# ---------------------------------------------------------------- 200 random generations per family


def test_random_generations_follow_a_nested_schema(tokenizer):
    """RUNS generations at temperature 1 on random logits: every one complete, parsed and valid."""
    vocab = GrammarVocab.of(tokenizer)
    grammar = format_grammar(SCHEMA)
    for seed in range(RUNS):
        data, end = generate(tokenizer, vocab.matcher(grammar), seed)
        assert end == "complete", (seed, end, data)
        text = data.decode()
        check_schema(json.loads(text), SCHEMA)
        assert whitespace_outside_strings(text) <= 20, (seed, text)


def test_ollama_json_is_any_object_with_bounded_whitespace(tokenizer):
    assert to_llguidance(GRAMMAR_JSON) == to_llguidance("\n".join(GRAMMAR_JSON.split()) + "  \n")
    vocab = GrammarVocab.of(tokenizer)
    for seed in range(10):
        data, end = generate(tokenizer, vocab.matcher(format_grammar("json")), seed, max_tokens=200)
        if end == "complete":
            assert isinstance(json.loads(data), dict)
        else:  # a random walk rarely closes an unbounded string; what it wrote is still a valid start
            assert end == "cap" and data.startswith(b"{")
            assert whitespace_outside_strings(data.decode("utf-8", "replace")) <= 20


# ---------------------------------------------------------------- llama.cpp's GBNF grammars

_CHESS_MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
_EN_CHAR = r"[a-zA-Z0-9!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"
_JP_CHAR = "[\u3041-\u309f\u30a1-\u30ff\u3001-\u303e\u4e00-\u9fff]"
PATTERNS = {
    "chess": rf"1\. {_CHESS_MOVE} {_CHESS_MOVE}\n(?:[1-9][0-9]?\. {_CHESS_MOVE} {_CHESS_MOVE}\n)+",
    "english": rf"{_EN_CHAR}+(?:[ \t\n]{_EN_CHAR}+)*",
    "japanese": rf"{_JP_CHAR}+(?:[ \t\n]{_JP_CHAR}+)*",
    "list": "(?:- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+",
}


def valid_for(name: str, text: str) -> bool:
    if name == "json":
        return isinstance(json.loads(text), dict)
    if name == "json_arr":
        return text.startswith("[\n") and isinstance(json.loads(text), list)
    return re.fullmatch(PATTERNS[name], text) is not None


@pytest.mark.parametrize("name", ["chess", "english", "japanese", "json", "json_arr", "list"])
def test_llama_cpp_grammars_constrain_random_generations(tokenizer, name):
    """Walks with the end-of-generation tokens favoured, so that most end: each ended one is in the language."""
    grammar = (GRAMMARS / f"{name}.gbnf").read_text()
    vocab = GrammarVocab.of(tokenizer)
    ended = 0
    for seed in range(12):
        data, end = generate(tokenizer, vocab.matcher(grammar), seed, max_tokens=120, boost=4.0)
        if end != "cap":
            ended += 1
            assert valid_for(name, data.decode()), (seed, end, data)
    assert ended >= 3


def test_gbnf_escapes_read_as_llama_cpp_reads_them(tokenizer):
    r"""\u and \U escapes (llguidance's converter mangles \u00e9), and \x escapes, in strings and classes."""
    vocab = GrammarVocab.of(tokenizer)
    grammar = r'root ::= "\u00e9\x41" [\u0100-\u017f] "\U0001F999" [^\x00-\x7f\u2028]{2} "\u0022"'
    for seed in range(5):
        data, end = generate(tokenizer, vocab.matcher(grammar), seed)
        assert end == "complete"
        text = data.decode()
        assert re.fullmatch("\u00e9A[\u0100-\u017f]\U0001f999[^\x00-\x7f\u2028]{2}\"", text), text


def test_right_recursive_whitespace_does_not_exhaust_the_parser(tokenizer):
    """Ollama's `ws ::= ([ \\t\\n] ws)?` outside its JSON grammar: 400 spaces in a row are still fine."""
    vocab = GrammarVocab.of(tokenizer)
    matcher = vocab.matcher('root ::= "[" ws "1" ws "]"\nws ::= ([ \\t\\n] ws)?')
    space = tokenizer.encode_continuation(" ")
    matcher.accept(tokenizer.encode_continuation("[")[0])
    for _ in range(400):
        matcher.accept(space[-1])
    for token in tokenizer.encode_continuation("1]"):
        matcher.accept(token)
    assert matcher.finished


def test_a_grammar_in_an_error_state_says_why(tokenizer):
    """Deep right recursion exhausts llguidance's parser: the matcher reports it, and never lets the output
    end as if it were complete (the runner ends such a sequence with the error)."""
    matcher = GrammarVocab.of(tokenizer).matcher('root ::= sp "]"\nsp ::= (" " sp)?')
    pieces = token_bytes(tokenizer)[0]
    space = max((i for i, p in enumerate(pieces) if p.strip(b" ") == b""), key=lambda i: len(pieces[i]))
    with pytest.raises(GrammarError) as err:
        for _ in range(4000 // len(pieces[space])):  # about 2000 spaces exhaust it
            matcher.accept(space)
    assert str(err.value).startswith("grammar: Parser Error: ") and "\n" not in str(err.value)


@pytest.mark.parametrize(("grammar", "why"), [
    ("root ::= foo", "foo"),
    ('root ::= "a', "invalid grammar"),
    ('root ::= "\\uD800"', "not a Unicode character"),
])
def test_invalid_grammar_says_why(grammar, why):
    with pytest.raises(GrammarError) as err:
        GrammarVocab.of(small_tokenizer()).matcher(grammar)
    assert str(err.value).startswith("invalid grammar: ") and why in str(err.value)


def test_rules_of_terminals_match_greedily_unlike_llama_cpp(tokenizer):
    """A known difference: llguidance's converter makes a rule of terminals only one lexeme, matched as far
    as it goes. In arithmetic.gbnf a term's trailing `ws` ([ \\t\\n]*) takes the newline that should end
    the line, so after `a=b` and a newline neither the end nor a next line is allowed (llama.cpp's
    character-level engine allows both): output stays valid but only ends by length. Grammars where a
    lexeme's tail cannot begin the next lexeme (JSON, llama.cpp's schema grammars) are not affected."""
    matcher = GrammarVocab.of(tokenizer).matcher((GRAMMARS / "arithmetic.gbnf").read_text())
    for token in tokenizer.encode_continuation("a=b\n"):
        assert matcher.allows(token)
        matcher.accept(token)
    assert not any(matcher.allows(token) for token in tokenizer.eos_ids)
    assert not matcher.allows(tokenizer.encode_continuation("x")[0])
    assert matcher.allows(tokenizer.encode_continuation("\n")[0])


# ---------------------------------------------------------------- against llama.cpp's own GBNF engine


def _invalid_utf8_start(piece: bytes) -> bool:
    return piece[0] in (0xC0, 0xC1) or piece[0] >= 0xF5


@pytest.mark.reference
@pytest.mark.parametrize("name", ["json", "chess", "list", "japanese"])
def test_allowed_tokens_match_llama_cpp(tokenizer, name):
    """Along a random walk, the tokens our matcher allows are the ones llama.cpp's grammar sampler allows on
    the same vocabulary, but for three documented departures:
    - llguidance lets only the canonical tokenization of text the grammar forces through (`1. ` is the
      token `1.`, not `1`), a subset of llama.cpp's;
    - llama.cpp allows the byte tokens 0xC0, 0xC1 and 0xF5-0xFE, which start no UTF-8 character;
    - llama.cpp refuses a token starting with a NUL byte and, in a negated class that excludes some
      multi-byte characters (list.gbnf's U+0085, U+2028), the lead bytes they share with allowed ones.
    Control tokens are left out: llama.cpp matches their text, this engine never (llama.cpp's llguidance
    integration does the same)."""
    import ctypes
    import math

    llama_cpp = pytest.importorskip("llama_cpp")
    grammar = (GRAMMARS / f"{name}.gbnf").read_text()
    path = assets.vocab(FAMILIES["spm" if tokenizer.vocab.model == "llama" else "bpe"])
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    reference = llama_cpp.llama_sampler_init_grammar(llama_cpp.llama_model_get_vocab(llm.model), grammar.encode(),
                                                     b"root")
    pieces, special = token_bytes(tokenizer)
    n = tokenizer.vocab_size
    candidates = (llama_cpp.llama_token_data * n)()

    def theirs() -> set[int]:
        for i in range(n):
            candidates[i].id, candidates[i].logit, candidates[i].p = i, 0.0, 0.0
        array = llama_cpp.llama_token_data_array(candidates, n, -1, False)
        llama_cpp.llama_sampler_apply(reference, ctypes.byref(array))
        return {candidates[i].id for i in range(array.size) if candidates[i].logit != -math.inf}

    matcher = GrammarVocab.of(tokenizer).matcher(grammar)
    rng = np.random.default_rng(0)
    sampler = Sampler(temperature=1.0, seed=0)
    try:
        for _ in range(12):
            ours = set(np.flatnonzero(matcher.allowed()).tolist()) - set(special)
            expected = theirs() - set(special)
            forced = matcher._matcher.compute_ff_bytes()
            for token in expected - ours:
                piece = pieces[token]
                assert (forced and forced.startswith(piece)) or _invalid_utf8_start(piece), piece
            for token in ours - expected:
                piece = pieces[token]
                assert piece[0] == 0 or (name == "list" and incomplete_utf8(piece)), piece
            token = matcher.sample(sampler, rng.random(n, dtype=np.float32) * 8)
            if token in tokenizer.eos_ids:
                break
            matcher.accept(token)
            llama_cpp.llama_sampler_accept(reference, token)
            if matcher.finished:
                break
    finally:
        llama_cpp.llama_sampler_free(reference)
        llm.close()
