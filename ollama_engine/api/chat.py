"""POST /api/chat and POST /api/generate (reference §3.2): prompt rendering, streaming, thinking, tools.

Each route checks the request the way Ollama does (and in its order, so the same bad request gets the
same error), renders the prompt (prompt.py), runs it (completion.py) and shapes the runner's lines into
Ollama's chunks. `chat_chunks` / `generate_chunks` are also what the OpenAI layer translates.
"""

from __future__ import annotations

import asyncio
import secrets
import string
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ollama_engine.sched import Context, Options, Scheduler
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
    tag_images,
    think_value,
)

_ID_CHARS = string.ascii_lowercase + string.digits


def tool_call_id() -> str:
    """call_ and 8 characters of [a-z0-9], as Ollama makes them."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(8))


@dataclass
class Prepared:
    """A checked chat or generate request: what to run, and what shaping its chunks needs."""

    entry: Entry
    job: Job | None  # None: empty messages / prompt, which only load or unload the model
    opts: Options
    keep_alive: float | None
    think: bool | None
    tools: list[dict[str, Any]] | None = None
    raw: bool = False  # generate's raw mode: no `context` in the final chunk


@dataclass
class Piece:
    """One step of the runner's output split for the API: thinking, content and tool calls apart."""

    content: str = ""
    thinking: str = ""
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    final: Mapping[str, Any] | None = None  # the runner's done line; set on the last piece alone


async def pieces(job: Job, think: bool | None, tools: Sequence[Mapping[str, Any]] | None,
                 source: Chunks) -> AsyncIterator[Piece]:
    """The runner's lines as Pieces: what chat and generate both shape into their own chunks."""
    thinking = ThinkingSplitter(bool(think) and "thinking" in job.entry.capabilities)
    calls = ToolCallStream(tools) if tools else None
    async with aclosing(source) as raw:
        async for chunk in raw:
            if chunk.get("done"):
                thought, content = thinking.finish()
                found: list[dict[str, Any]] = []
                if calls is not None:
                    content = calls.feed(content) if content else ""
                    rest, found = calls.finish()
                    content += rest
                if thought or content or found:
                    yield Piece(content, thought, tool_calls=found)
                yield Piece(final=chunk)
                return
            thought, content = thinking.feed(chunk.get("content", ""))
            if calls is not None and content:
                content = calls.feed(content)
            if thought or content or chunk.get("logprobs"):
                yield Piece(content, thought, chunk.get("logprobs"))


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

    async def prepare_chat(self, body: Mapping[str, Any]) -> Prepared:
        """Validate a chat request and render its prompt."""
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
        messages, images = await asyncio.to_thread(tag_images, messages)
        if images:
            extra["Images"] = images
        prepared = Prepared(entry, None, opts, keep_alive, think, tools)
        if messages:
            prompt = await off_loop(lambda: render_chat(entry, chat_messages(entry, messages), tools, think, level))
            prepared.job = Job(entry, prompt, opts, sampling, keep_alive, extra)
        return prepared

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prepared = await self.prepare_chat(body)
            if prepared.job is None:
                reason = await self._load_or_unload(prepared.entry, prepared.keep_alive, prepared.opts)
                return json_response({"model": prepared.entry.requested, "created_at": created_at(),
                                      "message": {"role": "assistant", "content": ""}, "done": True,
                                      "done_reason": reason})
        except ApiError as err:
            return err.response()
        chunks = self.chat_chunks(prepared.job, prepared.tools, prepared.think)
        return await respond_ndjson(request, chunks, body.get("stream") is not False, collect_chat)

    async def chat_chunks(self, job: Job, tools: Sequence[Mapping[str, Any]] | None, think: bool | None,
                          source: Chunks | None = None) -> Chunks:
        """Ollama's chat chunks: message pieces (content, thinking, tool_calls), then the final one.
        `source`: the runner's lines (default: run `job`; tests replay recorded lines)."""
        name = job.entry.requested
        async with aclosing(pieces(job, think, tools, source or runner_chunks(self.scheduler, job))) as steps:
            async for piece in steps:
                message: dict[str, Any] = {"role": "assistant", "content": piece.content}
                if piece.final is not None:
                    yield {"model": name, "created_at": created_at(), "message": message, "done": True,
                           **metrics(job, piece.final)}
                    return
                if piece.thinking:
                    message["thinking"] = piece.thinking
                if piece.tool_calls:
                    message["tool_calls"] = [{"id": tool_call_id(), **call} for call in piece.tool_calls]
                yield with_logprobs({"model": name, "created_at": created_at(), "message": message, "done": False},
                                    piece)

    # ------------------------------------------------------------ /api/generate

    async def prepare_generate(self, body: Mapping[str, Any]) -> Prepared:
        """Validate a generate request and render its prompt."""
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
        if body.get("images"):  # tagged as the user message's images, unless the prompt is raw (it has its tags)
            tagged, extra["Images"] = await asyncio.to_thread(
                tag_images, [{"content": prompt, "images": body["images"]}], not body.get("raw"))
            body = {**body, "prompt": tagged[0]["content"]}
        prepared = Prepared(entry, None, opts, keep_alive, think, raw=bool(body.get("raw")))
        if not prompt and not body.get("suffix"):
            return prepared
        if prepared.raw:  # as given (its images numbered): nothing to render, no hop to the template thread
            text = body.get("prompt") or ""
        else:
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
        prepared.job = Job(entry, text, opts, sampling, keep_alive, extra)
        return prepared

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prepared = await self.prepare_generate(body)
            if prepared.job is None:
                reason = await self._load_or_unload(prepared.entry, prepared.keep_alive, prepared.opts)
                return json_response({"model": prepared.entry.requested, "created_at": created_at(),
                                      "response": "", "done": True, "done_reason": reason})
        except ApiError as err:
            return err.response()
        chunks = self.generate_chunks(prepared.job, prepared.think, with_context=not prepared.raw)
        return await respond_ndjson(request, chunks, body.get("stream") is not False, collect_generate)

    async def generate_chunks(self, job: Job, think: bool | None, with_context: bool = False,
                              source: Chunks | None = None) -> Chunks:
        """Ollama's generate chunks: response pieces (and thinking), then the final one, with `context` (the
        prompt's and the output's tokens) when asked. `source`: the runner's lines (default: run `job`)."""
        name = job.entry.requested
        output: list[str] = []

        async def recorded(lines: Chunks) -> Chunks:
            async with aclosing(lines):
                async for line in lines:
                    output.append(line.get("content", ""))
                    yield line

        lines = recorded(source or runner_chunks(self.scheduler, job))
        async with aclosing(pieces(job, think, None, lines)) as steps:
            async for piece in steps:
                out: dict[str, Any] = {"model": name, "created_at": created_at(), "response": piece.content}
                if piece.final is not None:
                    out.update(done=True, **metrics(job, piece.final))
                    if with_context:
                        out["context"] = await asyncio.to_thread(_context_tokens, job, "".join(output))
                    yield out
                    return
                out["done"] = False
                if piece.thinking:
                    out["thinking"] = piece.thinking
                yield with_logprobs(out, piece)


def with_logprobs(chunk: dict[str, Any], piece: Piece) -> dict[str, Any]:
    """`chunk` with the piece's logprobs, when it has any (Ollama leaves the key out otherwise)."""
    if piece.logprobs:
        chunk["logprobs"] = piece.logprobs
    return chunk


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
