"""Tool calls out of generated text, into Ollama's `message.tool_calls` shape.

Models write calls in a few common ways: Qwen / Hermes `<tool_call>{...}</tool_call>`, Mistral
`[TOOL_CALLS] [...]`, Llama 3.1 `<|python_tag|>{...}`, or a bare JSON object / array (Llama 3.2, many
small models). Each call is `{"name": ..., "arguments": {...}}` (or `parameters`, or nested under
`function`; arguments may be a JSON string, as OpenAI writes them). The result is
`[{"function": {"index": i, "name": ..., "arguments": {...}}}]`; text that is not a call stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TAG_PAIRS = (("<tool_call>", "</tool_call>"), ("<|tool_call|>", "<|/tool_call|>"),
             ("<function_call>", "</function_call>"))
PREFIX_TAGS = ("[TOOL_CALLS]", "<|python_tag|>", "<tool_calls>", "functools")
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) from a finished generation. With `tools`, only calls to those names count."""
    names = tool_names(tools)
    for open_tag, close_tag in TAG_PAIRS:
        if open_tag in text:
            return _tagged(text, open_tag, close_tag, names)
    for tag in PREFIX_TAGS:
        at = text.find(tag)
        if at >= 0:
            calls = _calls_in(text[at + len(tag):], names)
            if calls:
                return text[:at].strip(), _numbered(calls)
    stripped = _strip_fence(text.strip())
    if stripped[:1] in "{[":
        try:
            value, end = _DECODER.raw_decode(stripped)
        except ValueError:
            return text, []
        calls = _as_calls(value, names)
        if calls and not stripped[end:].strip():
            return "", _numbered(calls)
    return text, []


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> set[str] | None:
    """The function names a request offers (None: accept any name)."""
    if not tools:
        return None
    return {str((t.get("function") or t).get("name", "")) for t in tools}


def _tagged(text: str, open_tag: str, close_tag: str, names: set[str] | None) -> tuple[str, list[dict[str, Any]]]:
    content, calls, pos = [], [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        end = text.find(close_tag, start)
        body = text[start + len(open_tag): end if end >= 0 else len(text)]
        found = _calls_in(body, names)
        if found:
            calls.extend(found)
        else:
            content.append(text[start: end + len(close_tag) if end >= 0 else len(text)])
        if end < 0:
            break
        pos = end + len(close_tag)
    return "".join(content).strip() if calls else text, _numbered(calls)


def _calls_in(body: str, names: set[str] | None) -> list[dict[str, Any]]:
    """Every JSON value in `body` (one after another, optionally fenced) read as calls."""
    body, pos, calls = _strip_fence(body.strip()), 0, []
    while pos < len(body):
        start = min((i for i in (body.find("{", pos), body.find("[", pos)) if i >= 0), default=-1)
        if start < 0:
            break
        try:
            value, end = _DECODER.raw_decode(body, start)
        except ValueError:
            break
        calls.extend(_as_calls(value, names))
        pos = end
    return calls


def _as_calls(value: Any, names: set[str] | None) -> list[dict[str, Any]]:
    items: Iterable[Any] = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _as_call(item)
        if call is None or (names is not None and call["name"] not in names):
            return []
        calls.append(call)
    return calls


def _as_call(item: Any) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": arguments}


def _numbered(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"function": {"index": i, "name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls)]


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _strip_fence(text: str) -> str:
    m = _FENCE.match(text)
    return m.group(1) if m else text


class ToolCallStream:
    """Streaming helper: passes text through until something may be a tool call, then holds it back.

    `feed(piece)` returns the content that is safe to show now; `finish()` parses what was held back and
    returns (remaining content, tool_calls). Held back: everything from a known tag on, or the whole
    output when it starts with `{` / `[` (a bare JSON call).
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = tools
        self.held = ""
        self.holding = False
        self.started = False
        self.tags = [t for pair in TAG_PAIRS for t in pair[:1]] + list(PREFIX_TAGS)

    def feed(self, piece: str) -> str:
        if self.holding:
            self.held += piece
            return ""
        text = self.held + piece
        if not self.started:
            lead = text.lstrip()
            if not lead:
                self.held = text
                return ""
            self.started = True
            if lead[0] in "{[`":
                self.holding, self.held = True, text
                return ""
        for tag in self.tags:
            at = text.find(tag)
            if at >= 0:
                self.holding, self.held = True, text[at:]
                return text[:at]
        keep = max((n for tag in self.tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if not self.held:
            return "", []
        return parse_tool_calls(self.held, self.tools)
