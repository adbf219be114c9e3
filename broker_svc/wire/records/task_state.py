"""Records of the task-state stream (``topology.task_states_stream``): who saw a task in which state.

The client appends QUEUED when it sends a task (and DELETED/REVOKED when it deletes or cancels
one); workers append STARTED, SUCCESS, FAILURE, RETRY and REVOKED. A record is small JSON, so any
process (or ``rabbitmq-streams`` tooling) can read the stream. Records are ordered by their
Lamport clock: a worker's clock is past the clock of the task it received, so its STARTED sorts
after the client's QUEUED even when the QUEUED record reaches the stream later.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.wire.task.task_message import CLOCK_HEADER, WireMessage

__all__ = [
    "ALLOW_FAILURE_HEADER",
    "CONTENT_TYPE",
    "DEPENDS_ON_HEADER",
    "TARGET_QUEUE_HEADER",
    "FINAL_STATES",
    "MARKER_HEADER",
    "RESULT_TTL_HEADER",
    "WORKER_STATES",
    "JobState",
    "StateRecord",
    "result_expiration",
    "worker_info",
]

CONTENT_TYPE: Final = "application/json"
# A reader appends an empty message with this header and reads up to it: then it has seen every
# record written before it asked (the members feed's trick, control/blocking/members_feed.py).
MARKER_HEADER: Final = "x-clockwork-state-marker"
_MAX_RECORD_BYTES: Final = 64 * 1024
# A task sent with ``depends_on`` waits in ``topology.dependents_queue`` with these headers: the ids
# it waits for, whether it runs when one of them did not succeed, and the queue it then goes to.
DEPENDS_ON_HEADER: Final = "x-clockwork-depends-on"
ALLOW_FAILURE_HEADER: Final = "x-clockwork-allow-failure"
TARGET_QUEUE_HEADER: Final = "x-clockwork-target-queue"
# RQ's ``result_ttl`` in ms, set by ``app.enqueue``: the worker publishes the task's result with
# this AMQP expiration, so an unread result leaves its reply queue after that long.
RESULT_TTL_HEADER: Final = "x-clockwork-result-ttl"


def result_expiration(extra_headers: Mapping[str, Any]) -> str | None:
    """The AMQP expiration (ms, as a string) a task's result goes out with; None: none."""
    ttl = extra_headers.get(RESULT_TTL_HEADER)
    if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0:
        return str(ttl)
    return None


class JobState(StrEnum):
    """A task's state as the stream knows it: Celery's names plus QUEUED, WAITING, DELETED, DECLINED,
    UNKNOWN."""

    UNKNOWN = "UNKNOWN"  # never seen within the stream's retention (a reader's answer, never written)
    WAITING = "WAITING"  # sent with depends_on; held until its dependencies finish (RQ's "deferred")
    QUEUED = "QUEUED"
    STARTED = "STARTED"
    RETRY = "RETRY"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    REVOKED = "REVOKED"
    DELETED = "DELETED"
    DECLINED = "DECLINED"  # sent with a dedup key and declined by the gate: never run (``TaskDeclined``)


FINAL_STATES: Final = frozenset(
    {JobState.SUCCESS, JobState.FAILURE, JobState.REVOKED, JobState.DELETED, JobState.DECLINED}
)
# The outcomes a worker writes when it answers a task (STARTED is written as the run begins).
WORKER_STATES: Final = frozenset({JobState.SUCCESS, JobState.FAILURE, JobState.RETRY, JobState.REVOKED})


def worker_info(state: str, result: Any) -> dict[str, Any]:
    """What a worker's record says beyond the state: the exception of a failure, retry or revoke."""
    if state in (JobState.FAILURE, JobState.RETRY, JobState.REVOKED) and isinstance(result, Mapping):
        message = result.get("exc_message")
        text = ", ".join(map(str, message)) if isinstance(message, list | tuple) else str(message or "")
        return {"exc_type": str(result.get("exc_type") or ""), "exc_message": text[:200]}
    return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class StateRecord:
    """One state of one task, as written to the stream.

    ``at`` is the writer's wall clock (epoch seconds), ``clock`` its Lamport clock, ``hostname``
    the writer (a worker's node name, or ``client@host``), ``info`` a few extra facts (a failure's
    exception type, a revoke's reason).
    """

    task_id: str
    state: str
    at: float = 0.0
    clock: int = 0
    hostname: str = ""
    name: str | None = None
    queue: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        """The record as compact JSON (short keys: the stream holds millions of them)."""
        data: dict[str, Any] = {"i": self.task_id, "s": self.state, "t": round(self.at, 6), "c": self.clock}
        if self.hostname:
            data["h"] = self.hostname
        if self.name:
            data["n"] = self.name
        if self.queue:
            data["q"] = self.queue
        if self.info:
            data["x"] = dict(self.info)
        return json.dumps(data, separators=(",", ":"), default=str).encode()

    def wire(self) -> WireMessage:
        """The record as a persistent message (its clock also in the ``clock`` header)."""
        return WireMessage(
            body=self.encode(),
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            headers={CLOCK_HEADER: self.clock},
            delivery_mode=2,
        )

    @classmethod
    def decode(cls, body: bytes) -> StateRecord:
        """A record from the stream.

        Raises:
            MessageError: not a record (bad JSON, missing id or state, too large).
        """
        if len(body) > _MAX_RECORD_BYTES:
            raise MessageError(f"state record of {len(body)} bytes is too large")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise MessageError(f"state record is not JSON: {exc}") from None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("i"), str)
            or not isinstance(data.get("s"), str)
        ):
            raise MessageError("state record without a task id and state")
        info = data.get("x")
        return cls(
            task_id=data["i"],
            state=data["s"],
            at=float(data.get("t") or 0.0),
            clock=int(data.get("c") or 0),
            hostname=str(data.get("h") or ""),
            name=data.get("n") if isinstance(data.get("n"), str) else None,
            queue=data.get("q") if isinstance(data.get("q"), str) else None,
            info=info if isinstance(info, dict) else {},
        )

    @classmethod
    def now(cls, task_id: str, state: str, *, clock: int, hostname: str, **extra: Any) -> StateRecord:
        """A record stamped with the wall clock now."""
        return cls(task_id=task_id, state=state, at=time.time(), clock=clock, hostname=hostname, **extra)

    def as_dict(self) -> dict[str, Any]:
        """The record for JSON output (``ctl task --json``)."""
        return {
            "task_id": self.task_id, "state": self.state, "at": self.at, "clock": self.clock,
            "hostname": self.hostname, "name": self.name, "queue": self.queue, "info": dict(self.info),
        }  # fmt: skip
