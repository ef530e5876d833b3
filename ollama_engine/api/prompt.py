"""Prompts for /api/chat and /api/generate, and the runner options a request runs with.

Ollama's order (reference §4.1): the Modelfile's MESSAGEs go before the request's messages, its SYSTEM
first unless the request starts with a system message; a TEMPLATE (Go syntax) renders them, else the
GGUF's Jinja chat template, else the prompt passes through raw. Options: Ollama's defaults < the
Modelfile's PARAMETERs < the request's `options`; stops add every end-of-generation token's text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ollama_engine.image import ImageError, decode_image
from ollama_engine.sample.grammar import check_grammar
from ollama_engine.sample.grammar_text import GRAMMAR_JSON, GrammarError
from ollama_engine.sched import Options
from ollama_engine.template import (
    DEFAULT_TEMPLATE,
    ChatTemplateError,
    GoTemplate,
    TemplateError,
    limits,
    parse_go_template,
    stop_words,
)
from ollama_engine.template.limits import TemplateLimitError

from .catalog import Entry
from .native import ApiError, split_options

THINK_LEVELS = ("low", "medium", "high", "max")
_RAW = parse_go_template(DEFAULT_TEMPLATE)
# Renders run here, off the event loop: a slow template must not stop serve answering everyone else.
_RENDERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="template")
RENDER_GRACE = 2.0  # seconds past RENDER_TIMEOUT before the caller stops waiting (the render stops itself)


async def off_loop(render: Callable[[], str]) -> str:
    """`render()` in a template worker thread, given up on (500) a little after the render's time limit.

    A Python thread cannot be killed: the bounds in template/limits.py (steps, sizes, a deadline checked
    at every step) are what make the render itself stop; this wait keeps the request from hanging if one
    C-level operation overruns the deadline.
    """
    future = asyncio.get_running_loop().run_in_executor(_RENDERS, render)
    try:
        return await asyncio.wait_for(future, limits.RENDER_TIMEOUT + RENDER_GRACE)
    except asyncio.TimeoutError as err:
        raise ApiError(500, f"template error: template exceeds its time limit of {limits.RENDER_TIMEOUT:g} "
                            "seconds") from err


def think_value(value: Any) -> tuple[bool | None, str]:
    """`think`: (enabled or None when not given, level). `true` is the level "medium", as Ollama's
    ThinkValue.String() gives templates."""
    if value is None:
        return None, ""
    if isinstance(value, bool):
        return value, "medium" if value else ""
    if isinstance(value, str) and value in THINK_LEVELS:
        return True, value
    raise ApiError(400, f"invalid think value: {value!r} (must be a boolean or one of {', '.join(THINK_LEVELS)})")


def check_think(entry: Entry, think: bool | None) -> None:
    if think and "thinking" not in entry.capabilities:
        raise ApiError(400, f'"{entry.requested}" does not support thinking')


def check_images(entry: Entry, messages: Sequence[Mapping[str, Any]]) -> None:
    """Images need a vision model (one whose file holds a tower, or with a projector)."""
    if any(m.get("images") for m in messages) and "vision" not in entry.capabilities:
        raise ApiError(400, f'"{entry.requested}" does not support images: it is a text-only model')


def tag_images(messages: Sequence[Mapping[str, Any]], tag: bool = True) -> tuple[list[dict[str, Any]], list[dict]]:
    """The messages with their images as Ollama's chatPrompt puts them: each image numbered in order, its
    `[img-N]` tag in place of the text's next "[img]", else before the text; and the images as the runner's
    ImageData ({"data": base64, "id": N}). Every image is decoded here, so a corrupt or huge one is a 400
    before any model is loaded (call it off the event loop). tag=False: numbered only (a raw prompt)."""
    out: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        raw = message.pop("images", None) or []
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise ApiError(400, "images must be an array of base64-encoded strings")
        prefix, content = "", message.get("content") or ""
        for item in raw:
            try:
                data = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError) as err:
                raise ApiError(400, f"invalid image data: not base64 ({err})") from err
            try:
                decode_image(data)
            except ImageError as err:
                raise ApiError(400, f"invalid image data: {err}") from err
            name = f"[img-{len(images)}]"
            if isinstance(content, str) and "[img]" in content:
                content = content.replace("[img]", name, 1)
            else:
                prefix += name
            images.append({"data": item, "id": len(images)})
        if raw and tag and isinstance(content, str):
            message["content"] = prefix + content
        out.append(message)
    return out, images


def chat_messages(entry: Entry, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Modelfile's SYSTEM and MESSAGEs around the request's messages, roles lower-cased."""
    out = [dict(m) for m in entry.messages] + [{**m, "role": str(m.get("role", "")).lower()} for m in messages]
    if entry.system and (not out or out[0].get("role") != "system"):
        out.insert(0, {"role": "system", "content": entry.system})
    return out


def render_chat(entry: Entry, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                think: bool | None, think_level: str = "", template: GoTemplate | None = None) -> str:
    """The prompt text for chat messages with the model's template (or `template`)."""
    go = template or entry.go_template
    try:
        if go is not None:
            return go.render(messages, tools=tools, think=bool(think), think_level=think_level,
                             is_think_set=think is not None)
        chat = entry.chat_template
        if chat is not None:
            extra: dict[str, Any] = {"reasoning_effort": think_level} if think_level else {}
            return chat.prompt(messages, tools=tools, think=think, **extra)
        return _RAW.render(messages)
    except (TemplateError, ChatTemplateError, TemplateLimitError) as err:
        raise ApiError(500, f"template error: {err}") from err


async def check_format(extra: Mapping[str, Any]) -> None:
    """A 400 for a `format` schema that compiles but can never produce output ({"$ref": "#"}): the runner would
    only find out at the first token."""
    grammar = extra.get("Grammar")
    if grammar and grammar != GRAMMAR_JSON:
        try:
            await asyncio.to_thread(check_grammar, grammar)
        except GrammarError as err:
            raise ApiError(400, f"invalid JSON schema in format: {err}") from err


def generate_prompt(entry: Entry, body: Mapping[str, Any], think: bool | None, think_level: str) -> str:
    """/api/generate's prompt, not raw: the user prompt (with system / template / suffix) rendered."""
    prompt = body.get("prompt") or ""
    template = entry.go_template
    if body.get("template"):
        try:
            template = parse_go_template(body["template"])
        except TemplateError as err:
            raise ApiError(400, f"template error: {err}") from err
    suffix = body.get("suffix") or ""
    if suffix:
        if template is None or "suffix" not in template.vars():
            raise ApiError(400, f"{entry.full_name} does not support insert")
        try:
            return template.render(prompt=prompt, suffix=suffix)
        except TemplateError as err:
            raise ApiError(500, f"template error: {err}") from err
    messages: list[dict[str, Any]] = []
    system = body.get("system") or entry.system
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return render_chat(entry, messages, None, think, think_level, template)


def request_options(entry: Entry, options: Any) -> tuple[Options, dict[str, Any]]:
    """(runner options, sampling options) with the Modelfile's PARAMETERs under the request's options."""
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "json: cannot unmarshal options into Go value of type map[string]interface {}")
    request = dict(options or {})
    merged = {**entry.params, **request}
    opts, sampling = split_options(merged)
    sampling["stop"] = stop_words(entry.view.vocabulary, entry.params, request.get("stop"))
    return opts, sampling


class ThinkingSplitter:
    """Splits streamed text into (thinking, content) at <think>...</think> (Qwen3, DeepSeek-R1 style)."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.state = "start" if enabled else "content"
        self.buffer = ""

    def feed(self, piece: str) -> tuple[str, str]:
        if self.state == "content":
            return "", piece
        self.buffer += piece
        thinking, content = "", ""
        if self.state == "start":
            lead = self.buffer.lstrip()
            if not lead:
                return "", ""
            if self.OPEN.startswith(lead[: len(self.OPEN)]) and len(lead) < len(self.OPEN):
                return "", ""  # could still become <think>
            if lead.startswith(self.OPEN):
                self.state, self.buffer = "thinking", lead[len(self.OPEN):].lstrip("\n")
            else:  # no thinking block at all
                self.state, content, self.buffer = "content", self.buffer, ""
                return "", content
        if self.state == "thinking":
            at = self.buffer.find(self.CLOSE)
            if at >= 0:
                thinking, rest = self.buffer[:at], self.buffer[at + len(self.CLOSE):]
                self.state, self.buffer = "content", ""
                return thinking, rest.lstrip("\n")
            keep = max((n for n in range(1, len(self.CLOSE)) if self.buffer.endswith(self.CLOSE[:n])), default=0)
            thinking, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return thinking, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "thinking" else ("", rest)
