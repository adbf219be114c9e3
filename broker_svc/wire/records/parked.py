"""The record of an ETA task parked in a delay queue (``topology.scheduled_stream``).

Two writers: a worker's child that parks a task not yet due (confirmed before the ack, with its
worker's node name), and our client that sends a task straight to a delay queue (no node name:
no worker holds it yet). Every worker's main process reads them all (``worker/remote/scheduled.py``)
and lists, in ``inspect scheduled``, the tasks whose latest park was its own, or unattributed and
its to list (``worker/rules/listers.py``), and whose ETA has not passed: Celery's ``scheduled``
reply, ``{"eta", "priority", "request": TASK_INFO}``. Pure: encoding and decoding, no I/O.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.wire.task.task_message import TaskMessage

__all__ = ["CONTENT_TYPE", "Parked", "parked_record"]

CONTENT_TYPE: Final = "application/x-clockwork-parked+json"


@dataclass(frozen=True, slots=True)
class Parked:
    """One park: which task, until when, by which worker (None: by a client), and the record.

    Every worker keeps the latest record of every task parked in the app, so a record is kept as
    its bytes (about 400 for a task with small arguments) and its TASK_INFO decoded only to list it.
    """

    task_id: str
    eta: float  # epoch seconds
    hostname: str | None
    body: bytes
    priority: int | None = None
    queue: str | None = None  # the task queue it goes back to

    @property
    def info(self) -> dict[str, Any]:
        """Its TASK_INFO as written."""
        info: dict[str, Any] = json.loads(self.body)["info"]
        return info

    def reply(self, hostname: str) -> dict[str, Any]:
        """Celery's ``scheduled`` entry for it, as listed by the worker ``hostname``."""
        eta = dt.datetime.fromtimestamp(self.eta, dt.UTC).isoformat()
        return {"eta": eta, "priority": self.priority, "request": self.request(hostname)}

    def request(self, hostname: str) -> dict[str, Any]:
        """Its TASK_INFO as listed by ``hostname`` (a client's record names no worker)."""
        return {**self.info, "hostname": hostname}

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
            hostname, priority, queue = data["hostname"], data.get("priority"), data.get("queue")
            return cls(
                task_id=str(data["id"]),
                eta=float(data["eta"]),
                # Interned: a few names, repeated in every record.
                hostname=None if hostname is None else sys.intern(str(hostname)),
                body=bytes(body),
                priority=priority if isinstance(priority, int) else None,
                queue=sys.intern(queue) if isinstance(queue, str) else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MessageError(f"not a park record: {exc}") from exc


def parked_record(
    request: TaskMessage, *, hostname: str | None, delivery_info: dict[str, Any], queue: str | None = None
) -> bytes:
    """The record of ``request`` (its ETA must be set) parked by ``hostname`` (None: a client).

    ``queue``: the task queue it goes back to; a client's record needs it, as only a worker that
    consumes that queue lists it.
    """
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
    if queue is not None:
        record["queue"] = queue
    # default=repr: arguments the task's own serializer carried but JSON cannot are shown as reprs.
    return json.dumps(record, default=repr).encode()
