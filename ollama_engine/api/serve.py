"""`ollama-engine serve`: one aiohttp process with the scheduler and Ollama's HTTP API.

The app factory only wires things: each module of this package registers its own routes on the app
(`native_routes(app, scheduler, resolve)`), all on one scheduler and one model-name resolver. Shutting the app
down (SIGINT, SIGTERM) stops every runner subprocess.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ollama_engine.envconfig import EnvConfig
from ollama_engine.sched import Model, Scheduler
from ollama_engine.sched.devices import GpuDiscovery
from ollama_engine.store import Store

from .anthropic import anthropic_routes
from .catalog import Catalog
from .chat import chat_routes
from .embed import embed_routes
from .image_urls import ImageFetch
from .metrics import Metrics
from .middleware import allowed_origins, cors_middleware, error_middleware, host_middleware, remember_started
from .models_routes import model_routes
from .native import native_routes
from .openai import openai_routes
from .rerank import rerank_routes
from .responses import responses_routes
from .status import status_routes

log = logging.getLogger(__name__)

SCHEDULER = web.AppKey("scheduler", Scheduler)
CONFIG = web.AppKey("config", EnvConfig)
# The body limit of the JSON routes (request.read()/json()); POST /api/blobs streams (request.content), unlimited.
MAX_BODY = 1 << 30
READ_BUFFER = 1 << 20  # bytes of a request body buffered per connection: fewer, larger reads of an upload
SHUTDOWN_TIMEOUT = 5.0  # seconds for in-flight handlers once the runners are gone


def create_app(config: EnvConfig | None = None, scheduler: Scheduler | None = None) -> web.Application:
    """The serve application; pass a scheduler to use one built with other seams (tests)."""
    config = config or EnvConfig.from_env()
    scheduler = scheduler or Scheduler(config, get_gpu_fn=GpuDiscovery(config.rpc_servers))
    catalog = Catalog(Store(config.models), config.model_paths)

    def resolve(name: str) -> Model:
        return catalog.resolve(name).model

    metrics = Metrics(scheduler)
    scheduler.events = metrics
    middlewares = [metrics.middleware(), cors_middleware(allowed_origins(config.origins)), host_middleware(config.host),
                   error_middleware]
    app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares, handler_args={"read_bufsize": READ_BUFFER})
    app.on_response_prepare.append(remember_started)
    app[SCHEDULER] = scheduler
    app[CONFIG] = config
    native_routes(app, scheduler, resolve)
    chat = chat_routes(app, scheduler, catalog)
    embed = embed_routes(app, scheduler, catalog)
    model_routes(app, scheduler, catalog)
    rerank_routes(app, scheduler, catalog)
    openai_routes(app, chat, embed, ImageFetch() if config.image_urls else None)
    responses_routes(app, chat)
    anthropic_routes(app, chat)
    status_routes(app, scheduler, catalog, metrics, config)

    async def start(app: web.Application) -> None:
        removed = await asyncio.to_thread(catalog.store.remove_temp_files)
        if removed:
            log.info("removed %d temporary files of interrupted uploads and pulls", len(removed))
        scheduler.run()

    async def stop(app: web.Application) -> None:
        log.info("shutting down: stopping every runner")
        await scheduler.shutdown()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app


def serve(config: EnvConfig) -> None:
    """Serve until SIGINT or SIGTERM."""
    log.info("listening on %s:%d", config.host, config.port)
    web.run_app(
        create_app(config), host=config.host, port=config.port, handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT, print=None, access_log=None,
    )
