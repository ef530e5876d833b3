"""Grammar texts: what the API's `format` becomes, and how the runner's `Grammar` field reaches llguidance.

The runner's Grammar field holds GBNF in llama.cpp's dialect (Ollama's parent sends it), or, as llama.cpp
built with llguidance accepts, a Lark grammar that starts with `%llguidance`. The API turns `format` into
one of them as Ollama's parent does: "json" into Ollama's own GBNF (`GRAMMAR_JSON`), a JSON schema into
`%llguidance {}` + `start: %json <schema>` with the semantics of llama.cpp's schema converter that Ollama
uses (no undeclared properties, bounded whitespace). `to_llguidance` turns either into llguidance's
grammar, rewriting what llguidance's GBNF converter gets wrong (see the reference's pitfalls).

One difference from llama.cpp's character-level GBNF engine remains: the converter makes a rule of
terminals only one lexeme, matched as far as it goes, so a lexeme whose tail can also begin what follows
(llama.cpp's arithmetic.gbnf: a term's trailing [ \t\n]* before the line's "\n") never gives it back.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

# Ollama's grammarJSON (llm/server.go at f63eea3d), its trailing spaces left out: texts are compared with
# their runs of whitespace collapsed.
GRAMMAR_JSON = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
         string ":" ws value
    ("," ws string ":" ws value)*
  )? ws "}"
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? ws "]"
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]) # escapes
  )* "\""
number ::= ("-"? ([0-9] | [1-9] [0-9]*)) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= ([ \t\n] ws)?
"""

# At most 20 whitespace characters wherever JSON allows some, as llama.cpp's schema grammars bound it; a
# model (or random logits) could otherwise emit newlines forever. `lenient`: unknown keywords are ignored,
# as llama.cpp's converter ignores them, instead of failing.
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}", "lenient": True}
LLGUIDANCE_PREFIX = "%llguidance"

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(ValueError):
    """A grammar or schema that cannot be used; the message says why."""


def format_grammar(value: Any) -> str:
    """The runner Grammar for an API request's `format` ("" for none), checked as Ollama's parent checks it.

    Every keyword llguidance supports is enforced (`pattern`, `format`, bounds, enums, ...); one it does not
    (`uniqueItems`, `contains`, `if`/`then`, an unknown `format`) is logged as a warning naming it, since
    neither Ollama's nor OpenAI's response has a place for warnings."""
    if value is None or value == "":
        return ""
    if value == "json":
        return GRAMMAR_JSON
    if not isinstance(value, Mapping):
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        raise GrammarError(f'invalid format: {json.dumps(raw, ensure_ascii=False)}; '
                           'expected "json" or a valid JSON Schema object')
    import llguidance  # at the first grammar (see sample/grammar.py)

    grammar = schema_grammar(value)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(to_llguidance(grammar))
    if failed:
        raise GrammarError(f"invalid JSON schema in format: {reason(messages[0] if messages else 'unknown')}")
    for message in messages:
        log.warning("format: a JSON schema keyword is not enforced: %s", message)
    return grammar


def reason(message: str) -> str:
    """llguidance's error without the listing of the Lark grammar it was compiling (ours, not the user's)."""
    message = re.sub(r"^at \d+\(\d+\): ", "", message)
    listing = re.search(r"^\s*\d+ \| ", message, re.MULTILINE)
    return (message[: listing.start()] if listing else message).strip()


def schema_grammar(schema: Mapping[str, Any]) -> str:
    """A JSON schema as a `%llguidance` grammar with Ollama's semantics (llama.cpp's converter)."""
    closed = _closed(schema)
    options = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return f"{LLGUIDANCE_PREFIX} {{}}\nstart: %json " + json.dumps({**closed, "x-guidance": options})


def _closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` in every object that lists properties but says nothing
    about others: llama.cpp's converter allows no undeclared property there, JSON Schema allows any.

    allOf branches are left open: a property of one branch would be undeclared in the others.
    """
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = _closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_open_top(_closed(s)) for s in out["allOf"]]
    return out


def _open_top(schema: Any) -> Any:
    if isinstance(schema, dict) and schema.get("additionalProperties") is False:
        return {k: v for k, v in schema.items() if k != "additionalProperties"}
    return schema


# ---------------------------------------------------------------- the runner's side


def _collapse(text: str) -> str:
    return " ".join(text.split())


_GRAMMAR_JSON_KEY = _collapse(GRAMMAR_JSON)
# `name ::= ([chars] name)?`: one character at a time through an Earley rule, which llguidance's item limit
# breaks after a few hundred characters (Ollama's `ws`); the same language as a repeated class is a lexeme.
_RIGHT_RECURSIVE_CLASS = re.compile(
    r"^(?P<name>[A-Za-z0-9_-]+)[ \t]*::=[ \t]*\([ \t]*(?P<cls>\[(?:\\.|[^\]\\])*\])[ \t]+(?P=name)[ \t]*\)\?[ \t]*$",
    re.MULTILINE)
_UNICODE_ESCAPE = re.compile(r"\\(?:\\|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def to_llguidance(text: str) -> str:
    """llguidance's grammar for a runner Grammar: Ollama's JSON grammar, `%llguidance` Lark, or GBNF."""
    import llguidance  # at the first grammar (see sample/grammar.py)
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if _collapse(text) == _GRAMMAR_JSON_KEY:
        # Ollama's "json": any JSON object, as llguidance's own JSON grammar (fast, with bounded whitespace)
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if text.lstrip().startswith(LLGUIDANCE_PREFIX):
        return llguidance.LLMatcher.grammar_from_lark(text)
    text = _fix_gbnf(text)
    try:
        lark = gbnf_to_lark(text)
    except Exception as err:  # the converter raises several kinds for malformed input
        raise GrammarError(f"invalid grammar: {err}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _fix_gbnf(text: str) -> str:
    """GBNF that llguidance's converter reads as llama.cpp does."""
    text = _RIGHT_RECURSIVE_CLASS.sub(lambda m: f"{m['name']} ::= {m['cls']}*", text)
    return _UNICODE_ESCAPE.sub(_unicode_escape, text)


def _unicode_escape(match: re.Match[str]) -> str:
    r"""`\uXXXX` / `\UXXXXXXXX` as `\xXX` or the character itself (the converter drops leading zeros, and
    `\ue9` is no escape to its Lark reader)."""
    digits = match[1] or match[2]
    if digits is None:
        return match[0]  # an escaped backslash
    code = int(digits, 16)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
        raise GrammarError(f"invalid grammar: {match[0]} is not a Unicode character")
    return chr(code)
