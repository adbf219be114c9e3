"""Frames between the worker and its pool children: jobs, outcomes, and their msgpack framing.

A frame is a 4-byte big-endian length followed by one msgpack map whose ``op`` names it::

    parent -> child   {"op": "run", task_id, task_name, args, kwargs, request,
                       hard_time_limit_s, soft_time_limit_s}
    child -> parent   {"op": "ready", pid}
                      {"op": "error", message, traceback}          (the app did not load)
                      {"op": "update", task_id, payload}
                      {"op": "done", status, value, error, traceback, runtime_s}

This module is pure: the blocking side lives in ``worker.pool.child``, the async side in ``worker.pool.pool``.
No pickle anywhere: a child could be made to send anything, and the parent must only ever decode data.
"""

from __future__ import annotations

import datetime as dt
import decimal
import signal
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import msgpack

from broker_svc.errors import DecodeError, MessageTooLarge
from broker_svc.wire.codec import refuse_ext
from broker_svc.wire.result_message import wire_exception

__all__ = [
    "HEADER",
    "MAX_FRAME_BYTES",
    "Job",
    "JobOutcome",
    "JobStatus",
    "decode_frame",
    "describe_exit",
    "encode_error",
    "encode_frame",
    "frame_length",
]

HEADER: Final = struct.Struct(">I")
# Far above any task body we accept (Settings.max_body_bytes), low enough that a corrupt length
# prefix cannot make a reader allocate gigabytes.
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024


class JobStatus(StrEnum):
    """How a job ended."""

    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    LOST = "LOST"  # the child died while running it
    TIME_LIMIT = "TIME_LIMIT"  # the hard time limit passed; the child was killed
    TERMINATED = "TERMINATED"  # ``ProcessPool.terminate`` killed it (revoke with terminate=True)
    RETRY = "RETRY"  # the task called ``self.retry()``; ``value`` is ``{"eta": ISO-8601}``
    IGNORED = "IGNORED"  # the task raised ``Ignore``: ack, no result
    REJECTED = "REJECTED"  # the task raised ``Reject``; ``value`` is ``{"requeue": bool}``


# A child reports only these; the others are decided by the parent when the child is gone.
_CHILD_STATUSES: Final = frozenset(
    {JobStatus.SUCCESS, JobStatus.FAILURE, JobStatus.RETRY, JobStatus.IGNORED, JobStatus.REJECTED}
)


@dataclass(frozen=True, slots=True)
class Job:
    """One task call for a child to run."""

    task_id: str
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    request: dict[str, Any]
    hard_time_limit_s: float | None = None
    soft_time_limit_s: float | None = None

    def to_frame(self) -> dict[str, Any]:
        """The ``run`` frame."""
        return {
            "op": "run",
            "task_id": self.task_id,
            "task_name": self.task_name,
            "args": self.args,
            "kwargs": self.kwargs,
            "request": self.request,
            "hard_time_limit_s": self.hard_time_limit_s,
            "soft_time_limit_s": self.soft_time_limit_s,
        }

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> Job:
        """Validate a ``run`` frame.

        Raises:
            DecodeError: the frame is not a well-formed ``run`` frame.
        """
        task_id, task_name = frame.get("task_id"), frame.get("task_name")
        args, kwargs, request = frame.get("args"), frame.get("kwargs"), frame.get("request")
        if frame.get("op") != "run" or not isinstance(task_id, str) or not isinstance(task_name, str):
            raise DecodeError(f"not a run frame: op={frame.get('op')!r}")
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(request, dict):
            raise DecodeError("run frame needs args (list), kwargs (map) and request (map)")
        return cls(
            task_id=task_id,
            task_name=task_name,
            args=args,
            kwargs=kwargs,
            request=request,
            hard_time_limit_s=_seconds(frame.get("hard_time_limit_s")),
            soft_time_limit_s=_seconds(frame.get("soft_time_limit_s")),
        )


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How a job ended, with its return value or Celery's exception map."""

    status: JobStatus
    value: Any = None
    error: dict[str, Any] | None = None
    traceback: str | None = None
    runtime_s: float = 0.0
    pid: int = 0
    retries_exhausted: bool = False  # a FAILURE after the last retry: the message is dead-lettered
    children: tuple[str, ...] = ()  # ids of the tasks the run sent (a SUCCESS's result.children)

    @classmethod
    def from_frame(cls, frame: dict[str, Any], *, pid: int) -> JobOutcome:
        """Validate a ``done`` frame from the child ``pid``.

        Raises:
            DecodeError: the frame is not a well-formed ``done`` frame.
        """
        status, error, traceback = frame.get("status"), frame.get("error"), frame.get("traceback")
        if status not in _CHILD_STATUSES:
            raise DecodeError(f"done frame has status {status!r}; a child reports {sorted(_CHILD_STATUSES)}")
        if not (error is None or isinstance(error, dict)) or not (
            traceback is None or isinstance(traceback, str)
        ):
            raise DecodeError("done frame needs error (map or nil) and traceback (str or nil)")
        return cls(
            status=JobStatus(status),
            value=frame.get("value"),
            error=error,
            traceback=traceback,
            runtime_s=_seconds(frame.get("runtime_s")) or 0.0,
            pid=pid,
            retries_exhausted=frame.get("retries_exhausted") is True,
            children=_ids(frame.get("children")),
        )

    @classmethod
    def for_dead_child(
        cls, job: Job, status: JobStatus | None, *, exitcode: int | None, runtime_s: float, pid: int
    ) -> JobOutcome:
        """The outcome of a job whose child is gone, with the error map Celery reports for it.

        ``status`` is why the worker killed the child; None means it died on its own (LOST).
        """
        status = status or JobStatus.LOST
        if status is JobStatus.TIME_LIMIT:
            error = wire_exception("TimeLimitExceeded", job.hard_time_limit_s)
        elif status is JobStatus.TERMINATED:
            error = wire_exception("TaskRevokedError", "terminated")  # Celery's revoke reason
        else:
            message = f"Worker exited prematurely: {describe_exit(exitcode)}."
            error = wire_exception("WorkerLostError", message, module="billiard.exceptions")
        return cls(status, error=error, runtime_s=runtime_s, pid=pid)


def encode_error(message: str) -> dict[str, Any]:
    """Kombu's ``EncodeError`` map, for arguments or a result that msgpack cannot carry."""
    return wire_exception("EncodeError", message, module="kombu.exceptions")


def describe_exit(exitcode: int | None) -> str:
    """An exit status in Celery's words: ``signal 9 (SIGKILL)`` or ``exitcode 3``."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exitcode {exitcode}"


def encode_frame(frame: dict[str, Any]) -> bytes:
    """Length prefix plus msgpack body.

    Raises:
        TypeError: the frame holds something msgpack cannot encode (an object, a huge int, ...).
        MessageTooLarge: the body is over ``MAX_FRAME_BYTES``.
    """
    try:
        body: bytes = msgpack.packb(frame, use_bin_type=True, default=_to_ext)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"msgpack cannot encode it: {exc}") from exc
    if len(body) > MAX_FRAME_BYTES:
        raise MessageTooLarge(f"frame of {len(body)} bytes is over the limit of {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces.

    Raises:
        MessageTooLarge: the length is over ``MAX_FRAME_BYTES`` (a corrupt or hostile stream).
    """
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise MessageTooLarge(f"frame of {length} bytes announced; the limit is {MAX_FRAME_BYTES}")
    return int(length)


def decode_frame(body: bytes) -> dict[str, Any]:
    """Decode a frame body into its map.

    Raises:
        DecodeError: not msgpack, or not a map with a string ``op``.
    """
    try:
        frame = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_from_ext)
    except Exception as exc:  # msgpack raises several private error types
        raise DecodeError(f"undecodable frame of {len(body)} bytes: {type(exc).__name__}: {exc}") from exc
    if not isinstance(frame, dict) or not isinstance(frame.get("op"), str):
        raise DecodeError(f"a frame must be a map with a string op, got {type(frame).__name__}")
    return frame


# What a JSON task can carry (kombu's types, decoded by broker_svc.wire.codec) crosses to a child
# and back as msgpack ext types; plain values never reach ``_to_ext``, so they cost nothing more.
_EXT_CODES: Final[tuple[tuple[int, type, Callable[[Any], bytes]], ...]] = (
    (1, dt.datetime, lambda v: v.isoformat().encode()),
    (2, dt.date, lambda v: v.isoformat().encode()),
    (3, dt.time, lambda v: v.isoformat().encode()),
    (4, decimal.Decimal, lambda v: str(v).encode()),
    (5, uuid.UUID, lambda v: v.bytes),
)
_FROM_EXT: Final[dict[int, Callable[[bytes], Any]]] = {
    1: lambda b: dt.datetime.fromisoformat(b.decode()),
    2: lambda b: dt.date.fromisoformat(b.decode()),
    3: lambda b: dt.time.fromisoformat(b.decode()),
    4: lambda b: decimal.Decimal(b.decode()),
    5: lambda b: uuid.UUID(bytes=b),
}


def _to_ext(value: Any) -> Any:
    for code, kind, encode in _EXT_CODES:  # datetime before date: a datetime is a date
        if isinstance(value, kind):
            return msgpack.ExtType(code, encode(value))
    if isinstance(value, tuple | set | frozenset):
        return list(value)  # msgpack packs whatever default returns
    raise TypeError(f"cannot encode object of type {type(value).__name__}")


def _from_ext(code: int, data: bytes) -> Any:
    decode = _FROM_EXT.get(code)
    if decode is None:
        refuse_ext(code, data)
    return decode(data)


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DecodeError(f"expected seconds as a number, got {value!r}")
    return float(value)


def _ids(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(item for item in value if isinstance(item, str))
