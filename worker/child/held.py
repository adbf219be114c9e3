"""What a consuming child holds and has not started, for ``inspect reserved`` and ``query_task``.

With ``--prefetch-multiplier`` above 1, or ``--threads``, the broker sends a child deliveries
before a thread is free to run them. They are on no board (a board slot shows what runs), so the
worker asks each child when an operator asks it (``worker/pool/feeding.py``: ``Feeding.held``),
and the child's control thread answers from its connection (``FeedConnection.held``): nothing is
written per task. A delivery that does not decode is shown by its ``id`` and ``task`` headers; the
consumer dead-letters it when it takes it, as always.
"""

from __future__ import annotations

from typing import Any

import structlog

from broker_svc.amqp.feed_connection import FeedConnection, TaskDelivery
from broker_svc.errors import MessageError
from broker_svc.settings import Settings
from broker_svc.wire import codec
from broker_svc.wire.task.task_message import decode_task, safe_repr
from worker import ipc
from worker.rules.job_request import delivery_info

__all__ = ["held_frame", "held_tasks"]

log = structlog.get_logger(__name__)


def held_frame(connection: FeedConnection, settings: Settings, *, seq: object, pid: int) -> bytes:
    """The child's answer to the worker's ``held`` frame ``seq``: each held task's info.

    Arguments msgpack cannot carry (a huge int) go as their reprs. A failure is logged and
    answered with an error: the control thread that asks goes on.
    """
    try:
        tasks = held_tasks(connection, settings)
    except Exception as exc:
        log.exception("feed_held_failed")
        return ipc.encode_frame({"op": "held", "seq": seq, "pid": pid, "tasks": [], "error": str(exc)})
    try:
        return ipc.encode_frame({"op": "held", "seq": seq, "pid": pid, "tasks": tasks})
    except TypeError:
        shown = [
            {**task, "args": safe_repr(task["args"]), "kwargs": safe_repr(task["kwargs"])} for task in tasks
        ]
        return ipc.encode_frame({"op": "held", "seq": seq, "pid": pid, "tasks": shown})


def held_tasks(connection: FeedConnection, settings: Settings) -> list[dict[str, Any]]:
    """Celery's task info (less what the worker adds) of each delivery ``connection`` holds unstarted."""
    accept = codec.accept_set(settings.accept_content)
    return [info for delivery in connection.held() if (info := _info(delivery, accept, settings)) is not None]


def _info(delivery: TaskDelivery, accept: frozenset[str], settings: Settings) -> dict[str, Any] | None:
    try:
        request = decode_task(
            delivery.body, delivery.headers, content_type=delivery.content_type, accept=accept,
            max_bytes=settings.max_body_bytes, correlation_id=delivery.correlation_id,
            reply_to=delivery.reply_to, priority=delivery.priority,
        )  # fmt: skip
    except MessageError:
        task_id, name = delivery.headers.get("id"), delivery.headers.get("task")
        if not isinstance(task_id, str):
            return None  # nothing to name it by
        name = name if isinstance(name, str) else None
        return {"id": task_id, "name": name, "type": name, "args": None, "kwargs": None,
                "delivery_info": delivery_info(delivery)}  # fmt: skip
    return {
        "id": request.id,
        "name": request.display_name,
        "type": request.task,
        "args": request.args,
        "kwargs": request.kwargs,
        "delivery_info": delivery_info(delivery),
    }
