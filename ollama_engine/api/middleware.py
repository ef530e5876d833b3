"""What serve does to every request before its route, as Ollama's gin middleware does (server/routes.go at f63eea3d).

- CORS (gin-contrib/cors 1.7.2 configured as Ollama configures it): a request from a browser page whose Origin
  is not allowed gets 403; an allowed one gets Access-Control-Allow-Origin, and its preflight (OPTIONS) 204
  with the allowed methods and headers. Allowed: OLLAMA_ORIGINS, then http(s)://localhost, 127.0.0.1 and
  0.0.0.0 with any port, app://, file://, tauri://, vscode-webview:// and vscode-file://.
- The host check (allowedHostsMiddleware): a server listening on loopback answers 403 to a Host header that
  is not a loopback, private or local address, localhost, this machine's name, or *.localhost / *.local /
  *.internal. A web page on another site cannot reach it by pointing its own DNS name at 127.0.0.1.
- Errors: 404 and 405 with gin's texts; a body over the limit is a JSON 413; an unexpected exception is
  logged with its traceback and answered `{"error": ...}` 500, never a traceback; once a stream has started,
  as one `{"error": ...}` line that ends it (never a second HTTP response inside the chunked body).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from ollama_engine.server.wire import encode

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
DEFAULT_ORIGIN_SCHEMES = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
ALLOW_METHODS = "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
ALLOW_HEADERS = ",".join([
    "Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With",
    # OpenAI compatibility headers, canonicalized as Go's http.CanonicalHeaderKey writes them
    "Openai-Beta", "X-Stainless-Arch", "X-Stainless-Async", "X-Stainless-Custom-Poll-Interval",
    "X-Stainless-Helper-Method", "X-Stainless-Lang", "X-Stainless-Os", "X-Stainless-Package-Version",
    "X-Stainless-Poll-Helper", "X-Stainless-Retry-Count", "X-Stainless-Runtime", "X-Stainless-Runtime-Version",
    "X-Stainless-Timeout",
])
MAX_AGE = str(12 * 3600)
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


def allowed_origins(extra: Sequence[str] = ()) -> list[str]:
    """Ollama's envconfig.AllowedOrigins: OLLAMA_ORIGINS first, then the defaults."""
    origins = list(extra)
    for host in DEFAULT_ORIGIN_HOSTS:
        origins += [f"http://{host}", f"https://{host}", f"http://{host}:*", f"https://{host}:*"]
    return origins + list(DEFAULT_ORIGIN_SCHEMES)


class Origins:
    """gin-contrib/cors' matching: exact origins (trimmed, lower-cased), or patterns with one `*`."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.allow_all = "*" in origins
        self.exact = {o.strip().lower() for o in origins if "*" not in o}
        self.patterns = []
        for origin in origins:
            if origin.count("*") > 1:
                raise ValueError(f"OLLAMA_ORIGINS: only one * is allowed in {origin!r}")
            if "*" in origin and origin != "*":
                prefix, _, suffix = origin.partition("*")
                self.patterns.append((prefix, suffix))

    def allows(self, origin: str) -> bool:
        if self.allow_all or origin in self.exact:
            return True
        return any(origin.startswith(prefix) and origin.endswith(suffix) for prefix, suffix in self.patterns)


def cors_middleware(origins: Sequence[str]) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    allowed = Origins(origins)

    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin", "")
        host = request.headers.get("Host", "")
        if not origin or origin in (f"http://{host}", f"https://{host}"):
            return await handler(request)  # not a cross-origin request
        if not allowed.allows(origin):
            return web.Response(status=403)
        allow_origin = {"Access-Control-Allow-Origin": "*" if allowed.allow_all else origin}
        if request.method == "OPTIONS":
            headers = {"Access-Control-Allow-Methods": ALLOW_METHODS, "Access-Control-Allow-Headers": ALLOW_HEADERS,
                       "Access-Control-Max-Age": MAX_AGE, **allow_origin}
            response = web.Response(status=204, headers=headers)
            if not allowed.allow_all:
                for vary in ("Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers"):
                    response.headers.add("Vary", vary)
            return response
        extra = allow_origin if allowed.allow_all else {"Vary": "Origin", **allow_origin}
        try:
            response = await handler(request)
        except web.HTTPException as err:
            err.headers.update(extra)
            raise
        if not response.prepared:
            response.headers.update(extra)
        return response

    return cors


@functools.lru_cache(maxsize=1)
def _local_addresses() -> frozenset[str]:
    """The addresses this machine's name resolves to (Go's isLocalIP walks the interfaces)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return frozenset()
    return frozenset(info[4][0] for info in infos)


def allowed_host(host: str) -> bool:
    """Ollama's allowedHost plus the address checks of allowedHostsMiddleware."""
    host = host.lower()
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is not None:
        return address.is_loopback or address.is_private or address.is_unspecified or str(address) in _local_addresses()
    if host in ("", "localhost") or host == socket.gethostname().lower():
        return True
    return host.endswith(LOCAL_SUFFIXES)


def _split_host(value: str) -> str:
    """Go's net.SplitHostPort host part, or the whole value when it has no port."""
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    host, sep, port = value.rpartition(":")
    return host if sep and ":" not in host and port.isdigit() else value


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def listens_on_loopback(bind_host: str) -> bool:
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_middleware(bind_host: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    loopback = listens_on_loopback(bind_host)

    @web.middleware
    async def hosts(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not loopback:
            return await handler(request)
        host = _split_host(request.headers.get("Host", ""))
        if not allowed_host(host):
            return web.Response(status=403)
        if request.method == "OPTIONS" and not _is_address(host):
            return web.Response(status=204)
        return await handler(request)

    return hosts


# The request's key for the response a handler has started (a typed key where aiohttp has them, 3.12+).
STARTED_RESPONSE: Any = (web.RequestKey("started_response", web.StreamResponse) if hasattr(web, "RequestKey")
                         else "ollama_engine.started_response")


async def remember_started(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: note the response whose headers are going out, so that an error after that point
    ends this response instead of starting a second one inside its body."""
    request[STARTED_RESPONSE] = response


async def end_stream_with_error(response: web.StreamResponse, message: str) -> web.StreamResponse:
    """An error once a stream has started: Ollama's `{"error": ...}` line (a `data:` event on an SSE stream),
    then the end of the response (aiohttp writes the last chunk when the handler returns it)."""
    if response.content_type == "text/event-stream":
        line = b"data: " + encode({"error": {"message": message, "type": "api_error", "param": None,
                                             "code": None}}).rstrip(b"\n") + b"\n\n"
    else:
        line = encode({"error": message})
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client is gone, or the stream already ended
        await response.write(line)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(status=404, text="404 page not found")
    except web.HTTPMethodNotAllowed:
        return web.Response(status=405, text="405 method not allowed")
    except web.HTTPRequestEntityTooLarge as err:
        return web.json_response({"error": f"request body too large: {err.text}"}, status=413)
    except (web.HTTPException, ConnectionResetError):
        raise
    except Exception as err:  # a bug: log it whole, answer without the traceback
        log.exception("%s %s failed", request.method, request.path)
        message = f"internal error: {type(err).__name__}: {err}"
        started = request.get(STARTED_RESPONSE)
        if started is not None and started.prepared:  # a second response now would be bytes inside the body
            return await end_stream_with_error(started, message)
        return web.json_response({"error": message}, status=500)
