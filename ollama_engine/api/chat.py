"""POST /api/chat and POST /api/generate (reference §3.2): prompt rendering, streaming, thinking, tools.

Each route checks the request the way Ollama does (and in its order, so the same bad request gets the
same error), renders the prompt (prompt.py), runs it (completion.py) and shapes the runner's lines into
Ollama's chunks. `chat_chunks` / `generate_chunks` are also what the OpenAI layer translates.
"""

from __future__ import annotations

import asyncio
import secrets
import string
from collections.abc import Mapping, Sequence
from contextlib import aclosing
from typing import Any

from aiohttp import web

from ollama_engine.sched import Context, Scheduler
from ollama_engine.template import ToolCallStream

from .catalog import Catalog, Entry, ModelNotFoundError
from .completion import Chunks, Job, completion_extra, metrics, respond_ndjson, runner_chunks
from .native import ApiError, created_at, json_response, parse_keep_alive, read_json, schedule
from .prompt import (
    ThinkingSplitter,
    chat_messages,
    check_format,
    check_images,
    check_think,
    generate_prompt,
    off_loop,
    render_chat,
    request_options,
    think_value,
)

_ID_CHARS = string.ascii_lowercase + string.digits


def tool_call_id() -> str:
    """call_ and 8 characters of [a-z0-9], as Ollama makes them."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(8))


class ChatRoutes:
    """The handlers, on one scheduler and one catalog."""

    def __init__(self, scheduler: Scheduler, catalog: Catalog) -> None:
        self.scheduler = scheduler
        self.catalog = catalog

    # ------------------------------------------------------------ shared checks

    def entry(self, name: Any, *, missing_status: int) -> Entry:
        if not isinstance(name, str) or not name:
            if missing_status == 404:
                raise ApiError(404, f"model '{name or ''}' not found")
            raise ApiError(400, "model is required")
        try:
            return self.catalog.resolve(name)
        except ModelNotFoundError as err:
            raise ApiError(404, f"model '{name}' not found") from err

    async def _load_or_unload(self, entry: Entry, keep_alive: float | None, opts: Any) -> str:
        """Empty prompt / messages: unload with keep_alive 0, else load only (Ollama's special cases)."""
        if keep_alive == 0:
            self.scheduler.expire_runner(entry.model)
            return "unload"
        ctx = Context()
        try:
            await schedule(self.scheduler, ctx, entry.model, opts, keep_alive)
        finally:
            ctx.cancel()
        return "load"

    # ------------------------------------------------------------ /api/chat

    async def prepare_chat(self, body: Mapping[str, Any]) -> tuple[Entry, Job | None, dict[str, Any]]:
        """Validate a chat request: (entry, job or None for load/unload, state for the chunks)."""
        entry = self.entry(body.get("model"), missing_status=400)
        if "completion" not in entry.capabilities:
            raise ApiError(400, f'"{entry.requested}" does not support chat')
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "json: cannot unmarshal messages into Go struct field ChatRequest.messages")
        tools = body.get("tools") or None
        if tools and "tools" not in entry.capabilities:
            raise ApiError(400, f"{entry.full_name} does not support tools")
        think, level = think_value(body.get("think"))
        check_think(entry, think)
        check_images(entry, messages)
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        opts, sampling = request_options(entry, body.get("options"))
        extra = completion_extra(body)
        await check_format(extra)
        state = {"tools": tools, "think": think, "keep_alive": keep_alive, "opts": opts}
        if not messages:
            return entry, None, state
        prompt = await off_loop(lambda: render_chat(entry, chat_messages(entry, messages), tools, think, level))
        return entry, Job(entry, prompt, opts, sampling, keep_alive, extra), state

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            entry, job, state = await self.prepare_chat(body)
            if job is None:
                reason = await self._load_or_unload(entry, state["keep_alive"], state["opts"])
                return json_response({"model": entry.requested, "created_at": created_at(),
                                      "message": {"role": "assistant", "content": ""}, "done": True,
                                      "done_reason": reason})
        except ApiError as err:
            return err.response()
        chunks = self.chat_chunks(job, state["tools"], state["think"])
        return await respond_ndjson(request, chunks, body.get("stream") is not False, collect_chat)

    async def chat_chunks(self, job: Job, tools: Sequence[Mapping[str, Any]] | None, think: bool | None,
                          source: Chunks | None = None) -> Chunks:
        """Ollama's chat chunks: message pieces (content, thinking, tool_calls), then the final one.
        `source`: the runner's lines (default: run `job`; tests replay recorded lines)."""
        name = job.entry.requested
        thinking = ThinkingSplitter(bool(think) and "thinking" in job.entry.capabilities)
        calls = ToolCallStream(tools) if tools else None

        def message(content: str, thought: str = "", tool_calls: list[dict[str, Any]] | None = None,
                    logprobs: Any = None) -> dict[str, Any]:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thought:
                msg["thinking"] = thought
            if tool_calls:
                msg["tool_calls"] = [{"id": tool_call_id(), **call} for call in tool_calls]
            out = {"model": name, "created_at": created_at(), "message": msg, "done": False}
            if logprobs:
                out["logprobs"] = logprobs
            return out

        async with aclosing(source or runner_chunks(self.scheduler, job)) as raw:
            async for chunk in raw:
                if chunk.get("done"):
                    thought, content = thinking.finish()
                    found: list[dict[str, Any]] = []
                    if calls is not None:
                        content = calls.feed(content) if content else ""
                        rest, found = calls.finish()
                        content += rest
                    if thought or content or found:
                        yield message(content, thought, found)
                    yield {"model": name, "created_at": created_at(),
                           "message": {"role": "assistant", "content": ""}, "done": True, **metrics(job, chunk)}
                    return
                thought, content = thinking.feed(chunk.get("content", ""))
                if calls is not None and content:
                    content = calls.feed(content)
                if thought or content or chunk.get("logprobs"):
                    yield message(content, thought, logprobs=chunk.get("logprobs"))

    # ------------------------------------------------------------ /api/generate

    async def prepare_generate(self, body: Mapping[str, Any]) -> tuple[Entry, Job | None, dict[str, Any]]:
        entry = self.entry(body.get("model"), missing_status=404)
        if "completion" not in entry.capabilities:
            raise ApiError(400, f'"{entry.requested}" does not support generate')
        if body.get("raw") and (body.get("template") or body.get("system") or body.get("context")):
            raise ApiError(400, "raw mode does not support template, system, or context")
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise ApiError(400, "json: cannot unmarshal prompt into Go struct field GenerateRequest.prompt")
        think, level = think_value(body.get("think"))
        check_think(entry, think)
        if body.get("images"):
            check_images(entry, [{"images": body["images"]}])
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        opts, sampling = request_options(entry, body.get("options"))
        extra = completion_extra(body)
        await check_format(extra)
        state = {"think": think, "keep_alive": keep_alive, "opts": opts, "raw": bool(body.get("raw"))}
        if not prompt and not body.get("suffix"):
            return entry, None, state
        text = await off_loop(lambda: generate_prompt(entry, body, think, level))
        context = body.get("context")
        if context:
            if not isinstance(context, list) or not all(isinstance(t, int) for t in context):
                raise ApiError(400, "json: cannot unmarshal context into Go struct field of type []int")
            tokenizer = await asyncio.to_thread(lambda: entry.view.tokenizer)
            try:
                text = tokenizer.decode(context, special=True) + text
            except IndexError as err:
                raise ApiError(400, f"invalid context: {err}") from err
        return entry, Job(entry, text, opts, sampling, keep_alive, extra), state

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            entry, job, state = await self.prepare_generate(body)
            if job is None:
                reason = await self._load_or_unload(entry, state["keep_alive"], state["opts"])
                return json_response({"model": entry.requested, "created_at": created_at(), "response": "",
                                      "done": True, "done_reason": reason})
        except ApiError as err:
            return err.response()
        chunks = self.generate_chunks(job, state["think"], with_context=not state["raw"])
        return await respond_ndjson(request, chunks, body.get("stream") is not False, collect_generate)

    async def generate_chunks(self, job: Job, think: bool | None, with_context: bool = False) -> Chunks:
        name = job.entry.requested
        thinking = ThinkingSplitter(bool(think) and "thinking" in job.entry.capabilities)
        output: list[str] = []

        def piece(content: str, thought: str = "", logprobs: Any = None) -> dict[str, Any]:
            out: dict[str, Any] = {"model": name, "created_at": created_at(), "response": content, "done": False}
            if thought:
                out["thinking"] = thought
            if logprobs:
                out["logprobs"] = logprobs
            return out

        async with aclosing(runner_chunks(self.scheduler, job)) as raw:
            async for chunk in raw:
                text = chunk.get("content", "")
                output.append(text)
                if chunk.get("done"):
                    thought, content = thinking.finish()
                    if thought or content:
                        yield piece(content, thought)
                    final: dict[str, Any] = {"model": name, "created_at": created_at(), "response": "",
                                             "done": True, **metrics(job, chunk)}
                    if with_context:
                        final["context"] = await asyncio.to_thread(_context_tokens, job, "".join(output))
                    yield final
                    return
                thought, content = thinking.feed(text)
                if thought or content or chunk.get("logprobs"):
                    yield piece(content, thought, chunk.get("logprobs"))


def _context_tokens(job: Job, output: str) -> list[int]:
    """Token ids of prompt + output: the deprecated `context` a client sends back next time."""
    tokenizer = job.entry.view.tokenizer
    return tokenizer.encode(job.prompt) + tokenizer.encode(output, add_special=False)


def collect_generate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """stream: false for generate: response and thinking concatenated, logprobs accumulated."""
    final = dict(chunks[-1])
    final["response"] = "".join(c.get("response", "") for c in chunks)
    thinking = "".join(c.get("thinking", "") for c in chunks)
    if thinking:
        final["thinking"] = thinking
    logprobs = [lp for c in chunks for lp in c.get("logprobs") or []]
    if logprobs:
        final["logprobs"] = logprobs
    return final


def collect_chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """stream: false for chat: content and thinking concatenated, tool_calls and logprobs gathered."""
    final = dict(chunks[-1])
    messages = [c.get("message") or {} for c in chunks]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(m.get("content", "") for m in messages)}
    thinking = "".join(m.get("thinking", "") for m in messages)
    if thinking:
        message["thinking"] = thinking
    calls = [call for m in messages for call in m.get("tool_calls") or []]
    if calls:
        message["tool_calls"] = calls
    final["message"] = message
    logprobs = [lp for c in chunks for lp in c.get("logprobs") or []]
    if logprobs:
        final["logprobs"] = logprobs
    return final


def chat_routes(app: web.Application, scheduler: Scheduler, catalog: Catalog) -> ChatRoutes:
    """Register /api/chat and /api/generate on `app`."""
    routes = ChatRoutes(scheduler, catalog)
    app.router.add_post("/api/chat", routes.chat)
    app.router.add_post("/api/generate", routes.generate)
    return routes
