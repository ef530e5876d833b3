"""OpenAI-compatible routes (reference §3.3): /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/models and /v1/models/{model}.

As in Ollama's middleware, each request is translated into the native one and run by the native code
(chat.py, embed.py); the native chunks are translated back. Streams are server-sent events ending with
`data: [DONE]`; errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import struct
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from aiohttp import web

from ollama_engine.store import StoreError

from .chat import ChatRoutes, collect_chat, collect_generate
from .completion import Chunks, first_chunk
from .embed import EmbedRoutes, normalize
from .native import ApiError, json_response, read_json
from .prompt import request_options

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
REASONING = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high", "max": "max",
             "xhigh": "max", "ultra": "max"}
IMAGE_PREFIXES = ("data:image/jpeg;base64,", "data:image/jpg;base64,", "data:image/png;base64,",
                  "data:image/webp;base64,", "data:;base64,")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": None, "code": None}}


def openai_error(err: ApiError) -> web.Response:
    return json_response(error_body(err.status, str(err)), status=err.status, headers=err.headers)


def sse(value: Any) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


# ---------------------------------------------------------------- request translation


def sampling_options(body: Mapping[str, Any], top_p_zero_is_one: bool = False) -> dict[str, Any]:
    """OpenAI sampling fields as native options; temperature and top_p default to 1.0 (Ollama's choice)."""
    options: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        options["num_predict"] = max_tokens
    for key in ("seed", "frequency_penalty", "presence_penalty"):
        if body.get(key) is not None:
            options[key] = body[key]
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, f"invalid type for 'stop' field: {type(stop).__name__}")
        options["stop"] = stop
    temperature = body.get("temperature")
    options["temperature"] = 1.0 if temperature is None else temperature
    top_p = body.get("top_p")
    options["top_p"] = 1.0 if top_p is None or (top_p_zero_is_one and top_p == 0) else top_p
    return options


def native_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as native ones: each content part becomes its own message; tool arguments a dict."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "[] is too short - 'messages'")
    out: list[dict[str, Any]] = []
    tool_names: dict[str, str] = {}
    for m in messages:
        if not isinstance(m, dict):
            raise ApiError(400, "invalid message format")
        role = str(m.get("role", "")).lower()
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            msg: dict[str, Any] = {"role": role, "content": ""}
            if isinstance(part, str) or part is None:
                msg["content"] = part or ""
            elif isinstance(part, dict) and part.get("type") == "text":
                msg["content"] = str(part.get("text", ""))
            elif isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url", "") if isinstance(url, dict) else str(url or "")
                prefix = next((p for p in IMAGE_PREFIXES if url.startswith(p)), None)
                if prefix is None:
                    raise ApiError(400, "image URLs are not currently supported, please use base64 encoded data "
                                        "instead")
                msg["images"] = [url[len(prefix):]]
            else:
                raise ApiError(400, "invalid message content type")
            out.append(msg)
        last = out[-1]
        if m.get("tool_calls"):
            calls = []
            for i, call in enumerate(m["tool_calls"]):
                function = call.get("function") or {}
                arguments = function.get("arguments", "")
                if not isinstance(arguments, str):
                    raise ApiError(400, "json: cannot unmarshal object into Go struct field of type string")
                try:
                    parsed = json.loads(arguments) if arguments.strip() else {}
                except ValueError as err:
                    raise ApiError(400, "invalid tool call arguments") from err
                calls.append({"id": call.get("id", ""), "function": {"index": i, "name": function.get("name", ""),
                                                                      "arguments": parsed}})
                if call.get("id"):
                    tool_names[call["id"]] = function.get("name", "")
            last["tool_calls"] = calls
        if role == "tool":
            last["tool_name"] = m.get("name") or tool_names.get(m.get("tool_call_id", ""), "")
            if m.get("tool_call_id"):
                last["tool_call_id"] = m["tool_call_id"]
    return out


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """/v1/chat/completions as a native /api/chat request."""
    native: dict[str, Any] = {"model": body.get("model"), "messages": native_messages(body.get("messages")),
                              "options": sampling_options(body), "stream": bool(body.get("stream"))}
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        if response_format.get("type") == "json_object":
            native["format"] = "json"
        elif response_format.get("type") == "json_schema":
            native["format"] = (response_format.get("json_schema") or {}).get("schema")
    if body.get("tools"):
        native["tools"] = body["tools"]
    effort = body.get("reasoning_effort") or (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        if effort not in REASONING:
            raise ApiError(400, f"invalid reasoning value: '{effort}' (must be one of {', '.join(REASONING)})")
        native["think"] = REASONING[effort]
    if body.get("logprobs"):
        native["logprobs"] = True
        native["top_logprobs"] = body.get("top_logprobs") or 0
    return native


# ---------------------------------------------------------------- response translation


def openai_tool_calls(calls: list[dict[str, Any]], offset: int = 0) -> list[dict[str, Any]]:
    return [{"id": c.get("id", ""), "index": offset + i, "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def usage(final: Mapping[str, Any]) -> dict[str, int]:
    prompt, completion = final.get("prompt_eval_count", 0), final.get("eval_count", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(final: Mapping[str, Any], tool_calls: bool) -> str | None:
    reason = final.get("done_reason")
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return reason if reason in ("stop", "length") else None


def openai_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if not entries:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                           "bytes": list(t["token"].encode())} for t in e.get("top_logprobs") or []]}
                        for e in entries]}


class OpenAIRoutes:
    def __init__(self, chat: ChatRoutes, embed: EmbedRoutes) -> None:
        self.chat = chat
        self.embed = embed

    async def _stream(self, request: web.Request, events: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
        """Server-sent events; an error before the first event keeps its status."""
        async with aclosing(events):
            try:
                first = await first_chunk(events)
            except ApiError as err:
                return openai_error(err)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            try:
                await response.write(sse(first))
                async for event in events:
                    await response.write(sse(event))
                await response.write(b"data: [DONE]\n\n")
            except ApiError as err:
                await response.write(sse(error_body(err.status, str(err))))
            except ConnectionResetError:
                log.debug("client went away during a stream")
            return response

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            native = chat_request(body)
            entry, job, state = await self.chat.prepare_chat(native)
            assert job is not None  # messages are never empty here
        except ApiError as err:
            return openai_error(err)
        chunks = self.chat.chat_chunks(job, state["tools"], state["think"])
        ident, created, model = f"chatcmpl-{random.randrange(999)}", int(time.time()), str(body.get("model"))
        if not body.get("stream"):
            async with aclosing(chunks):
                try:
                    collected = [chunk async for chunk in chunks]
                except ApiError as err:
                    return openai_error(err)
            final = collect_chat(collected)
            message = final["message"]
            out_message: dict[str, Any] = {"role": "assistant", "content": message["content"]}
            if message.get("thinking"):
                out_message["reasoning"] = message["thinking"]
            if message.get("tool_calls"):
                out_message["tool_calls"] = openai_tool_calls(message["tool_calls"])
            choice: dict[str, Any] = {"index": 0, "message": out_message,
                                      "finish_reason": finish_reason(final, bool(message.get("tool_calls")))}
            if final.get("logprobs"):
                choice["logprobs"] = openai_logprobs(final["logprobs"])
            return json_response({"id": ident, "object": "chat.completion", "created": created, "model": model,
                                  "system_fingerprint": "fp_ollama", "choices": [choice], "usage": usage(final)})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await self._stream(request, self._chat_events(chunks, ident, created, model, include_usage))

    async def _chat_events(self, chunks: Chunks, ident: str, created: int, model: str,
                           include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        def event(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            if logprobs:
                choice["logprobs"] = openai_logprobs(logprobs)
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": "fp_ollama", "choices": [choice]}

        first, calls = True, 0
        async with aclosing(chunks):
            async for chunk in chunks:
                message = chunk.get("message") or {}
                if chunk.get("done"):
                    if first:  # an empty completion still says who speaks
                        yield event({"role": "assistant", "content": ""})
                    yield event({}, finish_reason(chunk, calls > 0))
                    if include_usage:
                        yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                               "system_fingerprint": "fp_ollama", "choices": [], "usage": usage(chunk)}
                    return
                deltas: list[dict[str, Any]] = []
                if message.get("thinking"):
                    deltas.append({"reasoning": message["thinking"]})
                if message.get("content") or message.get("tool_calls") or not deltas:
                    delta: dict[str, Any] = {"content": message.get("content", "")}
                    if message.get("tool_calls"):
                        delta["tool_calls"] = openai_tool_calls(message["tool_calls"], calls)
                        calls += len(message["tool_calls"])
                    deltas.append(delta)
                for delta in deltas:
                    if first:
                        delta = {"role": "assistant", **delta}
                        first = False
                    yield event(delta, logprobs=chunk.get("logprobs"))

    # ------------------------------------------------------------ /v1/completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string")
            native: dict[str, Any] = {"model": body.get("model"), "prompt": prompt, "suffix": body.get("suffix"),
                                      "options": sampling_options(body, top_p_zero_is_one=True)}
            if body.get("logprobs"):
                native.update(logprobs=True, top_logprobs=int(body["logprobs"]))
            entry, job, state = await self.chat.prepare_generate(native)
            if job is None:
                raise ApiError(400, "prompt is required")
        except ApiError as err:
            return openai_error(err)
        chunks = self.chat.generate_chunks(job, state["think"])
        ident, created, model = f"cmpl-{random.randrange(999)}", int(time.time()), str(body.get("model"))

        def obj(text: str, reason: str | None) -> dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": created, "model": model,
                    "system_fingerprint": "fp_ollama",
                    "choices": [{"text": text, "index": 0, "finish_reason": reason}]}

        if not body.get("stream"):
            async with aclosing(chunks):
                try:
                    collected = [chunk async for chunk in chunks]
                except ApiError as err:
                    return openai_error(err)
            final = collect_generate(collected)
            return json_response({**obj(final["response"], finish_reason(final, False)), "usage": usage(final)})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[dict[str, Any]]:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.get("done"):
                        yield obj("", finish_reason(chunk, False))
                        if include_usage:
                            yield {**obj("", None), "choices": [], "usage": usage(chunk)}
                        return
                    yield obj(chunk.get("response", ""), None)

        return await self._stream(request, events())

    # ------------------------------------------------------------ /v1/embeddings

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            raw = body.get("input")
            if raw == "":
                raw = [""]
            texts = [raw] if isinstance(raw, str) else raw
            if not texts or not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "invalid input")
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise ApiError(400, f"Invalid value for 'encoding_format' = {encoding}. Supported values: "
                                    "['float', 'base64'].")
            entry = self.embed._entry(body.get("model"), "model '{name}' not found")
            opts, _ = request_options(entry, None)
            vectors, count, _ = await self.embed.embed_texts(entry, texts, opts, None)
            dimensions = body.get("dimensions") or 0
            out = [normalize(v) for v in vectors]
            if isinstance(dimensions, int) and 0 < dimensions < min(len(v) for v in out):
                out = [normalize(v[:dimensions]) for v in out]
            data = [{"object": "embedding", "index": i,
                     "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
                     if encoding == "base64" else v} for i, v in enumerate(out)]
            return json_response({"object": "list", "data": data, "model": body.get("model"),
                                  "usage": {"prompt_tokens": count, "total_tokens": count}})
        except ApiError as err:
            return openai_error(err)

    # ------------------------------------------------------------ /v1/models

    async def models(self, request: web.Request) -> web.Response:
        store = self.chat.catalog.store
        data = [{"id": name.display_shortest(), "object": "model", "created": int(manifest.mtime),
                 "owned_by": name.namespace} for name, manifest in store.manifests().items()]
        data.sort(key=lambda m: m["created"], reverse=True)
        return json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        requested = request.match_info["model"]
        try:
            name, manifest = self.chat.catalog.store.lookup(requested)
        except StoreError:
            return openai_error(ApiError(404, f"model '{requested}' not found"))
        return json_response({"id": requested, "object": "model", "created": int(manifest.mtime),
                              "owned_by": name.namespace})


def openai_routes(app: web.Application, chat: ChatRoutes, embed: EmbedRoutes) -> None:
    routes = OpenAIRoutes(chat, embed)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/embeddings", routes.embeddings)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
