"""What the gate tells a declined task's caller and the task-state stream.

Its caller gets a ``DECLINED`` result raising ``TaskDeclined`` (``broker_svc/errors.py``); a task a
worker forwarded for a client that knows no ``DECLINED`` (a Celery client, ``forward.py``) gets a
``REVOKED`` one instead, a state Celery's ``get()`` treats as final.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from broker_svc.wire import codec
from broker_svc.wire.records.dedup import FORWARDED_HEADER
from broker_svc.wire.records.task_state import JobState, StateRecord
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.task.states import State

__all__ = ["declined_record", "declined_result"]

_ERRORS_MODULE: Final = "broker_svc.errors"


def declined_result(
    task_id: str, key: str, headers: Mapping[str, Any], content_type: str | None
) -> tuple[bytes, str, str]:
    """The result message's ``(body, content_type, content_encoding)`` for a declined task."""
    why = f"a task for dedup key {key!r} is already waiting"
    status, error = State.DECLINED, wire_exception("TaskDeclined", why, module=_ERRORS_MODULE)
    if headers.get(FORWARDED_HEADER):
        status, error = State.REVOKED, wire_exception("TaskRevokedError", f"declined: {why}")
    reply_type = content_type if content_type in (codec.JSON, codec.MSGPACK) else codec.JSON
    return codec.encode(Outcome(task_id=task_id, status=status, result=error).to_wire(), reply_type)


def declined_record(
    task_id: str, key: str, headers: Mapping[str, Any], *, queue: str, clock: int, hostname: str
) -> StateRecord:
    """The ``DECLINED`` record of a declined task on the task-state stream."""
    name = headers.get("task")
    return StateRecord.now(
        task_id, JobState.DECLINED.value, clock=clock, hostname=hostname,
        name=name if isinstance(name, str) else None, queue=queue, info={"dedup_key": key},
    )  # fmt: skip
