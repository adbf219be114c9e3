"""The worker's records on the task-state stream (``task_states``) under ``--worker-consumes``.

The asyncio counterpart of ``worker/feed/states.py``: STARTED as a run begins, each outcome as it
is answered, confirmed before the delivery is acked; a record that cannot be written is logged.
"""

from __future__ import annotations

from typing import Any

import aio_pika.exceptions
import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerSvcError
from broker_svc.topology import task_states_stream
from broker_svc.wire.task_message import TaskMessage
from broker_svc.wire.task_state import CONTENT_TYPE, StateRecord, worker_info
from worker.consume.publish import ReplyPublisher

__all__ = ["TaskStates"]

log = structlog.get_logger(__name__)


class TaskStates:
    """Writes a task's states to the stream while ``enabled``.

    Args:
        replies: the worker's confirmed publisher.
        hostname: the worker's node name.
        clock: the worker's Lamport clock.
        enabled: ``Settings.task_states``.
    """

    def __init__(self, replies: ReplyPublisher, *, hostname: str, clock: LamportClock, enabled: bool) -> None:
        self._replies = replies
        self._hostname = hostname
        self._clock = clock
        self.enabled = enabled
        self._stream = task_states_stream()

    async def record(self, request: TaskMessage, state: str, result: Any = None) -> None:
        """Append ``state`` of ``request`` (an error ``result`` is summed up in the record)."""
        if not self.enabled:
            return
        record = StateRecord.now(
            request.id, state, clock=self._clock.forward(), hostname=self._hostname, name=request.task,
            info=worker_info(state, result),
        )  # fmt: skip
        try:
            await self._replies.publish_to(
                record.encode(), content_type=CONTENT_TYPE, encoding="utf-8", queue=self._stream
            )
        except (BrokerSvcError, aio_pika.exceptions.AMQPError) as exc:
            log.warning("task_state_not_written", state=state, error=str(exc) or type(exc).__name__)
