"""A consuming pool child's own connection: one socket, one channel, read and written by the child itself.

Why not pika: at one delivery in flight per child, pika's layers (an I/O loop, a thread hop per
ack, frame objects) cost more CPU than the rest of the child (BENCHMARKS.md). This does what a
consumer needs on the calling thread: consume with a prefetch, ack, nack, publish with a confirm
(one at a time), declare a queue; frames by ``broker_svc/amqp/frames.py``.

The socket, its frames, the handshake and the heartbeat thread are ``FrameSocket``'s
(``broker_svc/amqp/frame_socket.py``); this class is the channel's conversation on top.
Threads: the child's main thread does everything while no task runs; while one does, a heartbeat
thread writes heartbeats and the hard time limit's watchdog may take the socket over, one at a
time (the lock). Under ``--threads``, see ``SharedFeedConnection``.

Any failure is :class:`ConnectionLost`: the socket is dropped, what it delivered is the broker's
again (settles of an earlier ``generation`` are not sent), and the caller connects again. Each
connect declares the queues it was given before consuming them, so a queue deleted under the
consumer (the broker's basic.cancel) is there again, declared as before, when it consumes anew.
"""

from __future__ import annotations

import collections
import contextlib
import struct
import time
from collections.abc import Sequence
from typing import Final

from broker_svc.amqp import frames, methods
from broker_svc.amqp.delivery import ConnectionLost, TaskDelivery
from broker_svc.amqp.frame_socket import CHANNEL_CLOSE, CONNECTION_CLOSE, FrameSocket, closed_by_broker
from broker_svc.amqp.methods import BASIC_ACK, BASIC_NACK, BASIC_RETURN
from broker_svc.amqp.peek import peeked_deliveries, task_delivery
from broker_svc.errors import BrokerUnavailable, PublishNacked, Unroutable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_properties, encode_table
from broker_svc.wire.task_message import WireMessage

__all__ = ["ConnectionLost", "FeedConnection", "TaskDelivery"]

log = get_logger(__name__)

_CHANNEL: Final = 1
_DELIVER: Final = (60, 60)
_SERVER_CANCEL: Final = (60, 30)
_U64_BIT = struct.Struct(">QB")


class FeedConnection(FrameSocket):
    """Consumes task queues and publishes with confirms, on the calling thread.

    Args:
        settings: broker URLs (failover order), heartbeat, timeouts, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        queues: the queues to consume.
        prefetch: unacked deliveries the broker may send at once.
        declare: queues (with their exchange and binding) declared on every connect before
            consuming, exactly as the worker declares them: a queue deleted meanwhile comes back.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        queues: Sequence[str],
        prefetch: int,
        declare: Sequence[QueueSpec] = (),
    ) -> None:
        super().__init__(settings, name=name)
        self._queues = tuple(queues)
        self._declare_on_connect = tuple(declare)
        self._prefetch = prefetch
        self._held = 0  # parked copies on this connection, each one more unacked (``hold``)
        # Ordered queues (x-single-active-consumer) are consumed with prefetch 1 whatever ``prefetch``.
        self._ordered = frozenset(spec.name for spec in declare if spec.single_active)
        self._deliveries: collections.deque[TaskDelivery] = collections.deque()
        self._tags: dict[str, str] = {}  # consumer tag -> queue
        self._declared: set[str] = set()
        self._published = 0  # publish sequence number of this channel
        self._confirmed = 0  # every publish up to this one is confirmed
        self._nacked: set[int] = set()
        self._returned: str | None = None  # why the broker returned the last publish
        self.generation = 0  # one more for each connection: settles of an older one are not sent
        self._checked = False  # check() was the last call: nothing to read before the next delivery

    # -- connecting ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the first broker that answers, in failover order, and consume.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        url = self._open_first(self._open)
        self._start_beating()
        log.debug("feed_connected", connection=self._name, url=redact_url(url))

    def _open(self, url: str) -> None:
        # A new generation before the socket: what the consumes below deliver is this connection's.
        self.generation += 1
        self._held = 0
        tls = self._handshake(url)
        self._deliveries.clear()
        self._checked = False
        self._tags.clear()
        self._declared.clear()
        self._published = self._confirmed = 0
        self._nacked.clear()
        self._expect((20, 11), send=frames.method(_CHANNEL, 20, 10, b"\x00"))
        self._expect((85, 11), send=frames.method(_CHANNEL, 85, 10, b"\x00"))  # confirm.select
        self._qos(self._prefetch)
        for spec in self._declare_on_connect:
            self._declare(spec)
        for queue in self._queues:
            self._consume(queue)
        self._set_wake(tls)

    # -- consuming -------------------------------------------------------------------------------

    def next_delivery(self, timeout_s: float | None) -> TaskDelivery | None:
        """The next delivery, waiting up to ``timeout_s`` (None: until one comes); None if none came.

        Raises:
            ConnectionLost: the connection failed, or the broker went silent past two heartbeats.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # First whatever came while a task ran, without waiting: a channel the broker closed
        # under that task (consumer_timeout) took back what was prefetched behind it, which may
        # run elsewhere already and must not run here as well (one select() when nothing came).
        if not self._checked:
            self._read_arrived()
        self._checked = False
        while not self._deliveries:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            self._pump()
        return self._deliveries.popleft()

    def held(self) -> list[TaskDelivery]:
        """Deliveries no consumer has taken yet: read already, or (while a task runs) in the socket."""
        with self._lock:  # a task's start and end take it: while one runs nobody reads the socket
            return self._holding(peek=self._busy)

    def _holding(self, *, peek: bool) -> list[TaskDelivery]:
        sock, unparsed = self._sock if peek else None, bytes(self._buffer)
        peeked = [] if sock is None else peeked_deliveries(sock, unparsed, self._tags, self.generation)
        return [] if peeked is None else [*self._deliveries, *peeked]  # None: the broker took them back

    def check(self, delivery: TaskDelivery | None = None) -> None:
        """Handle what arrived meanwhile, without waiting: a close the broker sent raises here.

        Raises:
            ConnectionLost: the connection failed, or the broker closed the channel.
        """
        self._read_arrived()
        # The consumer checks after each settle and asks for its next delivery right after: that
        # call need not look again (a select() per task saved).
        self._checked = True

    def hold(self, delta: int, generation: int) -> None:
        """``delta`` more (or fewer) unacked deliveries (parked copies); ignored for an older generation.

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        if generation == self.generation:
            self._held += delta
            self._qos(self._prefetch + self._held)

    def ack(self, delivery: TaskDelivery) -> None:
        """Ack ``delivery``; not sent if its connection is gone (the broker requeued it).

        Raises:
            ConnectionLost: the write failed.
        """
        self._settle_frame(delivery, frames.method(_CHANNEL, 60, 80, _U64_BIT.pack(delivery.tag, 0)))

    def nack(self, delivery: TaskDelivery, *, requeue: bool) -> None:
        """Nack ``delivery`` (back to its queue with ``requeue``); not sent if its connection is gone.

        Raises:
            ConnectionLost: the write failed.
        """
        self._settle_frame(
            delivery, frames.method(_CHANNEL, 60, 120, _U64_BIT.pack(delivery.tag, 2 if requeue else 0))
        )

    def _settle_frame(self, delivery: TaskDelivery, frame: bytes) -> None:
        # Written only on the connection that delivered it: a tag means nothing on another.
        if self._current(delivery):
            self._write(frame)

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

    @property
    def ordered(self) -> bool:
        """Whether an ordered queue is consumed: a stop then closes the connection, which requeues
        and moves the queue on in one step (handed back while subscribed, its delivery would come
        after the next one, which the broker gives the next consumer first)."""
        return any(queue in self._ordered for queue in self._queues)

    def _consume(self, queue: str) -> None:
        if queue in self._ordered and self._prefetch != 1:
            # basic.qos (per consumer) binds the consumers made after it: this one alone gets 1.
            self._qos(1)
            try:
                self._subscribe(queue)
            finally:
                self._qos(self._prefetch + self._held)
            return
        self._subscribe(queue)

    def _qos(self, count: int) -> None:
        self._expect((60, 11), send=frames.method(_CHANNEL, 60, 10, struct.pack(">IHB", 0, count, 0)))

    def _subscribe(self, queue: str) -> None:
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
        try:
            self._publish(message, routing_key, exchange=exchange, declare=declare)
        except Unroutable:
            # A queue declared once on this connection may have been deleted since (a dead-letter
            # queue removed by hand): declare it again and send once more.
            stale = {spec.name for spec in declare} & self._declared
            if not stale:
                raise
            log.warning("feed_queue_declared_again", queues=sorted(stale))
            self._declared -= stale
            self._publish(message, routing_key, exchange=exchange, declare=declare)

    def _publish(
        self, message: WireMessage, routing_key: str, *, exchange: str, declare: Sequence[QueueSpec]
    ) -> None:
        for spec in declare:
            if spec.name not in self._declared:
                self._declare(spec)
        self._returned = None
        self._write(self._publish_frames(message, routing_key, exchange=exchange, mandatory=True))
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
        self._write(self._publish_frames(message, routing_key, exchange=exchange, mandatory=False))
        self._published += 1  # its confirm comes in order before any later one's

    def _publish_frames(
        self, message: WireMessage, routing_key: str, *, exchange: str, mandatory: bool
    ) -> bytes:
        # Mandatory (results, copies): every property; best-effort (events, releases): these four.
        properties = (
            encode_properties(
                content_type=message.content_type, content_encoding=message.content_encoding,
                headers=message.headers, delivery_mode=message.delivery_mode, priority=message.priority,
                correlation_id=message.correlation_id, reply_to=message.reply_to,
                expiration=message.expiration,
            )
            if mandatory
            else encode_properties(
                content_type=message.content_type, content_encoding=message.content_encoding,
                headers=message.headers, delivery_mode=message.delivery_mode,
            )
        )  # fmt: skip
        return frames.publish_frames(
            _CHANNEL, exchange=exchange, routing_key=routing_key, mandatory=mandatory,
            properties=properties, body=message.body, frame_max=self._frame_max,
        )  # fmt: skip

    def _declare(self, spec: QueueSpec) -> None:
        for answer, frame in methods.declare_frames(_CHANNEL, spec):
            self._expect(answer, send=frame)
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

    # -- frames ----------------------------------------------------------------------------------

    def _current(self, delivery: TaskDelivery) -> bool:
        if delivery.generation == self.generation and self._sock is not None:
            return True
        log.info("task_settle_dropped_channel_gone", tag=delivery.tag, queue=delivery.queue)
        return False

    def _dispatch(self, frame: frames.Frame) -> None:
        if frame.type != frames.FRAME_METHOD:
            return  # heartbeats (and stray content, which cannot happen on a sound stream)
        kind, payload = frame.method_id, frame.payload
        if kind == _DELIVER:
            self._on_deliver(payload)
        elif kind == BASIC_ACK or kind == BASIC_NACK:
            tag, bits = _U64_BIT.unpack_from(payload, 4)
            if kind == BASIC_NACK:
                self._nacked.update(range(self._confirmed + 1, tag + 1) if bits & 1 else (tag,))
            self._confirmed = max(self._confirmed, tag)  # one publish waits at a time: in order
        elif kind == BASIC_RETURN:
            code, text = methods.close_reason(payload)
            self._returned = f"{code} {text}"
            self._content()
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
        elif kind in ((10, 60), (10, 61)):
            log.warning("broker_blocked" if kind == (10, 60) else "broker_unblocked", connection=self._name)

    def _on_deliver(self, payload: bytes) -> None:
        deliver = methods.parse_deliver(payload)
        properties, body = self._content()
        queue = self._tags.get(deliver.consumer_tag, deliver.routing_key)
        self._deliveries.append(task_delivery(deliver, properties, body, queue, self.generation))
