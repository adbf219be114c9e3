"""A TCP proxy to the broker that lines up the first declares of shared queues from many clients.

Workers that start together race to declare the same new quorum queues and streams, and RabbitMQ
3.10 answers a consume that arrives while such a queue is still starting with a 541 that closes
the whole connection. Processes start a few seconds apart, so the race is rare on its own; this
proxy makes it likely: it holds each connection's traffic to the broker at its first
``queue.declare`` of a watched queue until ``parties`` connections have declared it (or
``window_s`` passed), then lets them all go at once. Later declares of the name pass freely.
Nothing is changed or dropped: frames are only delayed, in order.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

__all__ = ["BrokerClose", "DeclareLineup"]

_PROTOCOL_HEADER = 8  # b"AMQP\x00\x00\x09\x01"
_FRAME_HEADER = struct.Struct(">BHI")  # type, channel, payload size; then the payload and 0xCE
_METHOD = 1
_QUEUE_DECLARE = (50, 10)
_START_OK = (10, 11)
_CONNECTION_CLOSE = (10, 50)
_NAME_FIELD = b"\x0fconnection_nameS"  # the client's name in start-ok's client-properties


@dataclass(frozen=True)
class BrokerClose:
    """A connection the broker closed: the client's connection name and the broker's reason."""

    connection: str
    code: int
    text: str


@dataclass
class _Gathering:
    arrived: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)


class DeclareLineup:
    """Proxy ``url``'s broker; clients given :attr:`url` connect through it.

    Args:
        url: the broker's AMQP URL (any vhost; only host and port are proxied).
        watched: which queue names to line up.
        parties: how many declares of a name to gather before releasing them.
        window_s: the longest a declare is held waiting for the others.
    """

    def __init__(
        self, url: str, *, watched: Callable[[str], bool], parties: int, window_s: float = 20.0
    ) -> None:
        parts = urlsplit(url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 5672)
        self._parts = parts
        self._watched = watched
        self._parties = parties
        self._window_s = window_s
        self._gatherings: dict[str, _Gathering] = {}
        self.lined_up: dict[str, int] = {}  # name -> declares released together
        self.closes: list[BrokerClose] = []  # appended from the proxy's thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="declare-lineup", daemon=True)
        self._server: asyncio.Server | None = None
        self._port = 0

    @property
    def url(self) -> str:
        """``url`` with the proxy's host and port (user, password, vhost kept)."""
        userinfo = self._parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self._port}" if userinfo else f"127.0.0.1:{self._port}"
        return urlunsplit(self._parts._replace(netloc=netloc))

    def __enter__(self) -> DeclareLineup:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            proxied = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in proxied:
                task.cancel()
            await asyncio.gather(*proxied, return_exceptions=True)  # each closes its sockets
            await asyncio.sleep(0)  # and their transports finish closing

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            broker_r, broker_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.close()
            return
        name: list[str] = ["?"]  # learnt from the client's start-ok
        upstream = asyncio.ensure_future(self._to_broker(client_r, broker_w, name))
        downstream = asyncio.ensure_future(self._to_client(broker_r, client_w, name))
        try:
            await asyncio.wait({upstream, downstream}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            upstream.cancel()
            downstream.cancel()
            for writer in (client_w, broker_w):
                writer.close()

    async def _to_broker(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: list[str]
    ) -> None:
        writer.write(await reader.readexactly(_PROTOCOL_HEADER))
        while True:
            header, rest, method = await _frame(reader)
            if method == _START_OK and _NAME_FIELD in rest:
                at = rest.index(_NAME_FIELD) + len(_NAME_FIELD)
                (size,) = struct.unpack(">I", rest[at : at + 4])
                name[0] = rest[at + 4 : at + 4 + size].decode()
            elif method == _QUEUE_DECLARE:
                queue = rest[7 : 7 + rest[6]].decode()  # after the reserved short: a shortstr
                if self._watched(queue):
                    await self._line_up(queue)
            writer.write(header + rest)
            await writer.drain()

    async def _to_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: list[str]
    ) -> None:
        while True:
            header, rest, method = await _frame(reader)
            if method == _CONNECTION_CLOSE:
                (code,) = struct.unpack(">H", rest[4:6])
                self.closes.append(BrokerClose(name[0], code, rest[7 : 7 + rest[6]].decode()))
            writer.write(header + rest)
            await writer.drain()

    async def _line_up(self, name: str) -> None:
        gathering = self._gatherings.get(name)
        if gathering is None:
            gathering = self._gatherings[name] = _Gathering()
            asyncio.get_running_loop().call_later(self._window_s, self._release, name)
        elif gathering.released.is_set():
            return  # only the first declares of a name are lined up
        gathering.arrived += 1
        if gathering.arrived >= self._parties:
            self._release(name)
        await gathering.released.wait()

    def _release(self, name: str) -> None:
        gathering = self._gatherings[name]
        if not gathering.released.is_set():
            self.lined_up[name] = gathering.arrived
            gathering.released.set()


async def _frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes, tuple[int, int] | None]:
    # One frame: its header, the rest (payload and frame end), and (class, method) of a method frame.
    header = await reader.readexactly(_FRAME_HEADER.size)
    kind, _channel, size = _FRAME_HEADER.unpack(header)
    rest = await reader.readexactly(size + 1)
    method = (struct.unpack(">HH", rest[:4])) if kind == _METHOD else None
    return header, rest, method
