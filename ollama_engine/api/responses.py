"""POST /v1/responses (OpenAI Responses), GET and DELETE /v1/responses/{id}.

Like the chat completions layer (openai.py), a request is translated into a native chat request, run by
chat.py, and the native chunks are translated back into Responses' output items (`message`,
`function_call`, `reasoning`) and, with `stream`, its typed server-sent events (`response.created` ...
`response.completed`). Fields: `input` (a string or items: messages, `function_call`,
`function_call_output`), `instructions`, `tools` (function tools) with `tool_choice` enforced
(tool_choice.py), `parallel_tool_calls`, `text.format`, `reasoning.effort`, `max_output_tokens`,
`temperature`, `top_p`, `store`, `previous_response_id`.

Ollama's Responses layer is stateless. Here a stored response's conversation (its input and output as
native messages) is kept in memory so that `previous_response_id` can continue it: at most
STORE_MAX_RESPONSES responses and STORE_MAX_BYTES of their JSON, the least recently used dropped first;
nothing survives a restart. An id that is not (or no longer) there is a 400, as OpenAI answers it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from aiohttp import web

from .chat import ChatRoutes, collect_chat
from .completion import Chunks, collected
from .native import ApiError, json_response, read_json
from .openai import (
    IMAGE_PREFIXES,
    apply_tools,
    chat_run,
    error_body,
    format_value,
    message_role,
    openai_error,
    reasoning_think,
    sampling_options,
)

log = logging.getLogger(__name__)

STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 << 20  # of the stored conversations' JSON
ROLES = ("user", "assistant", "system", "developer")


class ResponseStore:
    """Stored responses: id → (the response object, its conversation as native messages); LRU by count and
    by bytes."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps([response, messages], separators=(",", ":")))
        if size > self.max_bytes:
            log.info("response %s not stored: %d bytes is more than the store's %d", response["id"], size,
                     self.max_bytes)
            return
        self.pop(response["id"])
        self._items[response["id"]] = (response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def get(self, ident: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        item = self._items.get(ident)
        if item is None:
            return None
        self._items.move_to_end(ident)
        return item[0], item[1]

    def pop(self, ident: str) -> bool:
        item = self._items.pop(ident, None)
        if item is not None:
            self.bytes -= item[2]
        return item is not None


# ---------------------------------------------------------------- request translation


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text_and_images(content: Any, where: str) -> tuple[str, list[str]]:
    """A message's content (a string or parts) as its text and base64 images."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise ApiError(400, f"invalid {where}: content must be a string or an array of parts")
    text, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text.append(str(part.get("text", part.get("refusal", ""))))
        elif kind == "input_image":
            url = str(part.get("image_url") or "")
            prefix = next((p for p in IMAGE_PREFIXES if url.startswith(p)), None)
            if prefix is None:
                raise ApiError(400, "image URLs are not currently supported, please use base64 encoded data instead")
            images.append(url[len(prefix):])
        else:
            raise ApiError(400, f"invalid {where}: unsupported content part type {kind!r}")
    return "".join(text), images


def tool_names_in(messages: list[dict[str, Any]]) -> dict[str, str]:
    """call id → function name, over every assistant tool call in `messages`."""
    return {call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or []
            if call.get("id")}


def input_messages(value: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as native messages (after `history`, whose tool calls `function_call_output` may answer)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "Invalid 'input': expected a string or a non-empty array of input items.")
    out: list[dict[str, Any]] = []
    names = tool_names_in(history)
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = message_role(item)
            if role not in ROLES:
                raise ApiError(400, f"Invalid value for '{where}.role': {role!r}. Supported values are: "
                                    f"{', '.join(ROLES)}.")
            text, images = _text_and_images(item.get("content"), where)
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
            if images:
                msg["images"] = images
            out.append(msg)
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(arguments, str):
                raise ApiError(400, f"invalid {where}: a function_call needs string name, call_id and arguments")
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError as err:
                raise ApiError(400, f"invalid {where}: arguments are not JSON: {err}") from err
            if out and out[-1]["role"] == "assistant":  # calls after a message (or each other) are one turn
                last = out[-1]
            else:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            calls = last.setdefault("tool_calls", [])
            calls.append({"id": call_id, "function": {"index": len(calls), "name": name, "arguments": parsed}})
            names[call_id] = name
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ApiError(400, f"invalid {where}: a function_call_output needs a string call_id")
            text = output if isinstance(output, str) else _text_and_images(output, where)[0]
            out.append({"role": "tool", "content": text, "tool_name": names.get(call_id, ""),
                        "tool_call_id": call_id})
        elif kind == "reasoning":
            continue  # the model's earlier thinking: templates drop it from past turns too
        else:
            raise ApiError(400, f"invalid {where}: unsupported input item type {kind!r}")
    return out


def responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape the templates render."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "Invalid type for 'tools': expected an array.")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ApiError(400, f"unsupported tool type: {kind!r} (only function tools are supported)")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def text_format(text: Any) -> Any:
    """`text.format` as the native `format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "Invalid type for 'text': expected an object.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "Invalid type for 'text.format': expected an object.")
    return format_value(fmt.get("type"), fmt.get("schema"), "text.format")


# ---------------------------------------------------------------- output translation


def function_call_item(call: Mapping[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
            "name": call["function"]["name"], "status": status,
            "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def responses_usage(final: Mapping[str, Any]) -> dict[str, Any]:
    prompt, completion = final.get("prompt_eval_count", 0), final.get("eval_count", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.get("cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def finish(response: dict[str, Any], final: Mapping[str, Any]) -> None:
    """Status, incomplete_details and usage from the final chunk."""
    incomplete = final.get("done_reason") == "length"
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    response["usage"] = responses_usage(final)


def assistant_turn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the native assistant message a later turn's history holds."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            msg["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "reasoning":
            msg["thinking"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            calls = msg.setdefault("tool_calls", [])
            calls.append({"id": item["call_id"], "function": {"index": len(calls), "name": item["name"],
                                                              "arguments": json.loads(item["arguments"])}})
    return msg


class ResponsesRoutes:
    def __init__(self, chat: ChatRoutes, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def _request(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """(native chat request, the response object so far, the conversation without instructions)."""
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise ApiError(400, f"Previous response with id '{previous}' not found.")
            history = stored[1]
        conversation = history + input_messages(body.get("input"), history)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ApiError(400, "Invalid type for 'instructions': expected a string.")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
        native: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": True,
                                  "options": sampling_options(body), "format": text_format(body.get("text"))}
        apply_tools(native, responses_tools(body.get("tools")), body.get("tool_choice"))
        reasoning = body.get("reasoning")
        if reasoning is not None and not isinstance(reasoning, dict):
            raise ApiError(400, "Invalid type for 'reasoning': expected an object.")
        effort = (reasoning or {}).get("effort")
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError(400, "Invalid type for 'metadata': expected an object.")
        think = reasoning_think(effort)
        if think is not None:
            native["think"] = think
        response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens"), "model": str(body.get("model")), "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": previous, "reasoning": {"effort": effort, "summary": None},
            "store": body.get("store") is not False, "temperature": native["options"]["temperature"],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": native["options"]["top_p"], "truncation": "disabled", "usage": None, "user": None,
            "metadata": metadata or {},
        }
        return native, response, conversation

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            native, response, conversation = self._request(body)
            prepared = await self.chat.prepare_chat(native)
            job = prepared.job
            if job is None:
                raise ApiError(400, "Invalid 'input': expected a string or a non-empty array of input items.")
        except ApiError as err:
            return openai_error(err)
        chunks = chat_run(self.chat, job, prepared.tools, prepared.think)
        max_calls = None if response["parallel_tool_calls"] else 1
        if body.get("stream"):
            return await self._stream(request, self._events(chunks, response, conversation, max_calls))
        try:
            final = await collected(chunks, collect_chat)
        except ApiError as err:
            return openai_error(err)
        message = final["message"]
        items: list[dict[str, Any]] = []
        if message.get("thinking"):
            items.append(reasoning_item(message["thinking"]))
        calls = (message.get("tool_calls") or [])[:max_calls]
        if message["content"] or not calls:
            items.append(message_item(message["content"]))
        items += [function_call_item(call) for call in calls]
        response["output"] = items
        finish(response, final)
        self._keep(response, conversation)
        return json_response(response)

    def _keep(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if response["store"]:
            self.store.put(response, conversation + [assistant_turn(response["output"])])

    async def _events(self, chunks: Chunks, response: dict[str, Any], conversation: list[dict[str, Any]],
                      max_calls: int | None) -> AsyncIterator[dict[str, Any]]:
        """Responses' stream events for the native chunks, in OpenAI's order."""
        sequence = 0
        output: list[dict[str, Any]] = response["output"]
        open_item: dict[str, Any] | None = None  # the message or reasoning item being streamed
        text = ""

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            nonlocal sequence
            sequence += 1
            return {"type": kind, "sequence_number": sequence - 1, **fields}

        def snapshot() -> dict[str, Any]:
            return json.loads(json.dumps(response))

        def open_new(item: dict[str, Any]) -> list[dict[str, Any]]:
            nonlocal open_item, text
            open_item, text = item, ""
            output.append(item)
            events = [event("response.output_item.added", output_index=len(output) - 1, item=snapshot_item(item))]
            if item["type"] == "message":
                events.append(event("response.content_part.added", item_id=item["id"], output_index=len(output) - 1,
                                    content_index=0, part=output_text("")))
            return events

        def close() -> list[dict[str, Any]]:
            nonlocal open_item
            item, open_item = open_item, None
            if item is None:
                return []
            index, where = len(output) - 1, {"item_id": item["id"], "content_index": 0}
            if item["type"] == "message":
                item.update(status="completed", content=[output_text(text)])
                events = [event("response.output_text.done", **where, output_index=index, text=text, logprobs=[]),
                          event("response.content_part.done", **where, output_index=index, part=output_text(text))]
            else:
                item["content"] = [{"type": "reasoning_text", "text": text}]
                events = [event("response.reasoning_text.done", **where, output_index=index, text=text)]
            return events + [event("response.output_item.done", output_index=index, item=snapshot_item(item))]

        yield event("response.created", response=snapshot())
        yield event("response.in_progress", response=snapshot())
        calls = 0
        async with aclosing(chunks):
            async for chunk in chunks:
                message = chunk.get("message") or {}
                for kind, piece in (("reasoning", message.get("thinking")), ("message", message.get("content"))):
                    if not piece:
                        continue
                    if open_item is None or open_item["type"] != kind:
                        for e in close() + open_new(reasoning_item("") if kind == "reasoning"
                                                    else message_item("", "in_progress")):
                            yield e
                    text += piece
                    delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
                    extra = {"logprobs": []} if kind == "message" else {}
                    yield event(delta, item_id=open_item["id"], output_index=len(output) - 1, content_index=0,
                                delta=piece, **extra)
                new_calls = (message.get("tool_calls") or [])[:None if max_calls is None else max_calls - calls]
                for call in new_calls:
                    for e in close():
                        yield e
                    item = function_call_item(call, "in_progress")
                    arguments, item["arguments"] = item["arguments"], ""
                    output.append(item)
                    index = len(output) - 1
                    yield event("response.output_item.added", output_index=index, item=snapshot_item(item))
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=arguments)
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=arguments)
                    item.update(arguments=arguments, status="completed")
                    yield event("response.output_item.done", output_index=index, item=snapshot_item(item))
                    calls += 1
                if chunk.get("done"):
                    if not output:  # an empty answer is still one (empty) message
                        for e in open_new(message_item("", "in_progress")):
                            yield e
                    for e in close():
                        yield e
                    finish(response, chunk)
                    self._keep(response, conversation)
                    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                    yield event(done, response=snapshot())
                    return

    async def _stream(self, request: web.Request, events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
        """Server-sent events with `event:` lines, as OpenAI sends them; an error before the first model output
        keeps its status, after it an `error` event ends the stream."""
        async with aclosing(events):
            try:
                # the first two events are ours; the third waits for the model (and its errors)
                head = [await events.__anext__() for _ in range(3)]
            except ApiError as err:
                return openai_error(err)
            except StopAsyncIteration:
                return openai_error(ApiError(500, "the model returned nothing"))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                for event in head:
                    await response.write(sse_event(event))
                async for event in events:
                    await response.write(sse_event(event))
            except ApiError as err:
                await response.write(sse_event({"type": "error", "code": None, "param": None,
                                                "message": error_body(err.status, str(err))["error"]["message"]}))
            except ConnectionResetError:
                log.debug("client went away during a stream")
            return response

    # ------------------------------------------------------------ stored responses

    async def retrieve(self, request: web.Request) -> web.Response:
        stored = self.store.get(request.match_info["id"])
        if stored is None:
            return openai_error(ApiError(404, f"Response with id '{request.match_info['id']}' not found."))
        return json_response(stored[0])

    async def delete(self, request: web.Request) -> web.Response:
        ident = request.match_info["id"]
        if not self.store.pop(ident):
            return openai_error(ApiError(404, f"Response with id '{ident}' not found."))
        return json_response({"id": ident, "object": "response.deleted", "deleted": True})


def snapshot_item(item: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def sse_event(value: Mapping[str, Any]) -> bytes:
    return (f"event: {value['type']}\ndata: ".encode() + json.dumps(value, separators=(",", ":")).encode()
            + b"\n\n")


def responses_routes(app: web.Application, chat: ChatRoutes) -> ResponsesRoutes:
    """Register /v1/responses on `app`."""
    routes = ResponsesRoutes(chat)
    app.router.add_post("/v1/responses", routes.create)
    app.router.add_get("/v1/responses/{id}", routes.retrieve)
    app.router.add_delete("/v1/responses/{id}", routes.delete)
    return routes
