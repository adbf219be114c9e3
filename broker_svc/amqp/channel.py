"""One AMQP channel's protocol over a ``FrameSocket``: the one core of our own client.

What every connection of ``broker_svc/amqp/`` says on its channel, written once: channel.open
(and confirm.select), basic.qos, the declares, basic.consume and basic.cancel, publish with
confirms matched by sequence number (a basic.return matched to the publish that sent the same
bytes, ``waits.mark_returned``), ack and nack frames, the close handshakes both ways, and the
dispatch of every method the broker sends unasked (deliveries, confirms, returns, closes, a
cancel of our consumer, connection.blocked and unblocked).

Concurrency is not this module's: its methods assume the calling thread may read the socket
(one reader, as ``FeedConnection`` and ``LeaseConnection`` are used). The few places where
threads would meet are hooks a policy overrides: where a publish waits for its confirm
(``_await_confirm``), where a settle frame is written (``_settle_frame``), and where the
publishes awaiting confirms are changed (``_track``, ``_forget``, ``_on_confirm``,
``_on_returned``). ``SharedFeedConnection`` overrides them for threads that share one connection
(leader/follower reads, ``_state``); the single-threaded path takes no extra lock.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Sequence
from typing import Final

from broker_svc.amqp import frames, methods
from broker_svc.amqp.frame_socket import CHANNEL_CLOSE, CONNECTION_CLOSE, FrameSocket, closed_by_broker
from broker_svc.amqp.methods import BASIC_ACK, BASIC_NACK, BASIC_RETURN
from broker_svc.amqp.waits import PendingPublish, mark_returned
from broker_svc.errors import BrokerUnavailable, PublishNacked, Unroutable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_table

__all__ = ["CHANNEL", "Channel"]

log = get_logger(__name__)

CHANNEL: Final = 1  # the one channel of every connection here
_DELIVER: Final = (60, 60)
_SERVER_CANCEL: Final = (60, 30)
_BLOCKED: Final = (10, 60)
_UNBLOCKED: Final = (10, 61)
_U64_BIT: Final = struct.Struct(">QB")
_QOS: Final = struct.Struct(">IHB")
# Cancelled consumers remembered (a prefetch change makes one per queue): a delivery on its way
# when its consumer was cancelled comes at once, so a few are plenty.
_RETIRED_KEPT: Final = 64


class Channel(FrameSocket):
    """The channel's conversation on one socket; subclasses say what a delivery becomes.

    Args:
        settings: broker URLs (failover order), heartbeat, timeouts, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.

    Attributes:
        generation: one more for each connection made (the subclass counts): a delivery tag
            means something only on the connection that delivered it.
        blocked: why the broker blocks this connection's publishes (``connection.blocked``: a
            resource alarm), or None while it does not.
    """

    def __init__(self, settings: Settings, *, name: str) -> None:
        super().__init__(settings, name=name)
        self._tags: dict[str, str] = {}  # consumer tag -> queue
        # Cancelled consumers' tags -> queue: deliveries sent before the cancel still name them.
        self._retired: dict[str, str] = {}
        self._declared: set[str] = set()  # queues declared on this connection
        self._published = 0  # publish sequence number of this channel (confirm mode)
        self._pending: dict[int, PendingPublish] = {}  # sequence number -> publish awaiting its confirm
        self.generation = 0
        self.blocked: str | None = None

    # -- opening ---------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the first broker that answers (failover order), open the channel, consume
        (the subclass's, which says what it consumes).

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        raise NotImplementedError

    def _open_channel(self, *, confirms: bool) -> None:
        """channel.open (and confirm.select) on a connection just opened: a fresh channel's state."""
        self._tags.clear()
        self._retired.clear()
        self._declared.clear()
        self._published = 0  # confirm numbers start again (publishes of an older one fail apart)
        self.blocked = None
        self._expect((20, 11), send=frames.method(CHANNEL, 20, 10, b"\x00"))
        if confirms:
            self._expect((85, 11), send=frames.method(CHANNEL, 85, 10, b"\x00"))

    def _qos(self, count: int) -> None:
        self._expect((60, 11), send=frames.method(CHANNEL, 60, 10, _QOS.pack(0, count, 0)))

    def _declare(self, spec: QueueSpec) -> None:
        for answer, frame in methods.declare_frames(CHANNEL, spec):
            self._expect(answer, send=frame)
        self._declared.add(spec.name)

    def _subscribe(self, queue: str) -> str:
        """basic.consume of ``queue``; its consumer tag."""
        arguments = b"\x00\x00" + frames.short_string(queue) + b"\x00" + b"\x00" + encode_table({})
        ok = self._expect((60, 21), send=frames.method(CHANNEL, 60, 20, arguments))
        tag = ok[5 : 5 + ok[4]].decode()
        self._tags[tag] = queue
        return tag

    def _unsubscribe(self, tag: str) -> None:
        """basic.cancel of one of our consumers, once the broker's cancel-ok came."""
        self._expect((60, 31), send=frames.method(CHANNEL, 60, 30, frames.short_string(tag) + b"\x00"))
        self._retired[tag] = self._tags.pop(tag)
        if len(self._retired) > _RETIRED_KEPT:
            del self._retired[next(iter(self._retired))]

    # -- settling --------------------------------------------------------------------------------

    @staticmethod
    def _ack_frame(tag: int) -> bytes:
        return frames.method(CHANNEL, 60, 80, _U64_BIT.pack(tag, 0))

    @staticmethod
    def _nack_frame(tag: int, *, requeue: bool) -> bytes:
        return frames.method(CHANNEL, 60, 120, _U64_BIT.pack(tag, 2 if requeue else 0))

    # -- publishing ------------------------------------------------------------------------------

    def _content_frames(
        self, properties: bytes, body: bytes, routing_key: str, *, exchange: str, mandatory: bool
    ) -> bytes:
        """basic.publish, its header and body frames (each within the broker's ``frame_max``)."""
        return frames.publish_frames(
            CHANNEL, exchange=exchange, routing_key=routing_key, mandatory=mandatory,
            properties=properties, body=body, frame_max=self._frame_max,
        )  # fmt: skip

    def _publish_unconfirmed(self, data: bytes) -> None:
        """Write a publish nobody waits for; in confirm mode it takes a sequence number too."""
        with self._lock:  # the socket lock: a sequence number is a place among the channel's writes
            self._write(data)
            self._published += 1

    def _publish_confirmed(self, data: bytes, waiting: PendingPublish, routing_key: str) -> None:
        """Write a publish (mandatory, confirm mode) and wait for its confirm.

        Raises:
            Unroutable: the broker returned it (no queue took it).
            PublishNacked: the broker refused it.
            ConnectionLost: the connection failed, or no confirm came within ``confirm_timeout_s``.
        """
        self._publish_all_confirmed([(data, waiting, routing_key)])

    def _publish_all_confirmed(self, publishes: Sequence[tuple[bytes, PendingPublish, str]]) -> None:
        """Write publishes (each ``(frames, waiting, routing_key)``) at once and wait for every confirm:
        one round trip for all of them, not one each.

        Raises:
            Unroutable: the broker returned one (no queue took it); the first such is named.
            PublishNacked: the broker refused one.
            ConnectionLost: the connection failed, or a confirm did not come within ``confirm_timeout_s``.
        """
        tracked: list[tuple[int, PendingPublish]] = []
        with self._lock:
            generation = self.generation
            for _data, waiting, _key in publishes:
                self._published += 1
                tracked.append((self._published, waiting))
                self._track(self._published, waiting)
            try:
                self._write(b"".join(data for data, _waiting, _key in publishes))
            except BaseException:
                for sequence, waiting in tracked:
                    self._forget(sequence, waiting)
                raise
        try:
            for _sequence, waiting in tracked:
                self._await_confirm(waiting, generation)
        finally:
            for sequence, waiting in tracked:
                self._forget(sequence, waiting)
        for _data, waiting, routing_key in publishes:
            if waiting.nacked:
                raise PublishNacked(f"the broker refused a message to {routing_key!r}")
            if waiting.returned is not None:
                raise Unroutable(f"no queue took a message to {routing_key!r} ({waiting.returned})")

    def _track(self, sequence: int, waiting: PendingPublish) -> None:
        self._pending[sequence] = waiting

    def _forget(self, sequence: int, waiting: PendingPublish) -> None:
        if self._pending.get(sequence) is waiting:  # numbers start again on a new connection
            del self._pending[sequence]

    def _await_confirm(self, waiting: PendingPublish, generation: int) -> None:
        """Read (the calling thread) until ``waiting`` is confirmed or nacked."""
        deadline = time.monotonic() + self._settings.confirm_timeout_s
        while not waiting.done:
            if time.monotonic() >= deadline:
                raise self._lost(f"no confirm within {self._settings.confirm_timeout_s} s")
            self._pump()

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Close politely (connection.close, a moment for the broker's close-ok), then drop the socket.

        Unacked deliveries go back to their queues.
        """
        if self._sock is not None:
            with contextlib.suppress(BrokerUnavailable, OSError, frames.FrameError):
                close = frames.method(
                    0, 10, 50, struct.pack(">H", 200) + frames.short_string("bye") + b"\x00" * 4
                )
                self._expect((10, 51), send=close, timeout_s=1.0)
        self.drop()
        self._beating.clear()

    # -- what the broker sends unasked -----------------------------------------------------------

    def _on_deliver(self, payload: bytes) -> None:
        """A basic.deliver: read its content and keep it (the subclass's)."""
        raise NotImplementedError

    def _dispatch(self, frame: frames.Frame) -> None:
        if frame.type != frames.FRAME_METHOD:
            return  # heartbeats (and stray content, which cannot happen on a sound stream)
        kind, payload = frame.method_id, frame.payload
        if kind == _DELIVER:
            self._on_deliver(payload)
        elif kind == BASIC_ACK or kind == BASIC_NACK:
            tag, bits = _U64_BIT.unpack_from(payload, 4)
            self._on_confirm(tag, multiple=bool(bits & 1), nacked=kind == BASIC_NACK)
        elif kind == BASIC_RETURN:
            self._on_return(payload)
        elif kind == CONNECTION_CLOSE or kind == CHANNEL_CLOSE:
            with contextlib.suppress(BrokerUnavailable):
                self._write(frames.method(frame.channel, kind[0], kind[1] + 1))  # close-ok
            why, timed_out = closed_by_broker(payload)
            raise self._lost(why, consumer_timeout=timed_out)
        elif kind == _SERVER_CANCEL:
            tag = payload[5 : 5 + payload[4]].decode()
            queue = self._tags.get(tag, tag)
            why = f"the broker cancelled our consumer of {queue!r} (deleted?)"
            raise self._lost(why, cancelled_queue=queue)
        elif kind == _BLOCKED:
            self.blocked = payload[5 : 5 + payload[4]].decode(errors="replace") or "blocked"
            log.warning("broker_blocked", connection=self._name, reason=self.blocked)
        elif kind == _UNBLOCKED:
            self.blocked = None
            log.warning("broker_unblocked", connection=self._name)

    def _on_confirm(self, tag: int, *, multiple: bool, nacked: bool) -> None:
        """A basic.ack or basic.nack of a publish: every one it covers is done."""
        for sequence, waiting in self._pending.items():
            if sequence == tag or (multiple and sequence < tag):
                waiting.done, waiting.nacked = True, nacked

    def _on_return(self, payload: bytes) -> None:
        # The broker returns an unroutable publish before confirming it; the return does not name
        # its sequence number, so it goes to the oldest waiting publish that sent the same thing.
        code, text = methods.close_reason(payload)
        at = 7 + payload[6]
        exchange = payload[at + 1 : at + 1 + payload[at]].decode()
        at += 1 + payload[at]
        routing_key = payload[at + 1 : at + 1 + payload[at]].decode()
        _properties, body = self._content()
        self._on_returned(exchange, routing_key, body, why=f"{code} {text}")

    def _on_returned(self, exchange: str, routing_key: str, body: bytes, *, why: str) -> None:
        mark_returned(self._pending, exchange, routing_key, body, why=why)
