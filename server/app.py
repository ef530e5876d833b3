"""The runner's HTTP API: /info, /load, /completion, /embedding and /health, as Ollama's parent expects.

Blocking work (allocating, loading weights, tokenizing, the batch loop) runs in worker threads, so
/health answers promptly during a load. Errors are Go's http.Error: plain text ending in a newline.
A failure the process cannot recover from (weights that fail to load, an error in the batch loop)
is printed to stderr with an `error:` prefix, which Ollama's parent captures, and the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ollama_engine import envconfig
from ollama_engine.image import ImageError
from ollama_engine.ml import NoMemory, gpu_devices
from ollama_engine.ml.memory import BackendMemory, DeviceInfo
from ollama_engine.runner.allocate import LoadedModel, open_model
from ollama_engine.runner.embed import Embedding, embed, rerank, supports_embeddings, supports_rerank
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import InputTooLongError
from ollama_engine.sample import GrammarError

from . import httpd
from .direct import DirectStream
from .httpd import Request, Response, StreamResponse, text_response
from .wire import (
    CompletionRequest,
    Float32,
    LoadOperation,
    LoadRequest,
    ServerStatus,
    WireError,
    completion_done,
    completion_line,
    embedding_content,
    encode,
    health_response,
    load_response,
    rerank_pair,
)

log = logging.getLogger(__name__)

MAX_BODY = 1 << 30  # Go's server has no limit; prompts with images can be large


def json_response(value: Any) -> Response:
    return Response(body=encode(value))


def exit_on_fatal(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr, flush=True)
    os._exit(1)


class LoopInbox:
    """Hands items from the batch loop's thread to the event loop, waking the loop once per burst.

    Every step of the batch loop yields a piece for each active sequence. Waking the event loop for each
    one (call_soon_threadsafe writes to its self-pipe) cost a system call per sequence per token. Within
    `hold()` (a step's sampling) items only queue: the event loop, woken by the first piece, drained it
    while the next sequence was sampled (numpy lets go of the GIL), so a step of 4 sequences woke it ~3 times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []
        self._scheduled = False  # a drain is on its way
        self._holding = 0

    def put(self, deliver: Callable[[Any], None], item: Any) -> None:
        with self._lock:
            self._pending.append((deliver, item))
            if self._scheduled or self._holding:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def hold(self) -> LoopInbox:
        """Queue what is put meanwhile (`with inbox.hold():`); wake the event loop once, at the end, for all of it.

        The inbox is its own context manager: entered at every decode step, cheaper than a generator's."""
        return self

    def __enter__(self) -> None:
        with self._lock:
            self._holding += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._holding -= 1
            wake = not (self._holding or self._scheduled) and bool(self._pending)
            self._scheduled |= wake
        if wake:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for deliver, item in pending:
            deliver(item)


class RunnerServer:
    """One runner process: at most one model, loaded through /load, then served until the process ends."""

    def __init__(self, model_path: str | None, on_fatal: Callable[[BaseException], None] = exit_on_fatal):
        self.model_path = model_path
        self.on_fatal = on_fatal
        self.status = ServerStatus.LAUNCHED
        self.progress = 0.0
        self.load_lock = asyncio.Lock()
        self.last_load: LoadRequest | None = None
        self.loaded: LoadedModel | None = None
        self.runner: Runner | None = None
        self.ready = asyncio.Event()
        self.slots: asyncio.Semaphore | None = None
        self._commit_task: asyncio.Task | None = None
        self._inbox: LoopInbox | None = None  # made in the event loop, at the first completion

    def routes(self) -> httpd.Routes:
        return {
            ("GET", "/info"): self.info,
            ("POST", "/load"): self.load,
            ("POST", "/completion"): self.completion,
            ("POST", "/embedding"): self.embedding,
            ("POST", "/rerank"): self.rerank,
            ("GET", "/health"): self.health,
        }

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
        """Answer on host:port from the running event loop (port 0: any free one) until the server is closed."""
        return await httpd.start(self.routes(), host, port, MAX_BODY)

    # ------------------------------------------------------------ /health and /info

    async def health(self, request: Request) -> Response:
        return json_response(health_response(self.status, self.progress))

    async def info(self, request: Request) -> Response:
        try:
            infos = await asyncio.to_thread(self._gpu_infos)
        except Exception as err:
            return text_response(500, f"failed to initialize backend: {err}")
        return json_response(infos)

    def _gpu_infos(self) -> list[dict[str, Any]]:
        """The GPUs ggml sees; once a model is allocated, only those it uses (idle GPUs are left alone)."""
        used = None
        if self.loaded is not None and self.loaded.model.backend.allocate:
            used = {gpu.device_id for gpu in self.loaded.model.backend.compute_devices}
        library_path = envconfig.library_path()
        return [
            DeviceInfo(
                device_id=gpu.device_id, name=gpu.name, description=gpu.description,
                integrated=gpu.kind == "IGPU", total_memory=gpu.total_memory, free_memory=gpu.free_memory(),
                library_path=library_path,
            ).to_json()
            for gpu in gpu_devices()
            if used is None or gpu.device_id in used
        ]

    # ------------------------------------------------------------ /load

    async def load(self, request: Request) -> Response:
        async with self.load_lock:
            if self.status != ServerStatus.LAUNCHED:
                return text_response(500, "model already loaded")
            try:
                req = LoadRequest.from_json(await request.read())
            except WireError:
                return text_response(400, "bad request")
            if req.operation == LoadOperation.CLOSE:
                self._close_model()
                return json_response(load_response(False, BackendMemory()))

            reload = self.loaded is None or not req.same_layout(self.last_load)
            self.last_load = req
            if reload:
                self._close_model()
                try:
                    self.loaded = await asyncio.to_thread(self._open, req)
                except NoMemory as err:
                    log.info("insufficient memory: %s", err)
                    return json_response(load_response(False, err.memory))
                except Exception as err:
                    return text_response(500, f"failed to initialize model: {err}")

            memory = self.loaded.memory
            response = json_response(load_response(True, memory))
            if req.operation == LoadOperation.FIT:
                self._close_model()  # measuring allocates nothing worth keeping
            elif req.operation == LoadOperation.COMMIT:
                self.status = ServerStatus.LOADING_MODEL
                self._commit_task = asyncio.create_task(self._commit(self.loaded))
            return response

    def _open(self, req: LoadRequest) -> LoadedModel:
        if req.lora_path:
            raise ValueError("loras are not yet implemented")
        if not self.model_path:
            raise ValueError("no model: the runner was started without --model")
        return open_model(self.model_path, req.params(), allocate=req.operation != LoadOperation.FIT)

    def _close_model(self) -> None:
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None

    async def _commit(self, loaded: LoadedModel) -> None:
        def progress(fraction: float) -> None:
            self.progress = fraction

        try:
            await asyncio.to_thread(loaded.load, progress)
            runner = Runner(loaded, self.on_fatal)
            runner.start()
        except Exception as err:
            self.on_fatal(RuntimeError(f"failed to load model: {err}"))
            return
        self.runner = runner
        self.slots = asyncio.Semaphore(loaded.parallel)
        self.status = ServerStatus.READY
        self.ready.set()
        # Ready means weights in, as Ollama's; the tokenizer's BPE model (~0.35 s for a 128k vocabulary) is
        # built now, beside the first request, which waits for it at its first encode if it comes sooner.
        if loaded.model.tokenizer is not None:
            threading.Thread(target=loaded.model.tokenizer.prepare, name="tokenizer", daemon=True).start()

    # ------------------------------------------------------------ /completion and /embedding

    async def completion(self, request: Request) -> Response:
        try:
            req = CompletionRequest.from_json(await request.read())
        except WireError:
            return text_response(400, "Bad request")
        await self.ready.wait()
        runner, slots = self.runner, self.slots
        assert runner is not None and slots is not None
        try:
            seq = await asyncio.to_thread(runner.new_sequence, req.prompt, req.options, req.grammar, req.images)
        except (InputTooLongError, GrammarError, ImageError) as err:
            return text_response(400, str(err))
        except Exception as err:
            return text_response(500, f"Failed to create new sequence: {err}")

        await slots.acquire()
        if self._inbox is None:
            self._inbox = LoopInbox(asyncio.get_running_loop())
            runner.hold_output = self._inbox.hold
        inbox = self._inbox
        stream = DirectStream(inbox.put, seq.quit.set, slots.release)  # the slot: once the sequence has left the loop

        try:
            with runner.cond:  # the batch loop takes inputs under this lock: count the reused ones before it can
                runner.add(seq, stream.put)
                cached = seq.num_prompt_inputs - len(seq.inputs)
        except Exception as err:
            slots.release()
            return text_response(500, str(err))

        response = StreamResponse()
        try:
            await response.prepare(request)
            while (item := await stream.get()) is not None:
                if isinstance(item, bytes):  # the rest of a chunk the batch loop could not write at once
                    assert request.transport is not None
                    request.transport.write(item)  # the next response.write waits for the buffer to drain
                else:
                    await response.write(completion_line(item.text, item.logprobs))
                    stream.go_direct(request.transport)
            stream.stop()
            assert seq.done_reason is not None
            if seq.error is not None:  # no result: the stream ends without done (the parent reports the error)
                await response.write(encode({"error": seq.error}))
            else:
                done = completion_done(seq.done_reason, seq.num_prompt_inputs, seq.processing_duration,
                                       seq.num_predicted, seq.eval_duration())
                done["prompt_cached_count"] = cached  # ours: prompt tokens reused from the cache (serve's metrics)
                if seq.images.count:  # ours: the prompt's images, those the vision tower ran on (not cached), its time
                    done["image_count"], done["image_encode_count"] = seq.images.count, seq.images.encoded
                    done["image_encode_duration"] = int(seq.images.encode_seconds * 1e9)
                if seq.spec is not None:  # ours, llama.cpp's timings names: drafted and accepted tokens
                    done["draft_n"], done["draft_n_accepted"] = seq.spec.drafted, seq.spec.accepted
                await response.write(encode(done))
        except ConnectionResetError:
            log.debug("client went away during a completion")
        finally:
            stream.stop()
            seq.quit.set()  # a no-op once the sequence has ended; otherwise the loop ends it
        return response

    async def embedding(self, request: Request) -> Response:
        await self.ready.wait()
        loaded = self.loaded
        assert loaded is not None
        if not supports_embeddings(loaded.model):
            return text_response(501, "this model does not support embeddings")
        try:
            content = embedding_content(await request.read())
        except WireError as err:
            return text_response(400, f"bad request: {err}")
        return await self._pooled(lambda: embed(loaded.model, content, loaded.input_cache.num_ctx))

    async def rerank(self, request: Request) -> Response:
        """Ours (Ollama's runner has none): a reranker's scores for one query/document pair, as /embedding's
        `embedding`; the first is llama-server's relevance_score."""
        await self.ready.wait()
        loaded = self.loaded
        assert loaded is not None
        if not supports_rerank(loaded.model):
            return text_response(501, "this model does not support reranking")
        try:
            query, document = rerank_pair(await request.read())
        except WireError as err:
            return text_response(400, f"bad request: {err}")
        return await self._pooled(lambda: rerank(loaded.model, query, document, loaded.input_cache.num_ctx))

    async def _pooled(self, compute: Callable[[], Embedding]) -> Response:
        """One pooled forward pass in a slot: {"embedding": [...], "prompt_eval_count": n}.

        It runs on the batch loop's compute thread, which keeps its OpenMP pool between computes: on another
        thread it would run on a thread of its own, started for it and ended after it (ml/compute_threads.py)."""
        assert self.slots is not None and self.runner is not None
        async with self.slots:
            try:
                result = await asyncio.wrap_future(self.runner.submit_compute(compute))
            except InputTooLongError as err:
                return text_response(400, str(err))
            except Exception as err:
                return text_response(500, f"Failed to create new sequence: {err}")
        return json_response({
            "embedding": [Float32(x) for x in result.vector.tolist()], "prompt_eval_count": result.prompt_eval_count,
        })

def serve(model_path: str | None, host: str, port: int) -> None:
    """Run the runner's HTTP server until the process is stopped."""
    log.info("starting ollama engine")
    server = RunnerServer(model_path)
    httpd.run(server.routes(), host, port, MAX_BODY)
