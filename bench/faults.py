"""A fault-injecting HTTP proxy for chaos tests and `bench/chaos.py`.

It sits between clients and a real model server, one request per connection, and for each
request to a faulted route draws one of: pass it on, answer 503, stall (hold the connection
open and answer nothing until the client gives up), or reset the connection (TCP RST before any
answer), at the rates given. Other routes (`/metrics`, `/health`) always pass, so a watchdog
behind it still sees the server's real progress. Counts of what it did are kept per kind. A
client that leaves before its answer closes the upstream connection too, so the server aborts
the request as it would without the proxy.

    with FaultProxy(upstream, Faults(error=0.05, stall=0.02, reset=0.05)).running() as url:
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ERROR_BODY = b'{"error": {"message": "injected fault", "code": 503}}'


@dataclass
class Faults:
    """Rates per request of each fault, on routes starting with one of `routes`."""

    error: float = 0.0
    stall: float = 0.0
    reset: float = 0.0
    drop_answer: float = 0.0  # forward the request, then reset instead of answering
    routes: tuple[str, ...] = ("/v1/",)
    seed: int = 0


@dataclass
class FaultProxy:
    upstream: str
    faults: Faults
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._random = random.Random(self.faults.seed)
        self._stalled: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # held: a pending task is not collected

    @contextmanager
    def running(self) -> Iterator[str]:
        """Serve on a free loopback port in a background thread; yields the proxy's URL."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder: dict[str, asyncio.Server] = {}

        async def start() -> None:
            holder["server"] = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            ready.set()

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
        ready.wait()
        port = holder["server"].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:

            async def stop() -> None:
                holder["server"].close()
                for writer in list(self._stalled):
                    writer.close()
                handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for handler in handlers:
                    handler.cancel()
                await asyncio.gather(*handlers, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    def _draw(self, path: str) -> str:
        if not path.startswith(self.faults.routes):
            return "pass"
        roll, f = self._random.random(), self.faults
        for kind, rate in (
            ("error", f.error),
            ("stall", f.stall),
            ("reset", f.reset),
            ("drop_answer", f.drop_answer),
        ):
            if roll < rate:
                return kind
            roll -= rate
        return "pass"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = _content_length(head)
            body = await reader.readexactly(length) if length else b""
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        path = head.split(b" ", 2)[1].decode(errors="replace")
        kind = self._draw(path)
        self.counts[kind] += 1
        if kind == "error":
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(ERROR_BODY), ERROR_BODY)
            )
            await _close(writer)
        elif kind == "stall":
            self._stalled.add(writer)
            await reader.read()  # until the client gives up
            self._stalled.discard(writer)
            writer.close()
        elif kind == "reset":
            _reset(writer)
        else:
            request = _close_after(head) + body
            await self._forward(request, reader, writer, drop=kind == "drop_answer")

    async def _forward(
        self,
        request: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        drop: bool,
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            _reset(writer)
            return
        up_writer.write(request)
        await up_writer.drain()
        answered = asyncio.ensure_future(up_reader.read())  # the upstream closes after one answer
        left = asyncio.ensure_future(reader.read())  # the client sends no more: EOF if it leaves
        try:
            await asyncio.wait({answered, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (answered, left):
                waiting.cancel()
            up_writer.close()  # answered, or the client gone: the server aborts what it runs
        if not answered.done() or answered.cancelled():
            writer.close()
            return
        answer = answered.result()
        if drop:  # the request took effect; its answer is lost on the way back
            _reset(writer)
            return
        writer.write(answer)
        await _close(writer)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _close_after(head: bytes) -> bytes:
    """The same request head, asking the upstream to close after answering."""
    lines = [
        line
        for line in head.rstrip(b"\r\n").split(b"\r\n")
        if not line.lower().startswith(b"connection:")
    ]
    return b"\r\n".join([*lines, b"connection: close"]) + b"\r\n\r\n"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST: the client sees a connection reset, not a clean close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    finally:
        writer.close()
