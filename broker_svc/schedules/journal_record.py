"""What a scheduler's journal holds (``topology.beat_journal_stream``), record by record.

Five kinds, told apart by their AMQP properties:

- a **fire**: a copy of a task message the scheduler sent, with the ``clockwork_beat_*`` headers
  (:class:`FireMark`: the entry, the scheduled instant, the leader's epoch, a run-now's change id).
  The task's own queue gets the same message: one publish, the journal as its ``BCC``.
- a **result**: what a fired task answered to its ``reply_to`` (the journal), as Celery's rpc
  backend sends it; its ``correlation_id`` is the task id.
- a **change**: a schedule change made at runtime (``ctl schedule``, ``app.schedules``), JSON with
  the ``x-clockwork-beat`` header ``change`` (:class:`Change`).
- a **term**: a leader opened its term exchange (:class:`TermOpened`), so a later leader knows to
  delete it; it names that leader, so ``ctl schedule list`` can say who leads.
- a **marker**: written by a reader to learn that it has read everything written before it.

Pure: no sockets. A record that is none of these is skipped by readers (:func:`classify` -> None).
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from broker_svc.errors import MessageError
from broker_svc.wire import codec

__all__ = [
    "CHANGE_OPS",
    "CONTENT_TYPE",
    "ENTRY_HEADER",
    "EPOCH_HEADER",
    "RUN_NOW_HEADER",
    "SCHEDULED_HEADER",
    "RECORD_HEADER",
    "Change",
    "ChangeOp",
    "Done",
    "Fire",
    "FireMark",
    "JournalItem",
    "Marker",
    "TermOpened",
    "classify",
]

# On a fired task message (AMQP headers; Celery workers ignore headers they do not know).
ENTRY_HEADER: Final = "clockwork_beat_entry"
SCHEDULED_HEADER: Final = "clockwork_beat_scheduled"
EPOCH_HEADER: Final = "clockwork_beat_epoch"
RUN_NOW_HEADER: Final = "clockwork_beat_run_now"
# On records written to the journal directly: "change" or "marker".
RECORD_HEADER: Final = "x-clockwork-beat"
CONTENT_TYPE: Final = "application/x-clockwork-beat+json"

# Answers are read only for their state: JSON or msgpack, as the worker sent them.
_RESULT_TYPES: Final = codec.accept_set(("json", "msgpack"))
_RESULT_MAX_BYTES: Final = 16 * 1024 * 1024

ChangeOp = Literal["add", "remove", "pause", "resume", "run-now"]
CHANGE_OPS: Final[frozenset[str]] = frozenset({"add", "remove", "pause", "resume", "run-now"})


@dataclass(frozen=True, slots=True, kw_only=True)
class FireMark:
    """What the ``clockwork_beat_*`` headers of a fired task say.

    Flat headers of strings and ints: a stream keeps a message's simple header values only (a
    nested table would be gone from the journal's copy), and a float or an int past 32 bits is
    not portable (``scheduled`` is ISO 8601, UTC, in milliseconds).
    """

    entry: str
    scheduled: float  # the scheduled instant (UTC epoch seconds)
    epoch: int  # the term of the leader that fired it
    run_now: str | None = None  # the change id of a ``run-now``, else None

    def headers(self) -> dict[str, Any]:
        when = dt.datetime.fromtimestamp(self.scheduled, dt.UTC).isoformat(timespec="milliseconds")
        value: dict[str, Any] = {ENTRY_HEADER: self.entry, SCHEDULED_HEADER: when, EPOCH_HEADER: self.epoch}
        if self.run_now is not None:
            value[RUN_NOW_HEADER] = self.run_now
        return value

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any]) -> FireMark:
        """Raises: MessageError: not a fire's headers."""
        entry, scheduled = _text(headers.get(ENTRY_HEADER)), _text(headers.get(SCHEDULED_HEADER))
        epoch, run_now = headers.get(EPOCH_HEADER, 0), _text(headers.get(RUN_NOW_HEADER))
        if not entry:
            raise MessageError(f"{ENTRY_HEADER} is missing")
        try:
            at = dt.datetime.fromisoformat(scheduled or "").timestamp()
        except ValueError:
            raise MessageError(f"{SCHEDULED_HEADER} is not an ISO 8601 instant: {scheduled!r}") from None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise MessageError(f"{EPOCH_HEADER} is not an int: {epoch!r}")
        return cls(entry=entry, scheduled=at, epoch=epoch, run_now=run_now)


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """A schedule change made at runtime.

    ``entry`` is the entry's JSON (``Entry.to_json``) for ``add``; the other ops name an entry.
    """

    op: ChangeOp
    name: str
    entry: dict[str, Any] | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.op not in CHANGE_OPS:
            raise ValueError(f"unknown schedule change {self.op!r}; known: {sorted(CHANGE_OPS)}")
        if self.op == "add" and not isinstance(self.entry, dict):
            raise ValueError("an 'add' change needs the entry")

    def encode(self) -> bytes:
        body = {"op": self.op, "name": self.name, "entry": self.entry, "id": self.id, "at": self.at}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> Change:
        """Raises: MessageError: not a change record."""
        try:
            value = json.loads(body)
            return cls(
                op=value["op"], name=str(value["name"]), entry=value.get("entry"),
                id=str(value["id"]), at=float(value["at"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise MessageError(f"not a schedule change: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Fire:
    """A fired task: its id and what the scheduler knew of it."""

    task_id: str
    mark: FireMark


@dataclass(frozen=True, slots=True)
class Done:
    """A fired task's answer: its state (SUCCESS, FAILURE, REVOKED, or one still running)."""

    task_id: str
    status: str


@dataclass(frozen=True, slots=True)
class Marker:
    id: str


@dataclass(frozen=True, slots=True)
class TermOpened:
    """A leader's term began: its term exchange exists until a later leader deletes it.

    ``leader`` is the election identity of the instance that leads it (host, pid, a suffix; empty
    in a record of an older version) and ``at`` when it began (epoch seconds; 0.0 if unknown).
    """

    epoch: int
    leader: str = ""
    at: float = 0.0

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "leader": self.leader, "at": self.at}).encode()

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "leader": self.leader, "at": self.at}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TermOpened:
        """Raises: KeyError, TypeError, ValueError: not a term record."""
        return cls(int(value["epoch"]), str(value.get("leader") or ""), float(value.get("at") or 0.0))


JournalItem = Fire | Done | Change | Marker | TermOpened


def classify(
    headers: Mapping[str, Any] | None, correlation_id: str | None, content_type: str | None, body: bytes
) -> JournalItem | None:
    """One journal message as a record (None: not one of ours, or unreadable: skip it).

    Raises:
        MessageError: a record of ours that is malformed (the caller logs and skips it).
    """
    headers = headers or {}
    kind = _text(headers.get(RECORD_HEADER))
    if kind == "marker":
        return Marker(body.decode("utf-8", "replace"))
    if kind == "change":
        return Change.decode(body)
    if kind == "term":
        try:
            return TermOpened.from_json(json.loads(body))
        except (ValueError, KeyError, TypeError) as exc:
            raise MessageError(f"not a term record: {exc}") from exc
    if ENTRY_HEADER in headers:
        task_id = _text(headers.get("id"))
        if not task_id:
            raise MessageError("a fired task without its id header")
        return Fire(task_id, FireMark.from_headers(headers))
    if correlation_id:
        try:
            value = codec.decode(body, content_type, accept=_RESULT_TYPES, max_bytes=_RESULT_MAX_BYTES)
        except MessageError:
            return None  # an answer we cannot read (another serializer, too large): state unknown
        status = value.get("status") if isinstance(value, Mapping) else None
        if isinstance(status, str) and status:
            return Done(str(value.get("task_id") or correlation_id), status)
    return None
