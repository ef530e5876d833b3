"""One completion on a scheduled runner, and how any route answers with a stream of chunks.

`runner_chunks` schedules the model, takes one of its slots and yields the runner's /completion lines,
turning every failure into an ApiError with Ollama's status. `respond_ndjson` is the native routes'
answer: NDJSON by default, one object with `stream: false`; an error before the first chunk keeps its
status, after it one `{"error": ...}` line ends the stream (reference §3.1). The OpenAI layer consumes
the same chunk iterators with its own writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ollama_engine.sample import GrammarError, format_grammar
from ollama_engine.sched import Context, Options, RunnerFailedError, Scheduler, StatusError
from ollama_engine.server.wire import encode

from .catalog import Entry
from .metrics import Metrics
from .native import DONE_REASONS, NDJSON, ApiError, json_response, schedule

log = logging.getLogger(__name__)

Chunks = AsyncIterator[dict[str, Any]]


@dataclass
class Job:
    """A prompt to complete on a model, with everything the runner request carries."""

    entry: Entry
    prompt: str
    opts: Options
    sampling: dict[str, Any]
    keep_alive: float | None
    extra: dict[str, Any] = field(default_factory=dict)  # Grammar, Logprobs, TopLogprobs, Shift, Truncate
    start: float = field(default_factory=time.monotonic)
    load_duration: float = 0.0


def completion_extra(body: Mapping[str, Any]) -> dict[str, Any]:
    """format / logprobs / top_logprobs / truncate / shift of an API request as runner request fields."""
    top = body.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20")
    extra: dict[str, Any] = {}
    try:
        grammar = format_grammar(body.get("format"))
    except GrammarError as err:
        raise ApiError(400, str(err)) from err
    if grammar:
        extra["Grammar"] = grammar
    if body.get("logprobs") or top:
        extra.update(Logprobs=True, TopLogprobs=top)
    for key, field_name in (("truncate", "Truncate"), ("shift", "Shift")):
        if body.get(key) is False:
            extra[field_name] = False
    return extra


async def runner_chunks(scheduler: Scheduler, job: Job) -> Chunks:
    """The runner's /completion lines for `job` (the last has done: true); ApiError on any failure."""
    ctx = Context()
    try:
        runner = await schedule(scheduler, ctx, job.entry.model, job.opts, job.keep_alive)
        job.load_duration = time.monotonic() - job.start
        await runner.acquire_slot()  # num_predict is capped by the runner's server (sched/llama_server.py)
        try:
            assert runner.llama is not None
            if runner.failure:
                raise ApiError(500, runner.failure)
            args = (job.prompt, job.sampling) + ((job.extra,) if job.extra else ())
            events = scheduler.events
            timer = events.completion(job.entry.name, job.start) if isinstance(events, Metrics) else None
            try:
                async for chunk in runner.llama.completion(*args):
                    if "error" in chunk:  # the runner failed part-way (a grammar in an error state)
                        raise ApiError(500, chunk["error"])
                    if timer is not None:
                        if chunk.get("done"):
                            timer.done(chunk)
                        elif chunk.get("content") or chunk.get("logprobs"):
                            timer.chunk()
                    yield chunk
                    if chunk.get("done"):
                        return
            except StatusError as err:
                raise ApiError(err.status, str(err)) from err
            except RunnerFailedError as err:
                log.warning("generation failed model=%s error=%s", job.entry.name, runner.failure or err)
                raise ApiError(500, runner.failure or str(err)) from err
            raise ApiError(500, runner.failure or "runner ended the stream without a result")
        finally:
            runner.release_slot()
    finally:
        ctx.cancel()


def metrics(job: Job, final: Mapping[str, Any]) -> dict[str, Any]:
    """done_reason and the durations (nanoseconds) of a final chunk; with speculative decoding also ours,
    llama.cpp's timings names: draft_n (tokens drafted) and draft_n_accepted."""
    out = {
        "done_reason": DONE_REASONS.get(final.get("done_reason", 0), "stop"),
        "total_duration": round((time.monotonic() - job.start) * 1e9),
        "load_duration": round(job.load_duration * 1e9),
        "prompt_eval_count": final.get("prompt_eval_count", 0),
        "prompt_eval_duration": final.get("prompt_eval_duration", 0),
        "eval_count": final.get("eval_count", 0), "eval_duration": final.get("eval_duration", 0),
    }
    if "draft_n" in final:
        out["draft_n"], out["draft_n_accepted"] = final["draft_n"], final.get("draft_n_accepted", 0)
    return out


async def collected(chunks: Chunks, collect: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
    """Every chunk made into one object by `collect` (stream: false); the iterator is closed whatever happens."""
    async with aclosing(chunks):
        return collect([chunk async for chunk in chunks])


async def first_chunk(chunks: Chunks) -> dict[str, Any]:
    """The first chunk (errors here still get their own status); ApiError if there is none."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        raise ApiError(500, "the model returned nothing") from None


async def respond_ndjson(request: web.Request, chunks: Chunks, stream: bool,
                         collect: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> web.StreamResponse:
    """Answer with `chunks`: NDJSON lines, or with stream false one object made by `collect`."""
    async with aclosing(chunks):
        try:
            first = await first_chunk(chunks)
            if not stream:
                collected = [first]
                async for chunk in chunks:
                    collected.append(chunk)
                return json_response(collect(collected))
        except ApiError as err:
            return err.response()
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        try:
            await response.write(encode(first))
            async for chunk in chunks:
                await response.write(encode(chunk))
        except ApiError as err:
            await response.write(encode({"error": str(err)}))
        except ConnectionResetError:
            log.debug("client went away during a stream")
        return response
