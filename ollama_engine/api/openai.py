"""OpenAI-compatible routes (reference §3.3): /v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/models and /v1/models/{model}.

As in Ollama's middleware, each request is translated into the native one and run by the native code
(chat.py, embed.py); the native chunks are translated back. Streams are server-sent events ending with
`data: [DONE]`; errors have OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from ollama_engine.store import StoreError

from .catalog import Entry
from .chat import ChatRoutes, collect_chat, collect_generate
from .completion import Chunks, Job, collected, first_chunk, runner_chunks
from .embed import EmbedRoutes, normalized, parse_dimensions
from .image_urls import ImageFetch, inline_image_urls
from .native import ApiError, json_response, read_json
from .prompt import request_options
from .tool_choice import ToolChoiceError, ToolPlan, openai_choice, plan_tools, tool_name

log = logging.getLogger(__name__)

MAX_CHOICES = 8  # `n`: each choice is a whole generation, so keep one request's work bounded
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
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if body.get(key) is not None:
            options["num_predict"] = max_token_count(key, body[key])
            break
    for key in ("seed", "frequency_penalty", "presence_penalty"):
        if body.get(key) is not None:
            options[key] = body[key]
    for key in ("frequency_penalty", "presence_penalty"):  # OpenAI's range (the native options take any)
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not -2 <= value <= 2):
            raise ApiError(400, f"Invalid '{key}': expected a number between -2 and 2, but got {value!r} instead.")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, f"invalid type for 'stop' field: {type(stop).__name__}")
        options["stop"] = stop
    if body.get("logit_bias") is not None:
        options["logit_bias"] = logit_bias(body["logit_bias"])
    temperature = body.get("temperature")
    options["temperature"] = 1.0 if temperature is None else temperature
    top_p = body.get("top_p")
    options["top_p"] = 1.0 if top_p is None or (top_p_zero_is_one and top_p == 0) else top_p
    return options


def logit_bias(value: Any) -> dict[str, float]:
    """OpenAI's logit_bias: token ids (as strings) to a value from -100 to 100, added to the token's logit by
    the runner's sampler (-100 bans a token, 100 all but forces it)."""
    if not isinstance(value, dict):
        raise ApiError(400, "Invalid type for 'logit_bias': expected an object.")
    out = {}
    for key, bias in value.items():
        if not key.isdigit():
            raise ApiError(400, f"Invalid key in 'logit_bias': {key!r} is not a token id.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"Invalid value in 'logit_bias' for {key}: must be a number from -100 to 100.")
        out[str(int(key))] = float(bias)
    return out


async def check_bias_ids(entry: Entry, sampling: Mapping[str, Any]) -> None:
    """A 400 for a logit_bias token id outside the model's vocabulary."""
    bias = sampling.get("logit_bias")
    if bias:
        tokenizer = await asyncio.to_thread(lambda: entry.view.tokenizer)
        size = len(tokenizer.vocab.tokens)
        bad = next((k for k in bias if int(k) >= size), None)
        if bad is not None:
            raise ApiError(400, f"Invalid key in 'logit_bias': {bad}. The model's vocabulary has {size} tokens.")


def max_token_count(key: str, value: Any) -> int:
    """max_tokens and its kin: an integer of at least 1, as OpenAI requires. 0 is no "unlimited" here: the
    runner would read num_predict 0 as no limit."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"Invalid type for '{key}': expected an integer, but got {type(value).__name__}.")
    if value < 1:
        raise ApiError(400, f"Invalid '{key}': integer below minimum value. Expected a value >= 1, but got "
                            f"{value} instead.")
    return value


def message_role(message: Any) -> str:
    """A message's role, lower-cased: a message must be an object with a non-empty string role."""
    if not isinstance(message, dict):
        raise ApiError(400, "invalid message format")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError(400, "invalid message: 'role' must be a non-empty string")
    return role.lower()


def native_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as native ones: each content part becomes its own message; tool arguments a dict."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "[] is too short - 'messages'")
    out: list[dict[str, Any]] = []
    tool_names: dict[str, str] = {}
    for m in messages:
        role = message_role(m)
        content = m.get("content")
        parts = content if isinstance(content, list) and content else [content or None]
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
            if not isinstance(m["tool_calls"], list):
                raise ApiError(400, "invalid message: 'tool_calls' must be an array")
            calls = []
            for i, call in enumerate(m["tool_calls"]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ApiError(400, "invalid message: each tool call needs a 'function' with a string 'name'")
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
            last["tool_name"] = m.get("name") or tool_names.get(str(m.get("tool_call_id") or ""), "")
            if m.get("tool_call_id"):
                last["tool_call_id"] = str(m["tool_call_id"])
    return out


def format_value(kind: Any, schema: Any, field: str) -> Any:
    """An OpenAI output format (`response_format`, Responses' `text.format`) as the native `format`."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise ApiError(400, f"Missing required parameter: '{field}.schema' (a JSON schema object).")
        return schema
    raise ApiError(400, f"Invalid value for '{field}.type': {kind!r}. Supported values are: 'text', 'json_object' "
                        "and 'json_schema'.")


def response_format(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "Invalid type for 'response_format': expected an object.")
    schema = value.get("json_schema")
    return format_value(value.get("type"), schema.get("schema") if isinstance(schema, dict) else None,
                        "response_format.json_schema")


def function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools, each a function tool (the only kind a local model can run)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "Invalid type for 'tools': expected an array.")
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ApiError(400, f"unsupported tool type: {kind!r} (only function tools are supported)")
        if not tool_name(tool):
            raise ApiError(400, "Missing required parameter: 'tools[].function.name'.")
    return tools


def apply_tools(native: dict[str, Any], tools: Any, choice: Any) -> ToolPlan:
    """tools and tool_choice into the native request: the tools rendered, and for a forced call the schema
    the output must match (tool_choice.py)."""
    try:
        plan = plan_tools(function_tools(tools), *openai_choice(choice))
    except ToolChoiceError as err:
        raise ApiError(400, str(err)) from err
    if plan.tools:
        native["tools"] = plan.tools
    if plan.format is not None:
        native["format"] = plan.format
    return plan


def reasoning_think(effort: Any) -> bool | str | None:
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in REASONING:
        raise ApiError(400, f"invalid reasoning value: '{effort}' (must be one of {', '.join(REASONING)})")
    return REASONING[effort]


def chat_request(body: Mapping[str, Any]) -> tuple[dict[str, Any], ToolPlan]:
    """/v1/chat/completions as a native /api/chat request, and its tool plan."""
    native: dict[str, Any] = {"model": body.get("model"), "messages": native_messages(body.get("messages")),
                              "options": sampling_options(body), "stream": bool(body.get("stream"))}
    native["format"] = response_format(body.get("response_format"))
    plan = apply_tools(native, body.get("tools"), body.get("tool_choice"))
    reasoning = body.get("reasoning")
    think = reasoning_think(body.get("reasoning_effort")
                            or (reasoning.get("effort") if isinstance(reasoning, dict) else None))
    if think is not None:
        native["think"] = think
    if body.get("logprobs"):
        native["logprobs"] = True
        native["top_logprobs"] = body.get("top_logprobs") or 0
    elif body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs requires logprobs to be true")
    return native, plan


# ---------------------------------------------------------------- response translation


def openai_tool_calls(calls: list[dict[str, Any]], offset: int = 0) -> list[dict[str, Any]]:
    return [{"id": c.get("id", ""), "index": offset + i, "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def usage(final: Mapping[str, Any], *more: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's usage of one final chunk, or of several choices of one prompt (their completions added up);
    prompt_tokens_details.cached_tokens when the runner's prompt cache reused tokens (with_cached_tokens)."""
    prompt = final.get("prompt_eval_count", 0)
    completion = sum(f.get("eval_count", 0) for f in (final, *more))
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if final.get("cached_tokens"):
        out["prompt_tokens_details"] = {"cached_tokens": final["cached_tokens"]}
    return out


def with_cached_tokens(chat: ChatRoutes, job: Job, shape: Callable[[Chunks], Chunks]) -> Chunks:
    """`shape` (native chunks from runner lines) run on `job`, its final chunk carrying `cached_tokens`: the
    prompt tokens the runner's prompt cache reused (its done line's `prompt_cached_count`), which the native
    chunks do not report and OpenAI's usage does."""
    seen = {"cached": 0}

    async def source() -> Chunks:
        async with aclosing(runner_chunks(chat.scheduler, job)) as raw:
            async for chunk in raw:
                if chunk.get("done"):
                    seen["cached"] = int(chunk.get("prompt_cached_count") or 0)
                yield chunk

    async def run() -> Chunks:
        async with aclosing(shape(source())) as chunks:
            async for chunk in chunks:
                yield {**chunk, "cached_tokens": seen["cached"]} if chunk.get("done") else chunk

    return run()


def chat_run(chat: ChatRoutes, job: Job, tools: Any, think: bool | None) -> Chunks:
    """chat.chat_chunks for `job`, with cached_tokens (with_cached_tokens)."""
    return with_cached_tokens(chat, job, lambda lines: chat.chat_chunks(job, tools, think, source=lines))


def generate_run(chat: ChatRoutes, job: Job, think: bool | None) -> Chunks:
    """chat.generate_chunks for `job`, with cached_tokens (with_cached_tokens)."""
    return with_cached_tokens(chat, job, lambda lines: chat.generate_chunks(job, think, source=lines))


def envelope(kind: str, ident: str, created: int, model: str, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """The object around an OpenAI answer or stream chunk (`kind`: chat.completion, chat.completion.chunk,
    text_completion), with `usage` or the like in `extra`."""
    return {"id": ident, "object": kind, "created": created, "model": model, "system_fingerprint": "fp_ollama",
            "choices": choices, **extra}


def choice_count(body: Mapping[str, Any]) -> int:
    """`n`: how many choices, run one after another on the model's slots; at most MAX_CHOICES."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"Invalid 'n': must be an integer from 1 to {MAX_CHOICES}, got {n!r}.")
    if n > 1 and body.get("stream"):
        raise ApiError(400, "n > 1 is not supported with stream: true")
    return n


def choice_job(job: Job, index: int) -> Job:
    """Choice `index`'s own copy of `job`; a fixed seed becomes seed + index, so choices differ but repeat."""
    sampling = dict(job.sampling)
    if index and sampling.get("seed", -1) != -1:
        sampling["seed"] += index
    return replace(job, sampling=sampling, extra=dict(job.extra))


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


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions: at most 5 alternatives per token
JSON_KINDS = {bool: "a boolean", str: "a string", float: "a decimal number", list: "an array", dict: "an object"}


def completion_logprobs_count(value: Any) -> int | None:
    """/v1/completions `logprobs`: how many alternatives per token (0-5), None when not asked for.

    Unlike chat's boolean `logprobs`, the legacy API's is an integer; 0 still returns the chosen tokens'
    logprobs, as OpenAI's does (Ollama's layer asks the runner for them when it is above 0, but never puts
    them in its answer)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = JSON_KINDS.get(type(value), "a value of another type")
        raise ApiError(400, f"Invalid type for 'logprobs': expected an integer, but got {kind} instead.")
    if value < 0:
        raise ApiError(400, f"Invalid 'logprobs': integer below minimum value. Expected a value >= 0, but got "
                            f"{value} instead.")
    if value > MAX_COMPLETION_LOGPROBS:
        raise ApiError(400, f"Invalid 'logprobs': integer above maximum value. Expected a value <= "
                            f"{MAX_COMPLETION_LOGPROBS}, but got {value} instead.")
    return value


def legacy_logprobs(entries: list[dict[str, Any]], top: int, offset: int = 0) -> dict[str, Any]:
    """Native logprob entries in the legacy completions shape: parallel lists of `tokens`, `token_logprobs`,
    `top_logprobs` and `text_offset`.

    Each `top_logprobs` item maps the `top` likeliest tokens' texts to their logprobs, best first, plus the
    chosen token (OpenAI: "up to logprobs+1 elements"); two tokens with the same text keep the likelier's.
    `text_offset`: where each token's text starts in the choice's text, counted from `offset` (a stream's
    earlier chunks)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        alternatives: dict[str, float] = {}
        for alt in (entry.get("top_logprobs") or [])[:top]:
            alternatives.setdefault(alt["token"], alt["logprob"])
        alternatives.setdefault(entry["token"], entry["logprob"])
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(entry["token"])
    return out


async def embedding_texts(entry: Entry, raw: Any) -> list[str]:
    """/v1/embeddings `input`: a string, strings, token ids, or arrays of token ids (OpenAI accepts all four).

    Token ids become text with the model's tokenizer (the runner embeds text); an id outside the vocabulary
    is a 400."""
    if raw == "":
        raw = [""]
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "invalid input: expected a string, an array of strings, an array of token ids or an "
                            "array of arrays of token ids")
    if all(isinstance(t, str) for t in raw):
        return raw

    def is_tokens(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    arrays = [raw] if is_tokens(raw) else raw
    if not all(is_tokens(a) for a in arrays):
        raise ApiError(400, "invalid input: expected a string, an array of strings, an array of token ids or an "
                            "array of arrays of token ids")
    tokenizer = await asyncio.to_thread(lambda: entry.view.tokenizer)
    size = len(tokenizer.vocab.tokens)
    for tokens in arrays:
        bad = next((t for t in tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ApiError(400, f"invalid input: token id {bad} is outside the model's vocabulary of {size}")
    return [tokenizer.decode(tokens) for tokens in arrays]


class OpenAIRoutes:
    def __init__(self, chat: ChatRoutes, embed: EmbedRoutes, image_fetch: ImageFetch | None = None) -> None:
        self.chat = chat
        self.embed = embed
        self.image_fetch = image_fetch  # None: http(s) image URLs are refused, as Ollama does

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
            if isinstance(body, dict) and "messages" in body:
                body = {**body, "messages": await inline_image_urls(body["messages"], self.image_fetch)}
            native, plan = chat_request(body)
            n = choice_count(body)
            prepared = await self.chat.prepare_chat(native)
            job = prepared.job
            assert job is not None  # messages are never empty here
            await check_bias_ids(prepared.entry, job.sampling)
        except ApiError as err:
            return openai_error(err)
        max_calls = None if body.get("parallel_tool_calls") is not False else 1
        ident, created, model = f"chatcmpl-{random.randrange(999)}", int(time.time()), str(body.get("model"))
        if body.get("stream"):
            chunks = chat_run(self.chat, job, prepared.tools, prepared.think)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, self._chat_events(chunks, ident, created, model, include_usage,
                                                                 max_calls))
        try:
            finals = []
            for index in range(n):  # one after another: each takes a slot, and the first error ends the request
                chunks = chat_run(self.chat, choice_job(job, index), prepared.tools, prepared.think)
                finals.append(await collected(chunks, collect_chat))
        except ApiError as err:
            return openai_error(err)
        choices = [self._choice(index, final, max_calls) for index, final in enumerate(finals)]
        return json_response(envelope("chat.completion", ident, created, model, choices, usage=usage(*finals)))

    @staticmethod
    def _choice(index: int, final: Mapping[str, Any], max_calls: int | None) -> dict[str, Any]:
        message = final["message"]
        out_message: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message.get("thinking"):
            out_message["reasoning"] = message["thinking"]
        calls = (message.get("tool_calls") or [])[:max_calls]
        if calls:
            out_message["tool_calls"] = openai_tool_calls(calls)
        choice: dict[str, Any] = {"index": index, "message": out_message,
                                  "finish_reason": finish_reason(final, bool(calls))}
        if final.get("logprobs"):
            choice["logprobs"] = openai_logprobs(final["logprobs"])
        return choice

    async def _chat_events(self, chunks: Chunks, ident: str, created: int, model: str,
                           include_usage: bool, max_calls: int | None = None) -> AsyncIterator[dict[str, Any]]:
        def event(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
            if logprobs:
                choice["logprobs"] = openai_logprobs(logprobs)
            return envelope("chat.completion.chunk", ident, created, model, [choice])

        first, calls = True, 0
        async with aclosing(chunks):
            async for chunk in chunks:
                message = chunk.get("message") or {}
                if chunk.get("done"):
                    if first:  # an empty completion still says who speaks
                        yield event({"role": "assistant", "content": ""})
                    yield event({}, finish_reason(chunk, calls > 0))
                    if include_usage:
                        yield envelope("chat.completion.chunk", ident, created, model, [], usage=usage(chunk))
                    return
                deltas: list[dict[str, Any]] = []
                if message.get("thinking"):
                    deltas.append({"reasoning": message["thinking"]})
                new_calls = (message.get("tool_calls") or [])[:None if max_calls is None else max_calls - calls]
                if message.get("content") or new_calls or not deltas:
                    delta: dict[str, Any] = {"content": message.get("content", "")}
                    if new_calls:  # each call's index counts the calls streamed before it
                        delta["tool_calls"] = openai_tool_calls(new_calls, calls)
                        calls += len(new_calls)
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
            top = completion_logprobs_count(body.get("logprobs"))
            if top is not None:
                native.update(logprobs=True, top_logprobs=top)
            prepared = await self.chat.prepare_generate(native)
            job = prepared.job
            if job is None:
                raise ApiError(400, "prompt is required")
            await check_bias_ids(prepared.entry, job.sampling)
        except ApiError as err:
            return openai_error(err)
        chunks = generate_run(self.chat, job, prepared.think)
        ident, created, model = f"cmpl-{random.randrange(999)}", int(time.time()), str(body.get("model"))

        def obj(text: str, reason: str | None, logprobs: dict[str, Any] | None = None,
                **extra: Any) -> dict[str, Any]:
            choice: dict[str, Any] = {"text": text, "index": 0, "finish_reason": reason}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            return envelope("text_completion", ident, created, model, [choice], **extra)

        if not body.get("stream"):
            try:
                final = await collected(chunks, collect_generate)
            except ApiError as err:
                return openai_error(err)
            logprobs = None if top is None else legacy_logprobs(final.get("logprobs") or [], top)
            return json_response(obj(final["response"], finish_reason(final, False), logprobs, usage=usage(final)))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[dict[str, Any]]:
            offset = 0  # text_offset goes on from chunk to chunk: the choice's text so far
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.get("done"):
                        yield obj("", finish_reason(chunk, False))
                        if include_usage:
                            yield envelope("text_completion", ident, created, model, [], usage=usage(chunk))
                        return
                    logprobs = None
                    if top is not None and chunk.get("logprobs"):
                        logprobs = legacy_logprobs(chunk["logprobs"], top, offset)
                        offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    yield obj(chunk.get("response", ""), None, logprobs)

        return await self._stream(request, events())

    # ------------------------------------------------------------ /v1/embeddings

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            entry = self.embed.entry(body.get("model"), "model '{name}' not found")
            texts = await embedding_texts(entry, body.get("input"))
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise ApiError(400, f"Invalid value for 'encoding_format' = {encoding}. Supported values: "
                                    "['float', 'base64'].")
            dimensions = parse_dimensions(body.get("dimensions"))
            opts, _ = request_options(entry, None)
            vectors, count, _ = await self.embed.embed_texts(entry, texts, opts, None)
            out = normalized(vectors, dimensions)
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


def openai_routes(app: web.Application, chat: ChatRoutes, embed: EmbedRoutes,
                  image_fetch: ImageFetch | None = None) -> None:
    routes = OpenAIRoutes(chat, embed, image_fetch)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/embeddings", routes.embeddings)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
