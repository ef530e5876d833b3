"""POST /api/embed and the legacy POST /api/embeddings, through the runner's /embedding.

/api/embed L2-normalises every vector (and cuts it to `dimensions`, normalising again); inputs are
embedded concurrently and keep their order. /api/embeddings returns the runner's vector as it is.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from ollama_engine.sched import Context, Options, RunnerFailedError, RunnerRef, Scheduler, StatusError

from .catalog import Catalog, Entry, ModelNotFoundError
from .native import ApiError, json_response, parse_keep_alive, read_json, schedule
from .prompt import request_options

TOO_LONG = "the input length exceeds the context length"


async def pooled_call(runner: RunnerRef, call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """A pooling runner's answer (/embedding, /rerank) to `call()`, made on one of its slots; its failures as
    ApiErrors with Ollama's statuses (an input over the context is a 400 with Ollama's words)."""
    await runner.acquire_slot()
    try:
        return await call()
    except StatusError as err:
        if err.status == 400 and "too long" in str(err).lower():
            raise ApiError(400, TOO_LONG) from err
        raise ApiError(400 if err.status < 500 or err.status == 501 else err.status, str(err)) from err
    except RunnerFailedError as err:
        raise ApiError(500, runner.failure or str(err)) from err
    finally:
        runner.release_slot()


def normalize(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def parse_dimensions(value: Any) -> int:
    """`dimensions` of an embed request: absent, null or 0 keep the model's size; otherwise a positive int."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, f"dimensions must be a positive integer, got {value!r}")
    return value


def normalized(vectors: list[list[float]], dimensions: int) -> list[list[float]]:
    """L2-normalised vectors, cut to `dimensions` first-features and normalised again (Ollama's rule); a
    size above the model's is a 400 rather than a silently longer-than-asked answer."""
    out = [normalize(v) for v in vectors]
    size = min((len(v) for v in out), default=0)
    if dimensions > size and out:
        raise ApiError(400, f"dimensions {dimensions} exceeds the model's embedding size {size}")
    if 0 < dimensions < size:
        out = [normalize(v[:dimensions]) for v in out]
    return out


class EmbedRoutes:
    def __init__(self, scheduler: Scheduler, catalog: Catalog) -> None:
        self.scheduler = scheduler
        self.catalog = catalog

    def entry(self, name: Any, not_found: str) -> Entry:
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        try:
            return self.catalog.resolve(name)
        except ModelNotFoundError as err:
            raise ApiError(404, not_found.format(name=name)) from err

    async def _embed_one(self, runner: RunnerRef, text: str) -> dict[str, Any]:
        assert runner.llama is not None
        return await pooled_call(runner, lambda: runner.llama.embedding(text))  # type: ignore[union-attr]

    async def embed_texts(self, entry: Entry, texts: list[str], opts: Options, keep_alive: float | None,
                          truncate: bool = True) -> tuple[list[list[float]], int, float]:
        """(raw vectors, prompt tokens, load seconds) for `texts`, on one scheduled runner."""
        if entry.view.reranker:  # its pooled output is a relevance score, not an embedding
            raise ApiError(400, f'"{entry.requested or entry.name}" is a reranker, not an embedding model: '
                                f'use /api/rerank or /v1/rerank')
        ctx = Context()
        start = time.monotonic()
        try:
            runner = await schedule(self.scheduler, ctx, entry.model, opts, keep_alive)
            load = time.monotonic() - start
            if not texts:
                return [], 0, load
            if not truncate:
                tokenizer = await asyncio.to_thread(lambda: entry.view.tokenizer)
                num_ctx = runner.options.num_ctx if runner.options is not None and runner.options.num_ctx else 0
                if num_ctx and any(len(tokenizer.encode(t)) > num_ctx for t in texts):
                    raise ApiError(400, TOO_LONG)
            results = await asyncio.gather(*(self._embed_one(runner, t) for t in texts))
        finally:
            ctx.cancel()
        vectors = [list(r.get("embedding") or []) for r in results]
        for v in vectors:
            if any(math.isnan(x) or math.isinf(x) for x in v):
                raise ApiError(400, "embedding contains NaN or Inf values")
        return vectors, sum(int(r.get("prompt_eval_count", 0)) for r in results), load

    async def embed(self, request: web.Request) -> web.Response:
        start = time.monotonic()
        try:
            body = await read_json(request)
            entry = self.entry(body.get("model"), "model '{name}' not found")
            raw = body.get("input")
            if raw is None or raw == "":
                texts: list[str] = []
            elif isinstance(raw, str):
                texts = [raw]
            elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
                texts = list(raw)
            else:
                raise ApiError(400, "invalid input type")
            dimensions = parse_dimensions(body.get("dimensions"))
            keep_alive = parse_keep_alive(body.get("keep_alive"))
            opts, _ = request_options(entry, body.get("options"))
            vectors, count, load = await self.embed_texts(entry, texts, opts, keep_alive,
                                                          body.get("truncate") is not False)
            if not texts:
                return json_response({"model": entry.name, "embeddings": []})
            return json_response({
                "model": entry.name, "embeddings": normalized(vectors, dimensions),
                "total_duration": round((time.monotonic() - start) * 1e9),
                "load_duration": round(load * 1e9), "prompt_eval_count": count,
            })
        except ApiError as err:
            return err.response()

    async def embeddings(self, request: web.Request) -> web.Response:
        """The legacy route: one prompt, the vector not normalised, `{"embedding": [...]}`."""
        try:
            body = await read_json(request)
            entry = self.entry(body.get("model"), 'model "{name}" not found, try pulling it first')
            prompt = body.get("prompt") or ""
            if not isinstance(prompt, str):
                raise ApiError(400, "json: cannot unmarshal prompt into Go struct field of type string")
            opts, _ = request_options(entry, body.get("options"))
            keep_alive = parse_keep_alive(body.get("keep_alive"))
            vectors, _, _ = await self.embed_texts(entry, [prompt] if prompt else [], opts, keep_alive)
            return json_response({"embedding": vectors[0] if vectors else []})
        except ApiError as err:
            if err.status not in (400, 404, 503):
                err.status = 500
            return err.response()


def embed_routes(app: web.Application, scheduler: Scheduler, catalog: Catalog) -> EmbedRoutes:
    routes = EmbedRoutes(scheduler, catalog)
    app.router.add_post("/api/embed", routes.embed)
    app.router.add_post("/api/embeddings", routes.embeddings)
    return routes
