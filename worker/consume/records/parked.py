"""A consuming child's record of each ETA task it parks in a delay queue (``inspect scheduled``)."""

from __future__ import annotations

from typing import Any

import structlog

from broker_svc.errors import BrokerSvcError, BrokerUnavailable
from broker_svc.topology import scheduled_stream
from broker_svc.wire.records.parked import CONTENT_TYPE, parked_record
from broker_svc.wire.task.task_message import TaskMessage
from worker.consume.replies import FeedReplies

__all__ = ["FeedParked"]

log = structlog.get_logger(__name__)


class FeedParked:
    """Writes a park record to the app's scheduled stream, confirmed before the park's ack.

    Args:
        replies: the child's confirmed publisher.
        hostname: the worker's node name, which lists the task while it waits.
        namespace: the app namespace, which names the stream.
    """

    def __init__(self, replies: FeedReplies, *, hostname: str, namespace: str) -> None:
        self._replies = replies
        self._hostname = hostname
        self._stream = scheduled_stream(namespace)

    def record(self, request: TaskMessage, delivery_info: dict[str, Any]) -> None:
        """Record that ``request`` waits in a delay queue until its ETA.

        A record that cannot be written (the stream refused to this user, say) is logged and the
        task parked all the same: ``inspect scheduled`` misses it, its run does not.

        Raises:
            BrokerUnavailable: the connection is gone (the delivery goes back with it).
        """
        body = parked_record(request, hostname=self._hostname, delivery_info=delivery_info)
        try:
            self._replies.internal(body, content_type=CONTENT_TYPE, encoding="utf-8", queue=self._stream)
        except BrokerUnavailable:
            raise
        except BrokerSvcError as exc:
            log.warning("park_record_failed", queue=self._stream.name, error=str(exc))
