"""The runner's HTTP/1.1 server: what Ollama's runner protocol needs, on asyncio alone.

Why not aiohttp: a runner starts at every model load, and `import aiohttp.web` (which pulls in aiohttp's
client, its connectors and their SSL contexts) was 0.3-0.6 s of the runner's imports, a third of its time to
ready on a small model. The protocol needs little: GET and POST on a few fixed paths, request bodies of a known
length (or chunked), JSON answers, one chunked stream per completion, keep-alive for the parent's connections,
and a handler cancelled when its client goes away (a completion then ends its sequence).

Answers follow Go's net/http, which Ollama's runner uses: `404 page not found`, `405 Method Not Allowed` with
Allow, plain-text errors ending in a newline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # request line and headers
IDLE_TIMEOUT = 75.0  # seconds a connection may sit silent between or inside requests (aiohttp's keep-alive)


class Request:
    """One request, its body read in full (up to the server's limit)."""

    def __init__(self, method: str, path: str, version: str, headers: dict[str, str], body: bytes,
                 connection: Connection):
        self.method, self.path, self.version, self.headers, self.body = method, path, version, headers, body
        self.connection = connection

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.connection.transport

    async def read(self) -> bytes:
        return self.body

    @property
    def keep_alive(self) -> bool:
        value = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return value == "keep-alive"
        return value != "close"


class Response:
    """A whole answer: status, body, content type (JSON unless said) and extra headers."""

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str = "application/json",
                 headers: dict[str, str] | None = None):
        self.status, self.body, self.content_type = status, body, content_type
        self.headers = headers or {}

    def head(self, length: int | None, close: bool = False) -> bytes:
        """The status line and headers; `close`: the connection closes after this answer (the client is told)."""
        lines = [f"HTTP/1.1 {self.status} {reason(self.status)}", f"Content-Type: {self.content_type}"]
        lines += [f"{name}: {value}" for name, value in self.headers.items()]
        if close:
            lines.append("Connection: close")
        lines.append(f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S GMT', time.gmtime())}")
        lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class StreamResponse(Response):
    """A chunked answer written as it is made: `prepare` sends the head, `write` one chunk each."""

    def __init__(self, headers: dict[str, str] | None = None, content_type: str = "application/json"):
        super().__init__(200, b"", content_type, headers)
        self._connection: Connection | None = None
        self._ended = False

    async def prepare(self, request: Request) -> None:
        self._connection = request.connection
        self._connection.write(self.head(None, close=not request.keep_alive))

    async def write(self, data: bytes) -> None:
        """One chunk; waits while the client's socket buffer is full. ConnectionResetError once it has gone."""
        assert self._connection is not None, "prepare() first"
        if data:
            self._connection.write(b"%x\r\n%b\r\n" % (len(data), data))
            await self._connection.drain()

    def end(self) -> None:
        if self._connection is not None and not self._ended:
            self._ended = True
            self._connection.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable[Response]]
Routes = dict[tuple[str, str], Handler]  # (method, path) -> handler


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def text_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """Go's http.Error: plain text ending in a newline."""
    return Response(status, (message + "\n").encode(), "text/plain; charset=utf-8",
                    {"X-Content-Type-Options": "nosniff", **(headers or {})})


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Connection(asyncio.Protocol):
    """One client connection: requests parsed from what arrives, answered one at a time, in order."""

    def __init__(self, routes: Routes, max_body: int):
        self.routes, self.max_body = routes, max_body
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._task: asyncio.Task | None = None
        self._paused = False
        self._drained: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._continued = False  # `100 Continue` sent for the request being read
        self._head: tuple[str, str, str, dict[str, str], int] | None = None  # of the request being read
        self._chunks: tuple[int, int, list[tuple[int, int]]] | None = None  # a chunked body's walk so far
        self._wrote = False  # some of the current answer has gone out

    # ------------------------------------------------------------ asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._arm_idle()
        if self._task is None:
            self._next_request()
        elif len(self._buffer) > MAX_HEAD and self.transport is not None:
            self.transport.pause_reading()  # pipelined past the answer in progress: read on after it

    def eof_received(self) -> bool:
        return False  # a client that has stopped sending gets no more answers: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._idle is not None:
            self._idle.cancel()
        if self._task is not None:
            self._task.cancel()  # aiohttp's handler_cancellation: a completion ends its sequence
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    # ------------------------------------------------------------ writing

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self._wrote = True
        self.transport.write(data)

    async def drain(self) -> None:
        while self._paused:
            if self.transport is None:
                raise ConnectionResetError("the client went away")
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        if self.transport is None:
            raise ConnectionResetError("the client went away")

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self.transport is not None:
            self._idle = asyncio.get_running_loop().call_later(IDLE_TIMEOUT, self._on_idle)

    def _on_idle(self) -> None:
        if self._task is None and self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ reading

    def _next_request(self) -> None:
        """Start the handler of the next whole request in the buffer, if there is one."""
        try:
            request = self._parse()
        except BadRequest as err:
            self._close_with(text_response(err.status, str(err)))
            return
        if request is not None:
            self._task = asyncio.get_running_loop().create_task(self._answer(request))

    def _parse(self) -> Request | None:
        if self._head is None:
            self._head = self._parse_head()
            if self._head is None:
                return None
        method, target, version, headers, start = self._head
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._chunked_body(start)
        else:
            body = self._sized_body(start, headers)
        if body is None:
            if headers.get("expect", "").lower() == "100-continue" and not self._continued and self.transport:
                self._continued = True
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return None
        content, consumed = body
        del self._buffer[:consumed]
        self._head, self._chunks, self._continued = None, None, False
        return Request(method, target.split("?", 1)[0], version, headers, content, self)

    def _parse_head(self) -> tuple[str, str, str, dict[str, str], int] | None:
        end = self._buffer.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
        if end < 0:
            if len(self._buffer) > MAX_HEAD:
                raise BadRequest(431, "Request Header Fields Too Large")
            return None
        try:
            line, *fields = self._buffer[:end].decode("latin-1").split("\r\n")
            method, target, version = line.split(" ")
        except ValueError:
            raise BadRequest(400, "Bad Request") from None
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise BadRequest(505, "HTTP Version Not Supported")
        headers: dict[str, str] = {}
        for text in fields:
            name, colon, value = text.partition(":")
            if not colon or not name or name != name.strip():
                raise BadRequest(400, "Bad Request: malformed header")
            headers[name.lower()] = value.strip()
        return method, target, version, headers, end + 4

    def _sized_body(self, start: int, headers: dict[str, str]) -> tuple[bytes, int] | None:
        text = headers.get("content-length", "0")
        if not (text.isascii() and text.isdigit()):
            raise BadRequest(400, "Bad Request: invalid Content-Length")
        length = int(text)
        if length > self.max_body:
            raise BadRequest(413, "Request Entity Too Large")
        if len(self._buffer) < start + length:
            return None
        return bytes(self._buffer[start:start + length]), start + length

    def _chunked_body(self, start: int) -> tuple[bytes, int] | None:
        """The body once its last chunk is in; where the walk stopped is kept, so each byte is read once."""
        at, size, spans = self._chunks or (start, 0, [])
        self._chunks = None
        while True:
            eol = self._buffer.find(b"\r\n", at)
            if eol < 0:
                if len(self._buffer) - at > 1024:
                    raise BadRequest(400, "Bad Request: invalid chunk")
                self._chunks = (at, size, spans)
                return None
            digits = bytes(self._buffer[at:eol]).split(b";", 1)[0].strip()
            if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
                raise BadRequest(400, "Bad Request: invalid chunk")
            length = int(digits, 16)
            size += length
            if size > self.max_body:
                raise BadRequest(413, "Request Entity Too Large")
            if length == 0:  # trailers, if any, end at an empty line
                end = eol if self._buffer[eol:eol + 4] == b"\r\n\r\n" else self._buffer.find(b"\r\n\r\n", eol)
                if end < 0:
                    self._chunks = (at, size - length, spans)
                    return None
                return b"".join(self._buffer[s:s + n] for s, n in spans), end + 4
            if len(self._buffer) < eol + 2 + length + 2:
                self._chunks = (at, size - length, spans)
                return None
            spans.append((eol + 2, length))
            at = eol + 2 + length + 2

    # ------------------------------------------------------------ answering

    async def _answer(self, request: Request) -> None:
        self._wrote = False
        try:
            response = await self._dispatch(request)
            if isinstance(response, StreamResponse):
                response.end()
            else:
                body = b"" if request.method == "HEAD" else response.body
                self.write(response.head(len(response.body), close=not request.keep_alive) + body)
        except (ConnectionResetError, asyncio.CancelledError):
            self._close()
            return
        except Exception:
            log.exception("error handling %s %s", request.method, request.path)
            if self._wrote or self.transport is None:  # a head has gone: the answer cannot change now
                self._close()
            else:
                self._close_with(text_response(500, "Internal Server Error"))
            return
        finally:
            self._task = None
        if not request.keep_alive:
            self._close()
            return
        if self.transport is not None and not self.transport.is_reading():
            self.transport.resume_reading()
        if self._buffer:
            self._next_request()
        self._arm_idle()

    async def _dispatch(self, request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        handler = self.routes.get((method, request.path))
        if handler is not None:
            return await handler(request)
        allowed = sorted(m for m, path in self.routes if path == request.path)
        if allowed:
            if "GET" in allowed:
                allowed.append("HEAD")
            return text_response(405, "Method Not Allowed", {"Allow": ", ".join(sorted(allowed))})
        return text_response(404, "404 page not found")

    def _close_with(self, response: Response) -> None:
        with contextlib.suppress(ConnectionResetError):
            self.write(response.head(len(response.body), close=True) + response.body)
        self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def start(routes: Routes, host: str, port: int, max_body: int) -> asyncio.Server:
    """Listen; the server answers from the running event loop until closed."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(routes, max_body), host, port, reuse_address=True)


def run(routes: Routes, host: str, port: int, max_body: int) -> None:
    """Serve until SIGINT or SIGTERM, then return (as aiohttp's run_app did)."""

    async def main() -> None:
        server = await start(routes, host, port, max_body)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(main())
