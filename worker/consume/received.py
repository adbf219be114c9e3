"""Announcing a task received: the ``received`` metric, the ``task_received`` signal, the event."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker_svc import signals
from broker_svc.wire.task_message import TaskMessage, eta_and_expires, safe_repr
from worker.events import EventDispatcher

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["announce_received"]


async def announce_received(
    request: TaskMessage,
    queue: str,
    *,
    sender: Any,
    events: EventDispatcher,
    metrics: WorkerMetrics | None,
) -> None:
    """Tell the metrics, the ``task_received`` receivers and (with -E) the event stream about ``request``."""
    if metrics is not None:
        metrics.received(request.task, queue)
    if signals.task_received.has_receivers:
        signals.task_received.send(sender=sender, request=request)
    # Task events are off unless asked for (-E): check before building one, as every task
    # would pay for the reprs and a coroutine otherwise.
    if events.task_events:
        await events.send(
            "task-received",
            uuid=request.id,
            name=request.task,
            args=safe_repr(tuple(request.args)),  # Celery shows argsrepr, a tuple's repr
            kwargs=safe_repr(request.kwargs),
            root_id=request.root_id,
            parent_id=request.parent_id,
            retries=request.retries,
            **eta_and_expires(request),
        )
