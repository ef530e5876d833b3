"""The GGUF's `tokenizer.chat_template`, rendered the way Hugging Face transformers renders it.

Most chat templates were written against transformers' `apply_chat_template`, so we copy its
environment: a sandbox that cannot mutate inputs, trim_blocks + lstrip_blocks, loop controls, a
no-op `{% generation %}` block, `raise_exception`, `strftime_now`, and a `tojson` that keeps key order
and does not HTML-escape (stock Jinja's sorts keys and escapes `<>&'`, which breaks tool schemas).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from ollama_engine.template.limits import Budget, TemplateLimitError
from ollama_engine.template.sandbox import BoundedSandbox, bounded_render


class ChatTemplateError(ValueError):
    """The template does not compile, or it raised (raise_exception) for these messages."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's AssistantTracker) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def environment() -> BoundedSandbox:
    """A fresh environment configured as transformers' _compile_jinja_template (in a bounded sandbox)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.set_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from error


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template with the tokens it may print (bos_token / eos_token) and the BOS rule."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # whether the tokenizer adds BOS itself when it encodes the prompt

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], name: str | None = None) -> ChatTemplate | None:
        """From GGUF metadata: `tokenizer.chat_template` (or `.NAME`); None when the GGUF has none."""
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        source = metadata.get(key)
        if not source:
            return None
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(id_key: str) -> str:
            token_id = metadata.get(id_key)
            return str(tokens[int(token_id)]) if token_id is not None and 0 <= int(token_id) < len(tokens) else ""

        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default: SentencePiece vocabularies add BOS
            add_bos = metadata.get("tokenizer.ggml.model") == "llama"
        return cls(str(source), token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"),
                   bool(add_bos))

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, think: bool | None = None, **kwargs: Any) -> str:
        """The prompt text for these messages (Ollama API shape), as transformers would render it."""
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        if think is not None:
            variables.setdefault("enable_thinking", think)
        hf_messages, tool_list = [hf_message(m) for m in messages], list(tools) if tools else None
        budget = Budget.for_input(hf_messages, tool_list)
        try:
            return bounded_render(_compile(self.source), budget, messages=hf_messages, tools=tool_list,
                                  add_generation_prompt=add_generation_prompt, **variables)
        except TemplateLimitError as error:
            raise ChatTemplateError(f"chat template stopped: {error}") from error
        except MemoryError as error:
            raise ChatTemplateError("chat template stopped: out of memory") from error
        except jinja2.TemplateError as error:
            raise ChatTemplateError(str(error)) from error
        except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as error:
            # `{% include %}` (no loader: no file access), range() beyond the sandbox's limit, a bad operand
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {error}") from error

    def prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """`render`, then without the leading BOS text when the tokenizer adds BOS itself (no double BOS)."""
        return strip_bos(self.render(messages, **kwargs), self.bos_token, self.add_bos)


def strip_bos(text: str, bos_token: str, tokenizer_adds_bos: bool) -> str:
    """Drop one leading BOS text that the template printed if the tokenizer will add BOS anyway."""
    if tokenizer_adds_bos and bos_token and text.startswith(bos_token):
        return text[len(bos_token):]
    return text


def hf_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """An Ollama API message in the shape chat templates expect (OpenAI-style tool_calls, arguments a dict)."""
    out: dict[str, Any] = {"role": m.get("role", ""), "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = []
        for i, call in enumerate(m["tool_calls"]):
            function = call.get("function") or {}
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            calls.append({"id": call.get("id") or f"call_{i}", "type": "function",
                          "function": {"name": function.get("name", ""), "arguments": arguments}})
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    if m.get("thinking"):
        out["reasoning_content"] = out["thinking"] = m["thinking"]
    for key, value in m.items():  # anything else the caller sent (images, name, ...) passes through
        out.setdefault(key, value)
    return out


def template_capabilities(source: str) -> list[str]:
    """What a Jinja template supports, read from its text as Ollama (HEAD) does: tools, thinking."""
    caps = []
    if "tools" in source or "tool_call" in source:
        caps.append("tools")
    if ("<think>" in source and "</think>" in source) or "content.split('</think>')" in source:
        caps.append("thinking")
    return caps
