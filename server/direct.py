"""A completion's token lines written to its socket by the batch loop's thread, not by the event loop.

Per token, handing a piece to the event loop costs a wake-up of another thread (a self-pipe write, the loop's
poll, the GIL handed over), an asyncio queue and aiohttp's writer: about as much CPU as the batch loop's own
Python per token on a small model, and on a machine whose cores ggml's threads keep busy, as much wall time.
llama-server writes from a thread of its own per connection; here the thread that sampled the token writes it.

The response starts on the event loop as any other (aiohttp writes the status line and headers with the first
chunk). Once the loop has written everything it was given, the stream goes direct: each later line is framed
as an HTTP/1.1 chunk and written with one non-blocking `os.write` on the connection's socket, by the thread
that calls `put`. If the socket cannot take a whole chunk at once (a slow reader: its buffer is full), the
rest and every later item go back through the event loop, which buffers and waits as aiohttp always does: the
batch loop never blocks on a client. The end of the stream (`None`) always goes through the event loop, which
writes the final line and the chunked terminator.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

from ollama_engine.runner.sequence import Piece

from .wire import completion_line


class DirectStream:
    """The queue between the batch loop (`put`) and a completion's handler (`get`), with the direct path."""

    def __init__(self, hand_over: Callable[[Callable[[Any], None], Any], None], on_broken: Callable[[], None],
                 on_end: Callable[[], None]):
        self._hand_over = hand_over  # runs a callable with an item on the event loop (LoopInbox.put)
        self._on_broken = on_broken  # the client went away during a direct write: end the sequence
        self._on_end = on_end  # on the event loop, when the sequence has ended (whether or not a handler reads)
        self._queue: asyncio.Queue[Piece | bytes | None] = asyncio.Queue()
        self._lock = threading.Lock()
        self._fd: int | None = None  # the socket, while writes are direct
        self._fell_back = False
        self._in_flight = 0  # handed to the event loop, not yet taken by the handler

    def put(self, item: Piece | None) -> None:
        """From the batch loop's thread: write a piece directly when the stream is direct, else queue it."""
        with self._lock:
            if item is not None and self._fd is not None:
                self._write(completion_line(item.text, item.logprobs))
                return
            self._in_flight += 1
        self._hand_over(self._deliver, item)

    def _deliver(self, item: Piece | bytes | None) -> None:
        self._queue.put_nowait(item)
        if item is None:
            self._on_end()

    def _write(self, line: bytes) -> None:
        chunk = b"%x\r\n%b\r\n" % (len(line), line)
        try:
            sent = os.write(self._fd, chunk)
        except BlockingIOError:
            sent = 0
        except OSError:  # reset or broken pipe: nobody reads this stream any more
            self._fd = None
            self._fell_back = True
            self._on_broken()
            return
        if sent < len(chunk):  # the client reads slower than we write: the event loop buffers from here on
            self._fd = None
            self._fell_back = True
            self._in_flight += 1
            self._hand_over(self._deliver, chunk[sent:])

    async def get(self) -> Piece | bytes | None:
        """The next item the event loop must write: a piece, raw bytes left by a partial direct write, or the end."""
        item = await self._queue.get()
        with self._lock:
            self._in_flight -= 1
        return item

    def go_direct(self, transport: asyncio.Transport | None) -> None:
        """Called by the handler after each write: once the loop has nothing left to send, later pieces bypass it."""
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return
        sock = transport.get_extra_info("socket")
        with self._lock:
            if self._fd is None and not self._fell_back and not self._in_flight and sock is not None:
                self._fd = sock.fileno()

    def stop(self) -> None:
        """No more direct writes (the handler is leaving: the socket may be reused or closed)."""
        with self._lock:
            self._fd = None
            self._fell_back = True
