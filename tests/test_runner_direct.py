"""The runner writes a completion's token lines to the socket from the batch loop's thread (server/direct.py).

Checked on a real socket pair with small buffers: lines arrive whole and in order when the socket is direct, when a
write is cut short (a slow reader: the rest and every later line go through the event loop), and after the
reader went away (the sequence is told to quit, nothing is lost or reordered before that).
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from ollama_engine.runner.sequence import Piece
from ollama_engine.server.direct import DirectStream
from ollama_engine.server.wire import completion_line


class FakeTransport:
    """What DirectStream asks of aiohttp's transport: the socket, and whether the loop still buffers anything."""

    def __init__(self, sock: socket.socket, buffered: int = 0):
        self.sock, self.buffered = sock, buffered

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def frame(line: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(line), line)


def unframe(data: bytes) -> list[bytes]:
    lines = []
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        lines.append(rest[:n])
        assert rest[n : n + 2] == b"\r\n"
        data = rest[n + 2 :]
    return lines


@pytest.fixture
def pair():
    writer, reader = socket.socketpair()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer.setblocking(False)
    yield writer, reader
    writer.close()
    reader.close()


class Harness:
    """A DirectStream whose event-loop side is this test: hand-overs run at once; `drain` writes what the
    handler would (pieces framed as aiohttp frames them, raw rests as they are)."""

    def __init__(self, writer: socket.socket):
        self.writer = writer
        self.broken = self.ended = 0
        self.stream = DirectStream(lambda deliver, item: deliver(item), self._broken, self._ended)
        self.loop = asyncio.new_event_loop()

    def _broken(self) -> None:
        self.broken += 1

    def _ended(self) -> None:
        self.ended += 1

    def drain(self, transport: FakeTransport | None = None) -> list[Piece | bytes | None]:
        """Take what the handler would take now; write it to the socket (blocking) as the event loop would."""
        taken = []
        while self.stream._queue.qsize():
            item = self.loop.run_until_complete(self.stream.get())
            taken.append(item)
            if isinstance(item, bytes):
                self.writer.setblocking(True)
                self.writer.sendall(item)
            elif item is not None:
                self.writer.setblocking(True)
                self.writer.sendall(frame(completion_line(item.text, item.logprobs)))
            self.writer.setblocking(False)
            if transport is not None and item is not None:
                self.stream.go_direct(transport)
        return taken


def read_all(reader: socket.socket) -> bytes:
    reader.setblocking(False)
    data = b""
    while True:
        try:
            chunk = reader.recv(1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


def pieces(count: int, size: int = 50) -> list[Piece]:
    return [Piece(f"{i:04d}" + "x" * size, []) for i in range(count)]


def test_lines_are_written_by_the_putting_thread_once_the_loop_has_sent_everything(pair):
    writer, reader = pair
    h = Harness(writer)
    transport = FakeTransport(writer)
    first, *rest = pieces(6)
    h.stream.put(first)  # before the response started: through the loop
    assert h.drain(transport) == [first]
    for piece in rest:
        h.stream.put(piece)
    assert h.stream._queue.qsize() == 0  # nothing went through the loop: written directly
    h.stream.put(None)
    assert h.drain() == [None] and h.ended == 1
    lines = unframe(read_all(reader))
    assert [json.loads(line)["content"] for line in lines] == [p.text for p in [first, *rest]]


def test_no_direct_write_while_the_loop_buffers_or_holds_an_earlier_item(pair):
    writer, reader = pair
    h = Harness(writer)
    h.stream.go_direct(FakeTransport(writer, buffered=10))  # the transport still has bytes to send
    a, b, c = pieces(3)
    h.stream.put(a)
    h.stream.go_direct(FakeTransport(writer))  # `a` is handed over but not yet taken by the handler
    h.stream.put(b)
    assert h.stream._queue.qsize() == 2  # both through the loop: b may not overtake a
    h.drain(FakeTransport(writer))
    h.stream.put(c)
    assert h.stream._queue.qsize() == 0
    assert [json.loads(line)["content"] for line in unframe(read_all(reader))] == [a.text, b.text, c.text]


def test_a_slow_reader_sends_the_rest_through_the_loop_in_order(pair):
    writer, reader = pair
    h = Harness(writer)
    transport = FakeTransport(writer)
    sent = pieces(400, size=200)  # ~80 KB: far more than the socket pair buffers
    h.stream.put(sent[0])
    h.drain(transport)
    for piece in sent[1:]:
        h.stream.put(piece)
    queued = h.stream._queue.qsize()
    assert 0 < queued < len(sent) - 1  # some went directly, then a write was cut and the rest was queued
    h.stream.put(None)
    received = b""
    while h.stream._queue.qsize():  # the handler writes while the client reads
        item = h.loop.run_until_complete(h.stream.get())
        data = item if isinstance(item, bytes) else b"" if item is None else frame(completion_line(item.text, []))
        while data:
            try:
                n = writer.send(data)
                data = data[n:]
            except BlockingIOError:
                received += read_all(reader)
    received += read_all(reader)
    assert [json.loads(line)["content"] for line in unframe(received)] == [p.text for p in sent]
    assert h.broken == 0 and h.ended == 1


def test_a_reader_gone_ends_the_sequence_and_later_pieces_go_to_the_loop(pair):
    writer, reader = pair
    h = Harness(writer)
    first, second, third = pieces(3)
    h.stream.put(first)
    h.drain(FakeTransport(writer))
    reader.close()
    h.stream.put(second)  # the write fails: the sequence is told to quit
    assert h.broken == 1
    h.stream.put(third)
    h.stream.put(None)
    taken = [h.loop.run_until_complete(h.stream.get()) for _ in range(2)]
    assert [item if item is None else item.text for item in taken] == [third.text, None]
    assert h.ended == 1
