"""What a consuming child's connection hands out: a task delivery, and the failure that ends it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker_svc.errors import BrokerUnavailable

__all__ = ["ConnectionLost", "TaskDelivery"]


class ConnectionLost(BrokerUnavailable):
    """The connection or its channel is gone; its deliveries go back to their queues.

    Attributes:
        consumer_timeout: the broker closed the channel because a delivery stayed unacked past its
            ``consumer_timeout`` (406 "... timed out").
        cancelled_queue: the queue whose consumer the broker cancelled (deleted, say), if that was it.
        reported: ``FeedConnection.on_close_seen`` told of it already, while a task ran.
    """

    def __init__(
        self, message: str, *, consumer_timeout: bool = False, cancelled_queue: str | None = None
    ) -> None:
        super().__init__(message)
        self.consumer_timeout = consumer_timeout
        self.cancelled_queue = cancelled_queue
        self.reported = False


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
