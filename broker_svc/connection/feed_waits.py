"""What the threads of a ``SharedFeedConnection`` wait on: a publish's confirm, a settle's write."""

from __future__ import annotations

from broker_svc.connection.feed_delivery import ConnectionLost, TaskDelivery

__all__ = ["PendingPublish", "QueuedSettle"]


class PendingPublish:
    """One publish awaiting its confirm; a basic.return is matched to it by what it sent."""

    __slots__ = ("body", "done", "exchange", "nacked", "returned", "routing_key")

    def __init__(self, exchange: str, routing_key: str, body: bytes) -> None:
        self.exchange, self.routing_key, self.body = exchange, routing_key, body
        self.done = self.nacked = False
        self.returned: str | None = None


class QueuedSettle:
    """An ack or nack queued for the socket: ``done`` once written, or ``failure`` if that failed."""

    __slots__ = ("delivery", "done", "failure", "frame")

    def __init__(self, delivery: TaskDelivery, frame: bytes) -> None:
        self.delivery, self.frame = delivery, frame
        self.done = False
        self.failure: ConnectionLost | None = None
