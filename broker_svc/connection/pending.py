"""Messages in flight on the blocking side: a publish awaiting its confirm, a consumed delivery.

Pure bookkeeping shared by the connection's I/O thread and the threads that wait on it; no pika.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker_svc.errors import BrokerSvcError
from broker_svc.topology import DELAY_HOLD_WINDOW_S, QueueSpec, delay_bucket_ms, delay_queue
from broker_svc.wire.task_message import WireMessage

__all__ = ["Delivery", "PendingPublish"]


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
    """

    __slots__ = (
        "_declare",
        "_done",
        "_event",
        "attempts",
        "declare",
        "error",
        "eta_s",
        "exchange",
        "mandatory",
        "message",
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
    ) -> None:
        self.message = message
        self.exchange = exchange
        self.queue = routing_key
        self.routing_key = routing_key  # where it is (last) sent: ``queue`` or a delay queue
        self._declare = tuple(declare)
        self.declare = self._declare
        self.mandatory = mandatory
        self.eta_s = eta_s
        self.attempts = 0
        self.sent_at = 0.0
        self.first_sent_at = 0.0
        self.error: BrokerSvcError | None = None
        self._done = False
        self._event: threading.Event | None = None  # made only if someone waits: most never do

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


# Guards the lazy creation of a PendingPublish's Event against a concurrent settle; held for a
# few instructions only.
_WAIT_LOCK = threading.Lock()
