"""POST /api/rerank and POST /v1/rerank: a reranker scores every document against the query (ours: Ollama
has no rerank route; llama-server's /v1/rerank and Jina's and Cohere's APIs have this shape).

Each (query, document) pair is one forward pass of the reranker in the runner (its /rerank route, tokenized
as llama-server does); the pairs run concurrently on one scheduled runner. A result's relevance_score is the
classifier's first output, unnormalised, as llama-server reports it; results are sorted by it, highest first
(ties keep the documents' order), and cut to top_n. Errors are Ollama's {"error": ...} on /api/rerank and
OpenAI's on /v1/rerank.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ollama_engine.sched import Context, RunnerRef, Scheduler

from .catalog import Catalog, Entry, ModelNotFoundError
from .embed import pooled_call
from .native import ApiError, json_response, parse_keep_alive, read_json, schedule
from .openai import openai_error
from .prompt import request_options

MAX_DOCUMENTS = 1000  # one request's work stays bounded (Cohere's limit too); each document is a forward pass


@dataclass(frozen=True)
class RerankRequest:
    entry: Entry
    query: str
    documents: list[str]
    top_n: int
    return_documents: bool


def parse_top_n(value: Any, n_documents: int) -> int:
    """`top_n`: absent or null is every document; a positive integer, cut to the number of documents (as
    llama-server, Jina and Cohere do)."""
    if value is None:
        return n_documents
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"top_n must be a positive integer, got {value!r}")
    return min(value, n_documents)


def parse_documents(value: Any) -> list[str]:
    if value is None:
        raise ApiError(400, "documents is required")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "documents must be a non-empty array of strings")
    for i, document in enumerate(value):
        if not isinstance(document, str):
            raise ApiError(400, f"documents[{i}] must be a string, got {type(document).__name__}")
    if len(value) > MAX_DOCUMENTS:
        raise ApiError(400, f"at most {MAX_DOCUMENTS} documents per request, got {len(value)}")
    return list(value)


def ranked(scores: list[float], documents: list[str], top_n: int, return_documents: bool) -> list[dict[str, Any]]:
    """The results, highest score first (stable: equal scores keep the documents' order), top_n of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}  # Jina's and Cohere's shape
        results.append(result)
    return results


class RerankRoutes:
    def __init__(self, scheduler: Scheduler, catalog: Catalog) -> None:
        self.scheduler = scheduler
        self.catalog = catalog

    def parse(self, body: dict[str, Any]) -> RerankRequest:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        try:
            entry = self.catalog.resolve(name)
        except ModelNotFoundError as err:
            raise ApiError(404, f"model '{name}' not found") from err
        if "rerank" not in entry.capabilities:
            raise ApiError(400, f'"{name}" does not support rerank: it is not a reranker (a classifier with '
                                f'pooling type rank)')
        query = body.get("query")
        if query is None:
            raise ApiError(400, "query is required")
        if not isinstance(query, str):
            raise ApiError(400, f"query must be a string, got {type(query).__name__}")
        documents = parse_documents(body.get("documents"))
        return_documents = body.get("return_documents", False)
        if not isinstance(return_documents, bool):
            raise ApiError(400, f"return_documents must be a boolean, got {return_documents!r}")
        return RerankRequest(entry, query, documents, parse_top_n(body.get("top_n"), len(documents)),
                             return_documents)

    async def _score(self, runner: RunnerRef, query: str, document: str) -> tuple[float, int]:
        """(relevance score, tokens evaluated) of one pair."""
        assert runner.llama is not None
        result = await pooled_call(runner, lambda: runner.llama.rerank(query, document))  # type: ignore[union-attr]
        scores = result.get("embedding") or []
        if not scores or math.isnan(scores[0]) or math.isinf(scores[0]):
            raise ApiError(500, f"the reranker returned no finite score: {scores!r}")
        return float(scores[0]), int(result.get("prompt_eval_count", 0))

    async def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        start = time.monotonic()
        request = self.parse(body)
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        opts, _ = request_options(request.entry, body.get("options"))
        ctx = Context()
        try:
            runner = await schedule(self.scheduler, ctx, request.entry.model, opts, keep_alive)
            load = time.monotonic() - start
            pairs = await asyncio.gather(*(self._score(runner, request.query, d) for d in request.documents))
        finally:
            ctx.cancel()
        tokens = sum(n for _, n in pairs)
        return {
            "model": request.entry.requested or request.entry.name, "object": "list",  # as the request spelled it
            "results": ranked([s for s, _ in pairs], request.documents, request.top_n, request.return_documents),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "total_duration": round((time.monotonic() - start) * 1e9), "load_duration": round(load * 1e9),
        }

    async def native(self, request: web.Request) -> web.Response:
        try:
            return json_response(await self.rerank(await read_json(request)))
        except ApiError as err:
            return err.response()

    async def openai(self, request: web.Request) -> web.Response:
        try:
            return json_response(await self.rerank(await read_json(request)))
        except ApiError as err:
            return openai_error(err)


def rerank_routes(app: web.Application, scheduler: Scheduler, catalog: Catalog) -> RerankRoutes:
    routes = RerankRoutes(scheduler, catalog)
    app.router.add_post("/api/rerank", routes.native)
    app.router.add_post("/v1/rerank", routes.openai)
    return routes
