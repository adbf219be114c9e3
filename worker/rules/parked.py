"""The record of an ETA task a worker parked in a delay queue (``topology.scheduled_stream``).

A child that parks a task not yet due writes one, confirmed before the ack; the worker's main
process reads them all (``worker/remote/scheduled.py``) and lists, in ``inspect scheduled``, the
tasks whose latest park was its own and whose ETA has not passed: Celery's ``scheduled`` reply,
``{"eta", "priority", "request": TASK_INFO}``. Pure: encoding and decoding, no I/O.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.wire.task_message import TaskMessage

__all__ = ["CONTENT_TYPE", "Parked", "parked_record"]

CONTENT_TYPE: Final = "application/x-clockwork-parked+json"


@dataclass(frozen=True, slots=True)
class Parked:
    """One park: which task, until when, by which worker, and its TASK_INFO."""

    task_id: str
    eta: float  # epoch seconds
    hostname: str
    info: dict[str, Any]
    priority: int | None = None

    def reply(self) -> dict[str, Any]:
        """Celery's ``scheduled`` entry for it."""
        eta = dt.datetime.fromtimestamp(self.eta, dt.UTC).isoformat()
        return {"eta": eta, "priority": self.priority, "request": self.info}

    @classmethod
    def decode(cls, body: bytes) -> Parked:
        """A record read back.

        Raises:
            MessageError: not a park record.
        """
        try:
            data = json.loads(body)
            if not isinstance(data, Mapping) or not isinstance(data.get("info"), Mapping):
                raise ValueError("not a map with an info map")
            priority = data.get("priority")
            return cls(
                task_id=str(data["id"]),
                eta=float(data["eta"]),
                hostname=str(data["hostname"]),
                info=dict(data["info"]),
                priority=priority if isinstance(priority, int) else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MessageError(f"not a park record: {exc}") from exc


def parked_record(request: TaskMessage, *, hostname: str, delivery_info: dict[str, Any]) -> bytes:
    """The record of ``request`` parked by ``hostname`` (its ETA must be set)."""
    assert request.eta is not None
    info = {
        "id": request.id,
        "name": request.task,
        "args": request.args,
        "kwargs": request.kwargs,
        "type": request.task,
        "hostname": hostname,
        "time_start": None,
        "acknowledged": False,
        "delivery_info": delivery_info,
        "worker_pid": None,
    }
    record = {
        "id": request.id,
        "eta": request.eta.timestamp(),
        "hostname": hostname,
        "priority": request.priority,
        "info": info,
    }
    # default=repr: arguments the task's own serializer carried but JSON cannot are shown as reprs.
    return json.dumps(record, default=repr).encode()
