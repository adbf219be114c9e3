"""Messages in flight on the blocking side: a publish awaiting its confirm, a consumed delivery.

Pure bookkeeping shared by the connection's I/O thread and the threads that wait on it; no pika.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerSvcError, MessageTooLarge
from broker_svc.settings import Settings
from broker_svc.topology import (
    DEFAULT_EXCHANGE,
    DELAY_HOLD_WINDOW_S,
    QueueSpec,
    QueueType,
    dedup_gate_queue,
    delay_bucket_ms,
    delay_queue,
)
from broker_svc.wire.records.dedup import KEY_HEADER, shard_of
from broker_svc.wire.task.task_message import RESENT_HEADER, TaskMessage, WireMessage, encode_task

__all__ = ["Delivery", "PendingPublish", "prepare_publish"]


def prepare_publish(
    message: TaskMessage,
    *,
    settings: Settings,
    clock: LamportClock,
    queue: str,
    queue_type: QueueType = "classic",
    serializer: str | None = None,
    exchange: str | None = None,
) -> PendingPublish:
    """Stamp the clock, encode and size-check a task: what either client publishes, not sent yet.

    ``Publisher.prepare`` (blocking) and ``broker_svc.aio`` (asyncio) both call this, so the two
    clients put the same bytes on the wire. A task whose ETA is more than ``DELAY_HOLD_WINDOW_S``
    away when it is sent goes to one of ``queue``'s delay queues (``PendingPublish.route``). A task
    with a dedup key (its headers, set by ``build_message``) goes to the key's gate shard queue
    instead, ETA or not; ``queue``, where the gate sends it on, is declared after the shard.

    Raises:
        MessageTooLarge: the body is over ``max_body_bytes`` (checked before publishing).
        TypeError: an argument cannot be encoded, or a dedup key with a named exchange.
    """
    if message.clock is None:
        message = dataclasses.replace(message, clock=clock.forward())
    wire = encode_task(message, serializer=serializer or settings.serializer)
    if len(wire.body) > settings.max_body_bytes:
        raise MessageTooLarge(
            f"task body of {len(wire.body)} bytes is over max_body_bytes={settings.max_body_bytes}"
        )
    key = message.extra_headers.get(KEY_HEADER) if message.extra_headers else None
    if isinstance(key, str):
        # Keyed dedup: to the key's gate shard, which sends it on to ``queue`` (its target header),
        # holds it, or declines it. Never to a delay queue: its worker holds an ETA after the gate.
        if exchange:
            raise TypeError("dedup_key sends to a queue, not to a named exchange; drop exchange=")
        gate = dedup_gate_queue(shard_of(key), settings.namespace)
        return PendingPublish(
            wire, exchange=DEFAULT_EXCHANGE, routing_key=gate.name, declare=(gate, settings.task_queue(queue))
        )
    eta = message.eta
    if eta is not None and eta.tzinfo is None:
        eta = eta.replace(tzinfo=dt.UTC)
    if exchange:
        # Celery's exchange= (a topic route, say): published there with ``queue`` as the routing
        # key, declaring nothing; an ETA is held by the worker that gets it (its delay queues).
        return PendingPublish(wire, exchange=exchange, routing_key=queue)
    return PendingPublish(
        wire,
        exchange=DEFAULT_EXCHANGE,
        routing_key=queue,
        declare=(settings.task_queue(queue),),
        eta_s=eta.timestamp() if eta is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Delivery:
    """A consumed message, as handed to a consumer callback (on the I/O thread)."""

    body: bytes
    content_type: str | None
    correlation_id: str | None
    headers: dict[str, Any]
    routing_key: str
    redelivered: bool


class PendingPublish:
    """One message on its way to the broker, and whether the broker confirmed it.

    Thread-safe: the I/O thread settles it, any thread may wait on it.

    Args:
        message: what to publish.
        exchange: where to publish it.
        routing_key: the queue (for the default exchange) it is for.
        declare: queues declared, in this order, before it goes out on a connection.
        mandatory: have the broker return it when no queue takes it.
        eta_s: for a task with an ETA (wall clock, epoch seconds), published to the default
            exchange: until it is nearly due, it goes to the delay queue of ``routing_key`` that
            matches the time left *as it is sent* (it may wait in the outbox for seconds), and
            that delay queue is declared after the ``declare`` queues.
        best_effort: a side record (a park record for ``inspect scheduled``), not a task: the
            publisher never waits for it nor reports its failure, which ``on_settle`` may log.
    """

    __slots__ = (
        "__weakref__",  # the spool keeps a caller's handle only while the caller does
        "_declare",
        "_done",
        "_event",
        "attempts",
        "best_effort",
        "declare",
        "error",
        "eta_s",
        "exchange",
        "mandatory",
        "message",
        "on_settle",
        "queue",
        "first_sent_at",
        "routing_key",
        "sent_at",
    )

    def __init__(
        self,
        message: WireMessage,
        *,
        exchange: str,
        routing_key: str,
        declare: Sequence[QueueSpec] = (),
        mandatory: bool = True,
        eta_s: float | None = None,
        best_effort: bool = False,
    ) -> None:
        self.message = message
        self.exchange = exchange
        self.queue = routing_key
        self.routing_key = routing_key  # where it is (last) sent: ``queue`` or a delay queue
        self._declare = tuple(declare)
        self.declare = self._declare
        self.mandatory = mandatory
        self.eta_s = eta_s
        self.best_effort = best_effort
        self.attempts = 0
        self.sent_at = 0.0
        self.first_sent_at = 0.0
        self.error: BrokerSvcError | None = None
        # Called once, with this message, when it is settled (on the thread that settles it).
        self.on_settle: Callable[[PendingPublish], None] | None = None
        self._done = False
        self._event: threading.Event | None = None  # made only if someone waits: most never do

    @property
    def queue_declared(self) -> QueueSpec | None:
        """The queue declared before it goes out (its own, not a delay queue), if any."""
        return self._declare[0] if self._declare else None

    def copy(self, *, resent: bool = False) -> PendingPublish:
        """A fresh, unsent copy to publish again; ``resent`` marks it as possibly a duplicate."""
        message = self.message
        if resent and RESENT_HEADER not in message.headers:
            # An earlier send may have been enqueued: the worker then marks the run redelivered.
            message = dataclasses.replace(message, headers={**message.headers, RESENT_HEADER: 1})
        return PendingPublish(
            message,
            exchange=self.exchange,
            routing_key=self.queue,
            declare=self._declare,
            mandatory=self.mandatory,
            eta_s=self.eta_s,
            best_effort=self.best_effort,
        )

    @property
    def done(self) -> bool:
        """True once confirmed or failed for good."""
        return self._done

    def route(self, now_s: float, *, lag_s: float = 0.0) -> None:
        """Send an ETA task to the delay queue for the time it has left, or to its queue.

        Args:
            now_s: the wall clock as it is sent (epoch seconds).
            lag_s: a guess of how much later it reaches its queue (it is sent behind others), and
                a delay queue's TTL only starts then. The guess is trusted for at most half of
                the time left, so a guess off by up to that much still does not bring it back late;
                it only comes back earlier, and the worker parks it again.

        The queue it is for is still declared first: a delay queue's expired messages are dropped
        if the queue they go back to does not exist.
        """
        if self.eta_s is None:
            return
        left_s = self.eta_s - now_s
        if lag_s > 0:
            left_s = min(left_s - lag_s, left_s / 2)
        bucket_ms = delay_bucket_ms(left_s, hold_window_s=DELAY_HOLD_WINDOW_S)
        if bucket_ms is None:
            self.routing_key, self.declare = self.queue, self._declare
        else:
            wait = delay_queue(self.queue, bucket_ms)
            self.routing_key, self.declare = wait.name, (*self._declare, wait)

    def property_fields(self) -> dict[str, Any]:
        """The AMQP properties this send goes out with, as ``amqp_fields.encode_properties`` takes them.

        A resend says so (the earlier send may have been enqueued, so this can be a duplicate).
        Only a task parked in a delay queue keeps its TTL: it dead-letters back to its queue when
        it expires. In its own queue (which has no dead-letter exchange, as Celery declares it)
        the broker would drop it unseen and its caller would wait forever; without a TTL a worker
        takes it and answers REVOKED "expired".
        """
        msg = self.message
        headers = {**msg.headers, RESENT_HEADER: self.attempts} if self.attempts else msg.headers
        return {
            "content_type": msg.content_type,
            "content_encoding": msg.content_encoding,
            "headers": headers,
            "delivery_mode": msg.delivery_mode,
            "priority": msg.priority,
            "correlation_id": msg.correlation_id,
            "reply_to": msg.reply_to,
            "expiration": msg.expiration if self.routing_key != self.queue else None,
        }

    def wait(self, timeout: float | None) -> bool:
        """Wait until settled; True if settled within ``timeout``."""
        if self._done:
            return True
        with _WAIT_LOCK:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def settle(self, error: BrokerSvcError | None = None) -> None:
        """Mark it confirmed (``error`` None) or failed. Called by the I/O thread."""
        with _WAIT_LOCK:
            if self._done:
                return
            self.error = error
            self._done = True
            event = self._event
        if event is not None:
            event.set()
        if self.on_settle is not None:
            self.on_settle(self)


# Guards the lazy creation of a PendingPublish's Event against a concurrent settle; held for a
# few instructions only.
_WAIT_LOCK = threading.Lock()
