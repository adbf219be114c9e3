"""Frames between the worker and its pool children, their msgpack framing, and a run's outcome.

A frame is a 4-byte big-endian length followed by one msgpack map whose ``op`` names it::

    child -> parent   {"op": "ready", pid}
                      {"op": "error", message, traceback}          (the app did not load)
                      {"op": "tally", ...}, {"op": "held", ...}, {"op": "revoke_applied", seq}, ...
    parent -> child   {"op": "consume"}, {"op": "revoke", ids, seq}, {"op": "retire"}, ...

(``worker/child/serve.py`` lists every order a child takes.) A task body's run ends in a *done*
map (status, value, error, traceback) that stays inside the child: ``JobStatus`` names how.

This module is pure: the blocking side lives in ``worker.child.run``, the async side in
``worker.pool.supervisor``.
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

__all__ = [
    "EXIT_TIME_LIMIT",
    "HEADER",
    "MAX_FRAME_BYTES",
    "Job",
    "JobStatus",
    "decode_frame",
    "describe_exit",
    "encode_frame",
    "frame_length",
    "job_status",
]

HEADER: Final = struct.Struct(">I")
# Far above any task body we accept (Settings.max_body_bytes), low enough that a corrupt length
# prefix cannot make a reader allocate gigabytes.
MAX_FRAME_BYTES: Final = 256 * 1024 * 1024


class JobStatus(StrEnum):
    """How a task body's run ended."""

    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    RETRY = "RETRY"  # the task called ``self.retry()``; ``value`` is ``{"eta": ISO-8601}``
    IGNORED = "IGNORED"  # the task raised ``Ignore``: ack, no result
    REJECTED = "REJECTED"  # the task raised ``Reject``; ``value`` is ``{"requeue": bool}``


_STATUSES: Final = {str(status): status for status in JobStatus}


def job_status(value: str) -> JobStatus:
    """The ``JobStatus`` a done frame's ``status`` names (``JobStatus(value)``, without its lookup
    machinery: once per task in the child).

    Raises:
        ValueError: no status of that name.
    """
    status = _STATUSES.get(value)
    return status if status is not None else JobStatus(value)


@dataclass(frozen=True, slots=True)
class Job:
    """One task call, as the child runs it (``worker.child.run.run_job``)."""

    task_id: str
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    request: dict[str, Any]
    hard_time_limit_s: float | None = None
    soft_time_limit_s: float | None = None


# A child ends itself with this status once its task passed the hard time limit and was answered
# (errno ETIME, "timer expired"): the pool replaces it without calling it a crash.
EXIT_TIME_LIMIT: Final = 62


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
