"""What a consuming child's connection hands out: a task delivery, and the failure that ends it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker_svc.amqp.frames import Properties
from broker_svc.errors import BrokerUnavailable

__all__ = ["ConnectionLost", "TaskDelivery"]


class ConnectionLost(BrokerUnavailable):
    """The connection or its channel is gone; its deliveries go back to their queues.

    Attributes:
        consumer_timeout: the broker closed the channel because a delivery stayed unacked past its
            ``consumer_timeout`` (406 "... timed out").
        cancelled_queue: the queue whose consumer the broker cancelled (deleted, say), if that was it.
        reported: told of already (``FeedConnection.on_close_seen``, while a task ran), or found
            gone by a thread that did not see it fail (the one that did tells it).
        generation: the connection it ended (``SharedFeedConnection``), once known.
    """

    def __init__(
        self,
        message: str,
        *,
        consumer_timeout: bool = False,
        cancelled_queue: str | None = None,
        reported: bool = False,
    ) -> None:
        super().__init__(message)
        self.consumer_timeout = consumer_timeout
        self.cancelled_queue = cancelled_queue
        self.reported = reported
        self.generation: int | None = None

    def again(self) -> ConnectionLost:
        """The same loss, to raise in another thread (which its first raise did not reach)."""
        copy = ConnectionLost(
            str(self), consumer_timeout=self.consumer_timeout, cancelled_queue=self.cancelled_queue
        )
        copy.reported, copy.generation = self.reported, self.generation
        return copy


# Not frozen: a child builds one per delivery, and a frozen dataclass's __init__ costs about
# three times as much (a setattr call per field). Nobody changes one once built.
@dataclass(slots=True)
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
    # The whole content header, for what Celery shows a task as ``request.properties``.
    properties: Properties | None = None
