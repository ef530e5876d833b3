"""The runner's own HTTP/1.1 server (server/httpd.py), spoken to over raw sockets and with aiohttp's client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
import pytest

from ollama_engine.server import httpd
from ollama_engine.server.httpd import Request, Response, StreamResponse


class App:
    """Routes that echo, stream, and wait forever (to see a handler cancelled when its client goes)."""

    def __init__(self):
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.connections: set[int] = set()  # of the requests echoed

    def routes(self) -> httpd.Routes:
        return {("GET", "/health"): self.health, ("POST", "/echo"): self.echo, ("POST", "/stream"): self.stream,
                ("POST", "/wait"): self.wait}

    async def health(self, request: Request) -> Response:
        return Response(body=b'{"status":0}\n')

    async def echo(self, request: Request) -> Response:
        body = await request.read()
        self.connections.add(id(request.connection))
        return Response(body=json.dumps({"length": len(body), "head": body[:16].decode("latin-1")}).encode())

    async def stream(self, request: Request) -> Response:
        response = StreamResponse()
        await response.prepare(request)
        for i in range(int(await request.read())):
            await response.write(b'{"n":%d}\n' % i)
        return response

    async def wait(self, request: Request) -> Response:
        self.waiting = request.connection
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response()


def serving(test, max_body: int = 1 << 20):
    """Run `test(app, port)` against a server listening on a free port."""

    async def run():
        app = App()
        server = await httpd.start(app.routes(), "127.0.0.1", 0, max_body)
        try:
            return await test(app, server.sockets[0].getsockname()[1])
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(asyncio.wait_for(run(), 30))


async def exchange(port: int, data: bytes, until_close: bool = True, size: int = 1 << 16) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await (reader.read() if until_close else reader.read(size))
    finally:
        writer.close()


def heads(data: bytes) -> list[str]:
    """The status lines of the answers in `data` (a body may run into the next answer's status line)."""
    return re.findall(r"HTTP/1\.1 \d{3} [A-Za-z ]+(?=\r\n)", data.decode("latin-1"))


def test_go_answers_for_unknown_paths_and_methods():
    async def test(app, port):
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            missing = await client.get("/nope")
            wrong = await client.get("/echo")
            head = await client.head("/health")
            return ((missing.status, missing.headers["Content-Type"], await missing.text()),
                    (wrong.status, wrong.headers["Allow"], await wrong.text()),
                    (head.status, head.headers["Content-Length"], await head.read()))

    missing, wrong, head = serving(test)
    assert missing == (404, "text/plain; charset=utf-8", "404 page not found\n")
    assert wrong == (405, "POST", "Method Not Allowed\n")
    assert head == (200, "13", b"")


def test_one_connection_answers_requests_in_turn_and_pipelined():
    async def test(app, port):
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            answers = [await (await client.post("/echo", data=b"x" * n)).json() for n in (0, 5, 70_000)]
            connections = len(app.connections)
        request = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        pipelined = await exchange(port, request * 3 + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        return answers, connections, pipelined

    answers, connections, pipelined = serving(test)
    assert [a["length"] for a in answers] == [0, 5, 70_000]
    assert connections == 1  # kept alive for the next request
    assert heads(pipelined) == ["HTTP/1.1 200 OK"] * 4
    assert pipelined.count(b'"head": "abc"') == 3 and pipelined.endswith(b'{"status":0}\n')
    assert pipelined.count(b"Connection: close\r\n") == 1  # the last answer's, whose request asked to close


def test_chunked_bodies_and_expect_continue():
    async def test(app, port):
        chunked = (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                   b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\nX-Trailer: 1\r\n\r\n")
        whole = await exchange(port, chunked)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
        continued = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"wxyz")
        answer = await reader.read()
        writer.close()
        return whole, continued, answer

    whole, continued, answer = serving(test)
    assert heads(whole) == ["HTTP/1.1 200 OK"] and whole.endswith(b'{"length": 7, "head": "abcdefg"}')
    assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answer.endswith(b'{"length": 4, "head": "wxyz"}')


def test_a_chunked_body_in_pieces_is_read_once():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for i in range(200):
            writer.write(b"5\r\n%05d\r\n" % i)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer

    assert serving(test).endswith(b'{"length": 1000, "head": "0000000001000020"}')


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", "400 Bad Request"),
    (b"GET /health HTTP/2.0\r\n\r\n", "505 HTTP Version Not Supported"),
    (b"GET /health HTTP/1.1\r\nno colon\r\n\r\n", "400 Bad Request"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "400 Bad Request"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n", "400 Bad Request"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n", "413 Request Entity Too Large"),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "400 Bad Request"),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x10\r\n", "400 Bad Request"),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n200000\r\n", "413 Request Entity Too Large"),
    (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", "431 Request Header Fields Too Large"),
])
def test_bad_requests_get_an_answer_and_a_closed_connection(request_bytes, status):
    answer = serving(lambda app, port: exchange(port, request_bytes))  # reads until the server closes
    assert heads(answer) == [f"HTTP/1.1 {status}"]


def test_a_stream_is_chunked_and_an_http10_client_is_closed_after_its_answer():
    async def test(app, port):
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post("/stream", data=b"3")
            lines = [json.loads(line) async for line in response.content]
            encoding = response.headers["Transfer-Encoding"]
        old = await exchange(port, b"GET /health HTTP/1.0\r\n\r\n")
        return lines, encoding, old

    lines, encoding, old = serving(test)
    assert lines == [{"n": 0}, {"n": 1}, {"n": 2}] and encoding == "chunked"
    assert heads(old) == ["HTTP/1.1 200 OK"] and old.endswith(b'{"status":0}\n') and b"Connection: close\r\n" in old


def test_a_handler_is_cancelled_when_its_client_goes_away():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /wait HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        await app.started.wait()
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        return app.cancelled.is_set()

    assert serving(test)


def test_what_is_pipelined_behind_a_long_answer_is_not_read_without_bound():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /wait HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        await app.started.wait()
        writer.write(b"x" * (8 << 20))  # far more than the socket buffers hold: the client must block
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(writer.drain(), 2)
        held = len(app.waiting._buffer)
        writer.transport.abort()
        return held

    assert serving(test) < httpd.MAX_HEAD + (1 << 20)  # read up to the limit, plus what one read brings


def test_a_handler_that_fails_answers_500_and_the_server_goes_on():
    async def broken(request: Request) -> Response:
        raise RuntimeError("bug")

    async def run():
        server = await httpd.start({("GET", "/broken"): broken}, "127.0.0.1", 0, 1024)
        port = server.sockets[0].getsockname()[1]
        try:
            first = await exchange(port, b"GET /broken HTTP/1.1\r\n\r\n")
            second = await exchange(port, b"GET /broken HTTP/1.1\r\n\r\n")
            return first, second
        finally:
            server.close()

    first, second = asyncio.run(run())
    assert heads(first) == heads(second) == ["HTTP/1.1 500 Internal Server Error"]
