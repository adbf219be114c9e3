"""A consuming pool child's own connection: one socket, one channel, read and written by the child itself.

Why not pika: at one delivery in flight per child, pika's layers (an I/O loop, a thread hop for
each ack, frame objects) cost more CPU than the task and the rest of the child together
(BENCHMARKS.md). This connection does the few things a consumer needs, on the calling thread:
consume with a prefetch, ack and nack, publish with a confirm (waited for, one at a time), declare
a queue. Frames are read and written by ``broker_svc/wire/amqp_frames.py``.

Threads. The child's main thread does everything while no task runs. While one does
(:meth:`FeedConnection.running`), a heartbeat thread writes heartbeats, and the hard time limit's
watchdog may take the socket over to answer and ack; the lock gives the socket to one of them at a
time. Broker heartbeats that arrive meanwhile wait in the socket: only our silence would end it.

Any failure is :class:`ConnectionLost`: the socket is dropped, what it delivered is the broker's
again (settles of an earlier ``generation`` are not sent), and the caller connects again.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from broker_svc.errors import BrokerUnavailable, PublishNacked, Unroutable
from broker_svc.library_log import get_logger
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec
from broker_svc.wire import amqp_frames as frames
from broker_svc.wire.amqp_fields import encode_properties, encode_table
from broker_svc.wire.task_message import WireMessage

__all__ = ["ConnectionLost", "FeedConnection", "TaskDelivery"]

log = get_logger(__name__)

_CHANNEL: Final = 1
_FRAME_MAX: Final = 131_072
_DELIVER: Final = (60, 60)
_CONFIRM_ACK: Final = (60, 80)
_CONFIRM_NACK: Final = (60, 120)
_RETURN: Final = (60, 50)
_SERVER_CANCEL: Final = (60, 30)
_CONNECTION_CLOSE: Final = (10, 50)
_CHANNEL_CLOSE: Final = (20, 40)
_U64_BIT = struct.Struct(">QB")
_DELIVER_TAIL = struct.Struct(">QB")


class ConnectionLost(BrokerUnavailable):
    """The connection or its channel is gone; its deliveries go back to their queues."""


@dataclass(frozen=True, slots=True)
class TaskDelivery:
    """One delivery from a task queue, with what settling and copying it needs."""

    body: bytes
    queue: str
    routing_key: str
    exchange: str
    redelivered: bool
    tag: int
    generation: int
    content_type: str | None
    content_encoding: str | None
    headers: dict[str, Any]
    correlation_id: str | None
    reply_to: str | None
    priority: int | None


class FeedConnection:
    """Consumes task queues and publishes with confirms, on the calling thread.

    Args:
        settings: broker URLs (failover order), heartbeat, timeouts, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        queues: the queues to consume.
        prefetch: unacked deliveries the broker may send at once.
    """

    def __init__(self, settings: Settings, *, name: str, queues: Sequence[str], prefetch: int) -> None:
        self._settings = settings
        self._name = name
        self._queues = tuple(queues)
        self._prefetch = prefetch
        # Whoever writes to (or, while a task runs, reads) the socket; reentrant, as the hard time
        # limit's watchdog holds it across the publish and the ack it sends.
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._deliveries: collections.deque[TaskDelivery] = collections.deque()
        self._tags: dict[str, str] = {}  # consumer tag -> queue
        self._declared: set[str] = set()
        self._frame_max = _FRAME_MAX
        self._heartbeat_s = 0
        self._last_write = self._last_read = 0.0
        self._published = 0  # publish sequence number of this channel
        self._confirmed = 0  # every publish up to this one is confirmed
        self._nacked: set[int] = set()
        self._returned: str | None = None  # why the broker returned the last publish
        self._busy = False
        self._beating = threading.Event()
        self.generation = 0  # one more for each connection: settles of an older one are not sent

    # -- connecting ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the first broker that answers, in failover order, and consume.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        self.drop()
        failures = []
        for url in self._settings.broker_urls:
            try:
                self._open(url)
            except (OSError, frames.FrameError, BrokerUnavailable) as exc:
                self.drop()
                failures.append(f"{redact_url(url)}: {exc}")
                continue
            self.generation += 1
            if self._heartbeat_s and not self._beating.is_set():
                self._beating.set()
                beat = threading.Thread(target=self._beat, name=f"clockwork-beat-{self._name}", daemon=True)
                # Started with every signal blocked: the caller's signals (a task's SIGALRM) stay its own.
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                try:
                    beat.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            log.debug("feed_connected", connection=self._name, url=redact_url(url))
            return
        raise BrokerUnavailable("; ".join(failures))

    def _open(self, url: str) -> None:
        settings = self._settings
        parts = urlsplit(url)
        tls = settings.tls_context(url)
        host = parts.hostname or "localhost"
        sock = socket.create_connection(
            (host, parts.port or (5671 if tls else 5672)), settings.connect_timeout_s
        )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        self._sock, self._buffer = sock, bytearray()
        self._deliveries.clear()
        self._tags.clear()
        self._declared.clear()
        self._published = self._confirmed = 0
        self._nacked.clear()
        self._last_read = time.monotonic()
        self._write(b"AMQP\x00\x00\x09\x01")
        self._expect((10, 10))  # connection.start: PLAIN is always offered
        user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
        response = f"\0{user}\0{password}".encode()
        self._write(frames.method(0, 10, 11, (
            frames.client_properties(self._name) + frames.short_string("PLAIN")
            + struct.pack(">I", len(response)) + response + frames.short_string("en_US")
        )))  # fmt: skip
        tune = self._expect((10, 30))
        _channels, frame_max, server_heartbeat = struct.unpack_from(">HIH", tune, 4)
        ours = settings.heartbeat_s
        self._heartbeat_s = (
            min(ours, server_heartbeat) if ours and server_heartbeat else max(ours, server_heartbeat)
        )
        self._frame_max = min(frame_max or _FRAME_MAX, _FRAME_MAX)
        self._write(frames.method(0, 10, 31, struct.pack(">HIH", 1, self._frame_max, self._heartbeat_s)))
        self._write(frames.method(0, 10, 40, frames.short_string(settings.virtual_host) + b"\x00\x00"))
        self._expect((10, 41))
        self._write(frames.method(_CHANNEL, 20, 10, b"\x00"))
        self._expect((20, 11))
        self._write(frames.method(_CHANNEL, 85, 10, b"\x00"))  # confirm.select
        self._expect((85, 11))
        self._write(frames.method(_CHANNEL, 60, 10, struct.pack(">IHB", 0, self._prefetch, 0)))
        self._expect((60, 11))
        for queue in self._queues:
            self._consume(queue)
        # One read waits at most this long, so heartbeats go out and a stop is seen. A kernel receive
        # timeout on a blocking socket costs one system call per read; Python's own timeout adds a
        # poll() before each (TLS keeps it: its reads cannot use the kernel's).
        wake = min(0.5, self._heartbeat_s / 2) if self._heartbeat_s else 0.5
        if tls is None:
            sock.settimeout(None)
            seconds = int(wake)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((wake - seconds) * 1e6))
            )
        else:
            sock.settimeout(wake)

    # -- consuming -------------------------------------------------------------------------------

    def next_delivery(self, timeout_s: float | None) -> TaskDelivery | None:
        """The next delivery, waiting up to ``timeout_s`` (None: until one comes); None if none came.

        Raises:
            ConnectionLost: the connection failed, or the broker went silent past two heartbeats.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._deliveries:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._pump()
        return self._deliveries.popleft()

    def ack(self, delivery: TaskDelivery) -> None:
        """Ack ``delivery``; not sent if its connection is gone (the broker requeued it).

        Raises:
            ConnectionLost: the write failed.
        """
        if self._current(delivery):
            self._write(frames.method(_CHANNEL, 60, 80, _U64_BIT.pack(delivery.tag, 0)))

    def nack(self, delivery: TaskDelivery, *, requeue: bool) -> None:
        """Nack ``delivery`` (back to its queue with ``requeue``); not sent if its connection is gone.

        Raises:
            ConnectionLost: the write failed.
        """
        if self._current(delivery):
            self._write(frames.method(_CHANNEL, 60, 120, _U64_BIT.pack(delivery.tag, 2 if requeue else 0)))

    @property
    def queues(self) -> tuple[str, ...]:
        """The queues consumed (and consumed again after a reconnect)."""
        return self._queues

    def set_queues(self, queues: Sequence[str]) -> None:
        """Consume ``queues`` from now on: new ones are consumed, dropped ones cancelled.

        Deliveries already taken from a dropped queue stay with the caller.

        Raises:
            ConnectionLost: the connection failed meanwhile (a reconnect consumes ``queues``).
        """
        wanted = tuple(dict.fromkeys(queues))
        self._queues, before = wanted, set(self._tags.values())
        if self._sock is None:
            return
        for tag, queue in list(self._tags.items()):
            if queue not in wanted:
                self._expect(
                    (60, 31), send=frames.method(_CHANNEL, 60, 30, frames.short_string(tag) + b"\x00")
                )
                del self._tags[tag]
        for queue in wanted:
            if queue not in before:
                self._consume(queue)

    def _consume(self, queue: str) -> None:
        arguments = b"\x00\x00" + frames.short_string(queue) + b"\x00" + b"\x00" + encode_table({})
        ok = self._expect((60, 21), send=frames.method(_CHANNEL, 60, 20, arguments))
        self._tags[ok[5 : 5 + ok[4]].decode()] = queue

    def cancel(self) -> list[TaskDelivery]:
        """Stop consuming; returns what was delivered and not taken yet (the caller hands it back).

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        for tag in list(self._tags):
            self._expect((60, 31), send=frames.method(_CHANNEL, 60, 30, frames.short_string(tag) + b"\x00"))
            del self._tags[tag]
        left = list(self._deliveries)
        self._deliveries.clear()
        return left

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the body runs: the heartbeat thread keeps the connection alive."""
        with self._lock:
            self._busy = True
        try:
            yield
        finally:
            with self._lock:
                self._busy = False

    @contextlib.contextmanager
    def taken_over(self) -> Iterator[None]:
        """For another thread while a task runs (the hard time limit): the socket is its alone."""
        with self._lock:
            self._busy = False  # nothing else writes now; this thread reads and writes
            yield

    # -- publishing ------------------------------------------------------------------------------

    def publish(
        self, message: WireMessage, routing_key: str, *, exchange: str = "", declare: Sequence[QueueSpec] = ()
    ) -> None:
        """Publish (mandatory) and wait for the broker's confirm.

        Raises:
            Unroutable: no queue took it (returned).
            PublishNacked: the broker refused it.
            ConnectionLost: the connection failed, or no confirm came within ``confirm_timeout_s``.
        """
        for spec in declare:
            if spec.name not in self._declared:
                self._declare(spec)
        properties = encode_properties(
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            headers=message.headers,
            delivery_mode=message.delivery_mode,
            priority=message.priority,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            expiration=message.expiration,
        )
        self._returned = None
        self._write(frames.publish_frames(
            _CHANNEL, exchange=exchange, routing_key=routing_key, mandatory=True, properties=properties,
            body=message.body, frame_max=self._frame_max,
        ))  # fmt: skip
        self._published += 1
        sequence = self._published
        deadline = time.monotonic() + self._settings.confirm_timeout_s
        while self._confirmed < sequence and sequence not in self._nacked:
            if time.monotonic() >= deadline:
                raise self._lost(f"no confirm within {self._settings.confirm_timeout_s} s")
            self._pump()
        if sequence in self._nacked:
            self._nacked.discard(sequence)
            raise PublishNacked(f"the broker refused a message to {routing_key!r}")
        if self._returned is not None:
            raise Unroutable(f"no queue took a message to {routing_key!r} ({self._returned})")

    def publish_nowait(self, message: WireMessage, routing_key: str, *, exchange: str) -> None:
        """Publish without a confirm to wait for and not mandatory (events: best-effort).

        Raises:
            ConnectionLost: the write failed.
        """
        properties = encode_properties(
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            headers=message.headers,
            delivery_mode=message.delivery_mode,
        )
        self._write(frames.publish_frames(
            _CHANNEL, exchange=exchange, routing_key=routing_key, mandatory=False, properties=properties,
            body=message.body, frame_max=self._frame_max,
        ))  # fmt: skip
        self._published += 1  # its confirm comes in order before any later one's

    def _declare(self, spec: QueueSpec) -> None:
        bits = (2 if spec.durable else 0) | (4 if spec.exclusive else 0) | (8 if spec.auto_delete else 0)
        arguments = (
            b"\x00\x00" + frames.short_string(spec.name) + bytes((bits,)) + encode_table(spec.arguments)
        )
        self._expect((50, 11), send=frames.method(_CHANNEL, 50, 10, arguments))
        self._declared.add(spec.name)

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close politely (a moment for the broker's close-ok), then drop the socket."""
        if self._sock is not None:
            with contextlib.suppress(BrokerUnavailable, OSError, frames.FrameError):
                close = frames.method(
                    0, 10, 50, struct.pack(">H", 200) + frames.short_string("bye") + b"\x00" * 4
                )
                self._expect((10, 51), send=close, timeout_s=1.0)
        self.drop()
        self._beating.clear()

    def drop(self) -> None:
        """Drop the socket without a word (after a failure)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # -- frames ----------------------------------------------------------------------------------

    def _current(self, delivery: TaskDelivery) -> bool:
        if delivery.generation == self.generation and self._sock is not None:
            return True
        log.info("task_settle_dropped_channel_gone", tag=delivery.tag, queue=delivery.queue)
        return False

    def _write(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        try:
            with self._lock:
                sock.sendall(data)
                self._last_write = time.monotonic()
        except OSError as exc:
            raise self._lost(f"write failed: {exc}") from exc

    def _expect(
        self, wanted: tuple[int, int], *, send: bytes | None = None, timeout_s: float | None = None
    ) -> bytes:
        # Send ``send`` (if any) and read until the method ``wanted`` arrives; its payload.
        if send is not None:
            self._write(send)
        deadline = time.monotonic() + (timeout_s or self._settings.connect_timeout_s * 2)
        while True:
            if time.monotonic() >= deadline:
                raise self._lost(f"no answer to {wanted} in time")
            frame = self._read()
            if frame is None:
                continue
            if frame.type == frames.FRAME_METHOD and frame.method_id == wanted:
                return frame.payload
            self._dispatch(frame)

    def _pump(self) -> None:
        # Read (one wait of at most the wake interval) and handle a frame; heartbeats both ways.
        frame = self._read()
        if frame is not None:
            self._dispatch(frame)
        if self._heartbeat_s:
            now = time.monotonic()
            if now - self._last_write >= self._heartbeat_s / 2:
                self._write(frames.HEARTBEAT)
            if frame is None and now - self._last_read > 2 * self._heartbeat_s:
                raise self._lost(f"no heartbeat from the broker in {2 * self._heartbeat_s} s")

    def _read(self) -> frames.Frame | None:
        # One whole frame, or None if none came within the wake interval.
        frame = frames.next_frame(self._buffer)
        if frame is not None:
            return frame
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        try:
            data = sock.recv(262_144)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError as exc:
            raise self._lost(f"read failed: {exc}") from exc
        if not data:
            raise self._lost("the broker closed the connection")
        self._last_read = time.monotonic()
        self._buffer += data
        return frames.next_frame(self._buffer)

    def _content(self) -> tuple[frames.Properties, bytes]:
        # The header and body frames that follow a deliver or a return.
        header = self._next_frame()
        if header.type != frames.FRAME_HEADER:
            raise self._lost("a content header was expected")
        properties = frames.decode_properties(header.payload)
        parts, size = [], 0
        while size < properties.body_size:
            body = self._next_frame()
            if body.type != frames.FRAME_BODY:
                raise self._lost("a content body was expected")
            parts.append(body.payload)
            size += len(body.payload)
        return properties, b"".join(parts)

    def _next_frame(self) -> frames.Frame:
        deadline = time.monotonic() + self._settings.connect_timeout_s
        while (frame := self._read()) is None:
            if time.monotonic() >= deadline:
                raise self._lost("a frame was cut short")
        return frame

    def _dispatch(self, frame: frames.Frame) -> None:
        if frame.type != frames.FRAME_METHOD:
            return  # heartbeats (and stray content, which cannot happen on a sound stream)
        kind, payload = frame.method_id, frame.payload
        if kind == _DELIVER:
            self._on_deliver(payload)
        elif kind == _CONFIRM_ACK or kind == _CONFIRM_NACK:
            tag, bits = _U64_BIT.unpack_from(payload, 4)
            if kind == _CONFIRM_NACK:
                self._nacked.update(range(self._confirmed + 1, tag + 1) if bits & 1 else (tag,))
            self._confirmed = max(self._confirmed, tag)  # one publish waits at a time: in order
        elif kind == _RETURN:
            code = struct.unpack_from(">H", payload, 4)[0]
            self._returned = f"{code} {payload[7 : 7 + payload[6]].decode(errors='replace')}"
            self._content()
        elif kind == _CONNECTION_CLOSE or kind == _CHANNEL_CLOSE:
            code = struct.unpack_from(">H", payload, 4)[0]
            text = payload[7 : 7 + payload[6]].decode(errors="replace")
            with contextlib.suppress(BrokerUnavailable):
                self._write(frames.method(frame.channel, kind[0], kind[1] + 1))  # close-ok
            raise self._lost(f"closed by the broker: {code} {text}")
        elif kind == _SERVER_CANCEL:
            tag = payload[5 : 5 + payload[4]].decode()
            raise self._lost(f"the broker cancelled our consumer of {self._tags.get(tag, tag)!r} (deleted?)")
        elif kind in ((10, 60), (10, 61)):
            log.warning("broker_blocked" if kind == (10, 60) else "broker_unblocked", connection=self._name)

    def _on_deliver(self, payload: bytes) -> None:
        offset = 4
        tag_size = payload[offset]
        consumer_tag = payload[offset + 1 : offset + 1 + tag_size].decode()
        offset += 1 + tag_size
        delivery_tag, redelivered = _DELIVER_TAIL.unpack_from(payload, offset)
        offset += 9
        exchange = payload[offset + 1 : offset + 1 + payload[offset]].decode()
        offset += 1 + payload[offset]
        routing_key = payload[offset + 1 : offset + 1 + payload[offset]].decode()
        properties, body = self._content()
        self._deliveries.append(TaskDelivery(
            body=body, queue=self._tags.get(consumer_tag, routing_key), routing_key=routing_key,
            exchange=exchange, redelivered=bool(redelivered & 1), tag=delivery_tag,
            generation=self.generation,
            content_type=properties.content_type, content_encoding=properties.content_encoding,
            headers=properties.headers or {}, correlation_id=properties.correlation_id,
            reply_to=properties.reply_to, priority=properties.priority,
        ))  # fmt: skip

    def _lost(self, why: str) -> ConnectionLost:
        self.drop()
        return ConnectionLost(f"connection {self._name}: {why}")

    def _beat(self) -> None:
        # While a task runs, nobody else writes: a heartbeat every half interval keeps us alive.
        while self._beating.is_set():
            time.sleep(max(self._heartbeat_s / 2, 0.05))
            with self._lock:
                sock = self._sock
                if (
                    not self._busy
                    or sock is None
                    or time.monotonic() - self._last_write < self._heartbeat_s / 2
                ):
                    continue
                try:
                    sock.sendall(frames.HEARTBEAT)
                    self._last_write = time.monotonic()
                except OSError:
                    continue  # the main thread finds out on its next read
