"""A consuming child's records on the task-state stream (``task_states``): STARTED and each outcome.

Best-effort as events are, but confirmed: a record is on the stream before the delivery it
describes is acked, so a reader never sees a task finished in its queue and STARTED forever. A
record that cannot be written is logged and never fails the task.
"""

from __future__ import annotations

from typing import Any

import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerSvcError
from broker_svc.topology import task_states_stream
from broker_svc.wire.records.task_state import CONTENT_TYPE, StateRecord, worker_info
from broker_svc.wire.task.task_message import TaskMessage
from worker.consume.replies import FeedReplies

__all__ = ["FeedStates"]

log = structlog.get_logger(__name__)


class FeedStates:
    """Writes a task's states to the stream while ``enabled``.

    Args:
        replies: the child's confirmed publisher.
        hostname: the worker's node name.
        clock: the child's Lamport clock.
        enabled: ``Settings.task_states``.
        namespace: the app namespace, which names the stream.
    """

    def __init__(
        self, replies: FeedReplies, *, hostname: str, clock: LamportClock, enabled: bool, namespace: str
    ) -> None:
        self._replies = replies
        self._hostname = hostname
        self._clock = clock
        self.enabled = enabled
        self._stream = task_states_stream(namespace)

    def record(self, request: TaskMessage, state: str, result: Any = None) -> None:
        """Append ``state`` of ``request`` (an error ``result`` is summed up in the record)."""
        if not self.enabled:
            return
        record = StateRecord.now(
            request.id, state, clock=self._clock.forward(), hostname=self._hostname, name=request.task,
            info=worker_info(state, result),
        )  # fmt: skip
        try:
            self._replies.internal(
                record.encode(), content_type=CONTENT_TYPE, encoding="utf-8", queue=self._stream
            )
        except BrokerSvcError as exc:
            log.warning("task_state_not_written", state=state, error=str(exc))
