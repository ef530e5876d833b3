"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

As in Ollama's anthropic middleware, a request is translated into a native /api/chat request and run by
chat.py; its chunks are translated back into Anthropic's message or its server-sent events. Beyond Ollama:
- `tool_choice` is enforced (tool_choice.py): `any` / `tool` constrain the output, through the same
  structured-output path as `format`, to one call `{"name": ..., "arguments": <input_schema>}`, which the
  chat path's tool-call parser reads as a call; `none` gives the template no tools.
- `thinking.budget_tokens` is enforced: the thinking part runs with num_predict = budget; if it has not
  closed by then, `</think>` is appended and the answer continues from there (thinking_budget.py).
- `stop_sequences` are matched by the API, not the runner, so that `stop_reason` can say `stop_sequence`
  and which one (the runner only reports stop / length; stop_sequences.py).
- A final assistant message is a prefill, as in Anthropic's API: the answer continues its text (the
  template opens the assistant turn, the text follows), whatever the template.
- `count_tokens` renders and tokenizes the prompt exactly as /v1/messages runs it (Ollama estimates len/4).
Errors have Anthropic's shape `{"type": "error", "error": {"type", "message"}}` and its status codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .chat import ChatRoutes, Prepared, collect_chat
from .completion import Chunks, Job, collected, first_chunk, runner_chunks
from .native import ApiError, json_response, read_json
from .stop_sequences import Outcome, stopped_lines
from .thinking_budget import budgeted_lines
from .tool_choice import ToolChoiceError, anthropic_choice, plan_tools

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
ROLES = ("user", "assistant")
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(err: ApiError) -> web.Response:
    return json_response(error_body(err.status, str(err)), status=err.status, headers=err.headers)


def sse(event: Mapping[str, Any]) -> bytes:
    """One server-sent event named by its `type`, as Anthropic sends them."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


# ---------------------------------------------------------------- request translation


@dataclass
class Plan:
    """What the native chat request does not carry: how this route runs and reports it."""

    max_tokens: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    budget: int | None = None  # thinking.budget_tokens, enforced
    effort: str = ""  # output_config.effort as a think level: used where the model can think
    prefill: str = ""  # a final assistant message's text: the answer continues it


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (system, tool_result content)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    if not isinstance(blocks, list):
        raise _bad(f"{where}: Input should be a valid string or a list of content blocks")
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}.{i}: only text blocks are supported here, not {kind!r}")
        texts.append(block["text"])
    return "\n".join(texts) if where == "system" else "".join(texts)


def native_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic messages as native ones: tool_use blocks become tool_calls of the assistant message,
    tool_result blocks `tool` messages (before the user's own text, as Ollama orders them)."""
    if not isinstance(messages, list):
        raise _bad("messages: Input should be a valid list")
    if not messages:
        raise _bad("messages: at least one message is required")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the template's tool_name
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad(f"{where}: Input should be a valid dictionary")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content: Input should be a valid string or a list of content blocks")
        text, thinking, images, calls, results = [], "", [], [], []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "image":
                source = block.get("source") or {}
                if not isinstance(source, dict) or source.get("type") != "base64":
                    raise _bad(f"{at}.source: only base64 image sources are supported")
                images.append(str(source.get("data", "")))
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise _bad(f"{at}: tool_use blocks need a string id and name")
                arguments = block.get("input", {})
                if not isinstance(arguments, dict):
                    raise _bad(f"{at}.input: Input should be a valid dictionary")
                names[block["id"]] = block["name"]
                calls.append({"id": block["id"], "function": {"index": len(calls), "name": block["name"],
                                                              "arguments": arguments}})
            elif kind == "tool_result":
                if not isinstance(block.get("tool_use_id"), str):
                    raise _bad(f"{at}.tool_use_id: Field required")
                results.append({"role": "tool", "content": _text_of(block.get("content"), f"{at}.content"),
                                "tool_call_id": block["tool_use_id"],
                                "tool_name": names.get(block["tool_use_id"], "")})
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                thinking += block["thinking"]
            elif kind == "redacted_thinking":
                continue  # encrypted by Anthropic: nothing a local model can read
            else:
                raise _bad(f"{at}: unsupported content block type {kind!r}" if isinstance(kind, str)
                           else f"{at}: Input should be a valid content block")
        if role == "user":
            out.extend(results)
        if text or images or calls or thinking or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(text)}
            if images:
                msg["images"] = images
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["thinking"] = thinking
            out.append(msg)
        if role != "user":
            out.extend(results)
    return out


def native_tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools as native function tools; Anthropic's server tools (web search, bash...) are a 400."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools: Input should be a valid list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}: Input should be a valid dictionary")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tools.{i}: tool type {tool.get('type')!r} is not supported (only custom tools)")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools.{i}.name: Field required")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema: Field required")
        out.append({"type": "function", "function": {"name": name, "description": str(tool.get("description") or ""),
                                                     "parameters": schema}})
    return out


def thinking_value(value: Any, max_tokens: int | None) -> tuple[bool | None, int | None]:
    """(think, budget) for `thinking`; the budget must leave room for an answer, as Anthropic requires."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    if kind == "disabled":
        return False, None
    if kind in ("adaptive", "between_tools"):
        return True, None  # the model decides how long it thinks
    budget = value.get("budget_tokens")
    if not _is_int(budget) or budget < 1:
        raise _bad("thinking.enabled.budget_tokens: Input should be an integer greater than or equal to 1")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad("`max_tokens` must be greater than `thinking.budget_tokens`")
    return True, budget


def json_format(value: Any) -> dict[str, Any]:
    """output_config.format ({"type": "json_schema", "schema": ...}) as the native `format`."""
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise _bad("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}")
    return value["schema"]


def chat_request(body: Mapping[str, Any], *, counting: bool = False) -> tuple[dict[str, Any], Plan]:
    """A Messages (or count_tokens, `counting`) request as a native /api/chat request and its Plan."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _bad("model: Field required")
    plan = Plan()
    options: dict[str, Any] = {}
    if not counting:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise _bad("max_tokens: Field required")
        if not _is_int(max_tokens) or max_tokens < 1:
            raise _bad("max_tokens: Input should be an integer greater than or equal to 1")
        plan.max_tokens = options["num_predict"] = max_tokens
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                if not _is_number(body[key]) or body[key] < 0:
                    raise _bad(f"{key}: Input should be a number greater than or equal to 0")
                options[key] = body[key]
        if body.get("top_k") is not None:
            if not _is_int(body["top_k"]) or body["top_k"] < 0:
                raise _bad("top_k: Input should be an integer greater than or equal to 0")
            options["top_k"] = body["top_k"]
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences: Input should be a list of non-empty strings")
        plan.stop_sequences = list(stops)
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise _bad("metadata: Input should be a valid dictionary")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise _bad("stream: Input should be a valid boolean")
    messages = native_messages(body.get("messages"))
    last = messages[-1]
    if len(messages) > 1 and last["role"] == "assistant" and set(last) == {"role", "content"}:
        plan.prefill = messages.pop()["content"]  # Anthropic's prefill: words put in the model's mouth
    system = _text_of(body.get("system"), "system")
    if system:
        messages.insert(0, {"role": "system", "content": system})
    try:
        tools = plan_tools(native_tools(body.get("tools")), *anthropic_choice(body.get("tool_choice")))
    except ToolChoiceError as err:
        raise _bad(str(err)) from err
    think, plan.budget = thinking_value(body.get("thinking"), plan.max_tokens or None)
    if think and tools.forced:
        raise _bad("Thinking may not be enabled when tool_choice forces tool use.")
    native: dict[str, Any] = {"model": body["model"], "messages": messages, "options": options}
    output = body.get("output_config") or {}
    if not isinstance(output, dict):
        raise _bad("output_config: Input should be a valid dictionary")
    if output.get("effort") is not None:
        if output["effort"] not in EFFORTS:
            raise _bad(f"output_config.effort: Input should be one of {', '.join(map(repr, EFFORTS))}")
        plan.effort = EFFORTS[output["effort"]]
    if output.get("format") is not None:
        native["format"] = json_format(output["format"])
    if tools.tools:
        native["tools"] = tools.tools
    if tools.format is not None:
        native["format"] = tools.format  # a forced call is the whole answer
    if think is not None:
        native["think"] = think
    return native, plan


# ---------------------------------------------------------------- running


def prompt_tokens(job: Job) -> int:
    """The prompt's token count, as the runner tokenizes it (its prompt_eval_count)."""
    return len(job.entry.view.tokenizer.encode(job.prompt, add_special=True))



# ---------------------------------------------------------------- response translation


def stop_reason(final: Mapping[str, Any], tool_calls: bool, outcome: Outcome) -> str:
    if tool_calls:
        return "tool_use"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if final.get("done_reason") == "length" else "end_turn"


def tool_use_block(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "tool_use", "id": tool_use_id(), "name": function["name"], "input": function["arguments"]}


def message_response(ident: str, model: str, final: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
    """A collected chat answer (collect_chat) as Anthropic's message."""
    message = final["message"]
    content: list[dict[str, Any]] = []
    if message.get("thinking"):
        content.append({"type": "thinking", "thinking": message["thinking"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    content.extend(tool_use_block(call) for call in calls)
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(final, bool(calls), outcome), "stop_sequence": outcome.stop_sequence,
            "usage": {"input_tokens": final.get("prompt_eval_count", 0),
                      "output_tokens": final.get("eval_count", 0)}}


async def message_events(chunks: Chunks, ident: str, model: str, input_tokens: int,
                         outcome: Outcome) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks as Anthropic's stream: message_start, then per block content_block_start / delta / stop
    (a ping after the first start), then message_delta with stop_reason and usage, and message_stop."""
    yield {"type": "message_start", "message": {
        "id": ident, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}}
    index, open_kind, pinged, calls = -1, "", False, 0

    def start(block: dict[str, Any]) -> list[dict[str, Any]]:
        nonlocal index, open_kind, pinged
        events = [{"type": "content_block_stop", "index": index}] if open_kind else []
        index, open_kind = index + 1, block["type"]
        events.append({"type": "content_block_start", "index": index, "content_block": block})
        if not pinged:
            pinged = True
            events.append({"type": "ping"})
        return events

    async with aclosing(chunks):
        async for chunk in chunks:
            message = chunk.get("message") or {}
            if chunk.get("done"):
                if open_kind:
                    yield {"type": "content_block_stop", "index": index}
                yield {"type": "message_delta",
                       "delta": {"stop_reason": stop_reason(chunk, calls > 0, outcome),
                                 "stop_sequence": outcome.stop_sequence},
                       "usage": {"input_tokens": chunk.get("prompt_eval_count", 0),
                                 "output_tokens": chunk.get("eval_count", 0)}}
                yield {"type": "message_stop"}
                return
            if message.get("thinking"):
                if open_kind != "thinking":
                    for event in start({"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "thinking_delta", "thinking": message["thinking"]}}
            if message.get("content"):
                if open_kind != "text":
                    for event in start({"type": "text", "text": ""}):
                        yield event
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": message["content"]}}
            for call in message.get("tool_calls") or []:
                block = tool_use_block(call)
                arguments = block.pop("input")
                for event in start({**block, "input": {}}):
                    yield event
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta",
                                 "partial_json": json.dumps(arguments, ensure_ascii=False)}}
                calls += 1


# ---------------------------------------------------------------- routes


class AnthropicRoutes:
    def __init__(self, chat: ChatRoutes) -> None:
        self.chat = chat

    async def _prepare(self, body: Mapping[str, Any], counting: bool = False) -> tuple[Job, Prepared, Plan]:
        native, plan = chat_request(body, counting=counting)
        entry = self.chat.entry(native["model"], missing_status=400)
        if plan.effort and "think" not in native and "thinking" in entry.capabilities:
            native["think"] = plan.effort  # effort asks for care, not for thinking: dropped where none is
        prepared = await self.chat.prepare_chat(native)
        job = prepared.job
        assert job is not None  # messages are never empty here
        job.prompt += plan.prefill  # after the template's opening of the assistant turn, whatever the model
        return job, prepared, plan

    def _lines(self, job: Job, plan: Plan, input_tokens: int, outcome: Outcome) -> Chunks:
        """The runner lines for the chat chunks: with the thinking budget and the stop sequences applied."""
        if plan.budget is not None and "thinking" in job.entry.capabilities:
            lines = budgeted_lines(self.chat.scheduler, job, plan.budget, plan.max_tokens)
        else:
            lines = runner_chunks(self.chat.scheduler, job)
        if plan.stop_sequences:
            lines = stopped_lines(lines, plan.stop_sequences, input_tokens, outcome)
        return lines

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            job, prepared, plan = await self._prepare(body)
            # message_start and a cut at a stop sequence report the prompt's tokens before the runner does
            needed = body.get("stream") or plan.stop_sequences
            input_tokens = await asyncio.to_thread(prompt_tokens, job) if needed else 0
        except ApiError as err:
            return anthropic_error(err)
        if plan.stop_sequences:  # one logprob entry per token: stopped_lines counts tokens with them
            job.extra.setdefault("Logprobs", True)
            job.extra.setdefault("TopLogprobs", 0)
        outcome = Outcome()
        lines = self._lines(job, plan, input_tokens, outcome)
        chunks = self.chat.chat_chunks(job, prepared.tools, prepared.think, source=lines)
        ident, model = message_id(), str(body["model"])
        if not body.get("stream"):
            try:
                final = await collected(chunks, collect_chat)
            except ApiError as err:
                return anthropic_error(err)
            return json_response(message_response(ident, model, final, outcome))
        return await self._stream(request, message_events(chunks, ident, model, input_tokens, outcome))

    async def _stream(self, request: web.Request, events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
        """Server-sent events. message_start waits for the model's first chunk, so that an error in
        loading or starting it still gets its own status; after that one `error` event ends the stream."""
        async with aclosing(events):
            try:
                start = await first_chunk(events)
                second = await first_chunk(events)
            except ApiError as err:
                return anthropic_error(err)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await response.write(sse(start) + sse(second))
                async for event in events:
                    await response.write(sse(event))
            except ApiError as err:
                await response.write(sse(error_body(err.status, str(err))))
            except ConnectionResetError:
                log.debug("client went away during a stream")
            return response

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            job, _, _ = await self._prepare(body, counting=True)
            return json_response({"input_tokens": await asyncio.to_thread(prompt_tokens, job)})
        except ApiError as err:
            return anthropic_error(err)


def anthropic_routes(app: web.Application, chat: ChatRoutes) -> None:
    routes = AnthropicRoutes(chat)
    app.router.add_post("/v1/messages", routes.messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)
