"""The store's routes (reference §3.2): /api/tags, /api/show, /api/create, /api/blobs/:digest, /api/copy,
/api/delete and /api/pull. The store does the work (ollama_engine.store); these map it to HTTP.

Store operations touch the disk (hashing a 100 MB GGUF), so they run in worker threads; create's progress
lines are handed back to the event loop as they happen. Deleting a model also unloads it (pain point 8).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import StreamReader, web

from ollama_engine.sched import Scheduler
from ollama_engine.store import ModelNotFound, Store, StoreError, check_digest

from .catalog import Catalog, ModelNotFoundError
from .completion import respond_ndjson
from .native import ApiError, json_response, read_json
from .pull import pull_model

log = logging.getLogger(__name__)

UPLOAD_CHUNK = 1 << 20  # bytes handed to the writer thread at a time


def store_error(err: StoreError) -> ApiError:
    return ApiError(getattr(err, "status", 500), str(err))


async def in_thread_with_progress(work: Callable[[Callable[[dict[str, Any]], None]], Any]) -> AsyncIterator[Any]:
    """Run `work(report)` in a thread; yield each reported dict as it comes, then the result (last)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def report(status: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("status", status))

    def run() -> None:
        try:
            result = work(report)
        except BaseException as err:  # handed to the event loop, re-raised there
            loop.call_soon_threadsafe(queue.put_nowait, ("error", err))
        else:
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))

    task = loop.run_in_executor(None, run)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "status":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        await task


async def receive_blob(content: StreamReader, store: Store, expected: str) -> bool:
    """Write an upload into the store as it arrives: the event loop gathers the next MiB of the body (as the
    pieces it received, not copied) while a worker thread hashes and writes the previous one (memory: about two
    MiB). True if the blob was created, False if it was already there. The temp file is removed on any failure, a
    client that goes away included (the handler is cancelled); a write that fails (a full disk) reads the rest of
    the body away so that the client gets the error rather than a broken pipe."""
    loop = asyncio.get_running_loop()
    writer = store.blob_writer(expected)
    pending: asyncio.Future[None] | None = None
    batch: list[bytes] = []
    size = 0
    try:
        async for data in content.iter_any():
            batch.append(data)
            size += len(data)
            if size >= UPLOAD_CHUNK:
                if pending is not None:
                    await pending
                pending, batch, size = loop.run_in_executor(None, writer.write_all, batch), [], 0
        if pending is not None:
            await pending
        await loop.run_in_executor(None, writer.write_all, batch)
        _, created = await loop.run_in_executor(None, writer.commit, store.blob_path)
        return created
    except ConnectionError:  # the client went away (not the disk)
        raise
    except OSError as err:
        writer.abort()
        async for _ in content.iter_any():
            pass
        raise StoreError(f"write blob {expected}: {err.strerror or err}") from err
    finally:
        writer.abort()


def collect_status(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """stream: false for create and pull: the last status alone."""
    return chunks[-1]


class ModelRoutes:
    def __init__(self, scheduler: Scheduler, catalog: Catalog) -> None:
        self.scheduler = scheduler
        self.catalog = catalog

    @property
    def store(self) -> Store:
        return self.catalog.store

    async def tags(self, request: web.Request) -> web.Response:
        models = await asyncio.to_thread(self.store.list_models)
        for model in models:
            try:
                model["capabilities"] = self.catalog.resolve(model["model"]).capabilities
            except (ModelNotFoundError, OSError, ValueError) as err:
                log.warning("cannot read model %s: %s", model["model"], err)
        return json_response({"models": models})

    async def show(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            name = body.get("model") or body.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, "model is required")
            try:
                shown = await asyncio.to_thread(self.store.show, name, verbose=bool(body.get("verbose")),
                                                system=body.get("system"))
                entry = self.catalog.resolve(name)
            except StoreError as err:
                raise store_error(err) from err
            except ModelNotFoundError as err:
                raise ApiError(404, f"model '{name}' not found") from err
            shown["template"] = entry.template_text
            shown["capabilities"] = entry.capabilities
            return json_response(shown)
        except ApiError as err:
            return err.response()

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
        except ApiError as err:
            return err.response()
        name = body.get("model") or body.get("name") or ""

        def work(report: Callable[[dict[str, Any]], None]) -> None:
            self.store.create(
                name, files=body.get("files"), adapters=body.get("adapters"), from_=body.get("from"),
                template=body.get("template"), system=body.get("system"), license=body.get("license"),
                parameters=body.get("parameters"), messages=body.get("messages"), progress=report,
                drafts=body.get("draft_files"))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            if body.get("quantize"):
                raise ApiError(400, "this engine cannot quantize models yet")
            if body.get("draft_quantize"):
                raise ApiError(400, "this engine cannot quantize models yet (draft_quantize)")
            try:
                async for status in in_thread_with_progress(work):
                    yield status
            except StoreError as err:
                raise store_error(err) from err
            except (TypeError, ValueError, AttributeError) as err:
                raise ApiError(400, str(err)) from err
            except OSError as err:  # a full disk: the OS's words, not the server's paths
                raise ApiError(500, f"write to the model store: {err.strerror or err}") from err
            yield {"status": "success"}

        response = await respond_ndjson(request, chunks(), body.get("stream") is not False, collect_status)
        if body.get("stream") is False and response.status == 200:
            response.content_type = "application/json"
            response.charset = None
        return response

    async def blob_head(self, request: web.Request) -> web.Response:
        digest = request.match_info["digest"]
        try:
            if self.store.has_blob(digest):
                return web.Response(status=200)
            return ApiError(404, f'blob "{check_digest(digest)}" not found').response()
        except StoreError as err:
            return store_error(err).response()

    async def blob_post(self, request: web.Request) -> web.Response:
        """Stream the body into a temp file in the store while hashing it; no size limit but the disk."""
        digest = request.match_info["digest"]
        try:
            expected = check_digest(digest)
            if self.store.has_blob(expected):
                return web.Response(status=200)
            created = await receive_blob(request.content, self.store, expected)
            return web.Response(status=201 if created else 200)
        except StoreError as err:
            return store_error(err).response()

    async def copy(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            await asyncio.to_thread(self.store.copy, str(body.get("source") or ""),
                                    str(body.get("destination") or ""))
            return web.Response(status=200)
        except StoreError as err:
            return store_error(err).response()
        except ApiError as err:
            return err.response()

    async def delete(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            name = str(body.get("model") or body.get("name") or "")
            try:
                entry = self.catalog.resolve(name)
            except ModelNotFoundError:
                entry = None
            await asyncio.to_thread(self.store.delete, name)
            if entry is not None and self.scheduler.expire_runner(entry.model, force=False):
                log.info("deleted model %s: unloading it", entry.name)
            return web.Response(status=200)
        except ModelNotFound:
            return ApiError(404, f"model '{name}' not found").response()
        except StoreError as err:
            return store_error(err).response()
        except ApiError as err:
            return err.response()

    async def pull(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
        except ApiError as err:
            return err.response()
        name = str(body.get("model") or body.get("name") or "")
        chunks = pull_model(self.store, name, insecure=bool(body.get("insecure")))
        response = await respond_ndjson(request, chunks, body.get("stream") is not False, collect_status)
        if body.get("stream") is False and response.status == 200:
            response.content_type = "application/json"
            response.charset = None
        return response


def model_routes(app: web.Application, scheduler: Scheduler, catalog: Catalog) -> ModelRoutes:
    routes = ModelRoutes(scheduler, catalog)
    app.router.add_get("/api/tags", routes.tags)
    app.router.add_post("/api/show", routes.show)
    app.router.add_post("/api/create", routes.create)
    app.router.add_head("/api/blobs/{digest}", routes.blob_head)
    app.router.add_post("/api/blobs/{digest}", routes.blob_post)
    app.router.add_post("/api/copy", routes.copy)
    app.router.add_delete("/api/delete", routes.delete)
    app.router.add_post("/api/pull", routes.pull)
    return routes
