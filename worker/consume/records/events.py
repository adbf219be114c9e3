"""A consuming child's task events (``-E``): Celery's ``task-*`` events, sent by the child itself.

Best-effort, as the worker's: not mandatory, no confirm awaited, a failure logged and never a
reason to fail a task. The fields are the worker's (``worker/event_fields.py``); the sender's pid
is the child's, as in Celery's prefork pool.
"""

from __future__ import annotations

from typing import Any

import structlog

from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerUnavailable
from broker_svc.topology import event_exchange
from broker_svc.wire.event_fields import encode_event, event_body, routing_key
from broker_svc.wire.task.task_message import WireMessage

__all__ = ["FeedEvents"]

log = structlog.get_logger(__name__)


class FeedEvents:
    """Sends task events while ``enabled`` (``-E``, ``enable_events``; the worker tells each child).

    Args:
        connection: the child's connection.
        hostname: the worker's node name (events name the node, not the child).
        clock: the child's Lamport clock.
        enabled: send task events from the start.
    """

    def __init__(
        self, connection: FeedConnection, *, hostname: str, clock: LamportClock, enabled: bool
    ) -> None:
        self._connection = connection
        self._hostname = hostname
        self._clock = clock
        self._exchange = event_exchange().name
        self.enabled = enabled

    def send(self, event_type: str, **extra: Any) -> None:
        """Publish one task event if enabled; never raises on broker errors."""
        if not self.enabled:
            return
        body = encode_event(event_body(event_type, hostname=self._hostname, clock=self._clock, **extra))
        message = WireMessage(
            body=body, content_type="application/json", content_encoding="utf-8",
            headers={"hostname": self._hostname}, delivery_mode=1,
        )  # fmt: skip
        try:
            self._connection.publish_nowait(message, routing_key(event_type), exchange=self._exchange)
        except BrokerUnavailable as exc:  # the loop reconnects on the next read or ack
            log.warning("event_not_sent", event_type=event_type, error=str(exc))
