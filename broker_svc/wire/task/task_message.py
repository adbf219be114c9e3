"""The task message (Celery protocol v2) and its mapping to AMQP body, headers and properties."""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

from broker_svc.errors import InvalidTaskMessage
from broker_svc.wire import codec
from broker_svc.wire.ids import uuid4_str

__all__ = [
    "CLOCK_HEADER",
    "RESENT_HEADER",
    "TaskMessage",
    "WireMessage",
    "decode_task",
    "encode_task",
    "eta_and_expires",
    "parse_iso_datetime",
    "safe_repr",
]

CLOCK_HEADER: Final = "clock"
# Set by our client on a message it sends again (lost connection, confirm timeout, nack), and by a
# worker on the copy of a delivery it hands back: the broker may keep the earlier one too (a send
# taken unconfirmed; a worker killed between the copy's confirm and the original's ack), so a
# worker marks the delivery ``redelivered``.
RESENT_HEADER: Final = "x-clockwork-resent"
_REPR_LIMIT: Final = 1024
_INT32: Final = 2**31
_EMPTY_EMBED: Final = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_ORIGIN: Final = f"gen{os.getpid()}@{platform.node()}"


def safe_repr(value: Any, limit: int = _REPR_LIMIT) -> str:
    """``repr`` cut to ``limit`` characters, as Celery's ``argsrepr``/``kwargsrepr``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_iso_datetime(value: str) -> dt.datetime:
    """Parse an ISO-8601 ``eta``/``expires`` header; naive values are taken as UTC.

    Raises:
        ValueError: not an ISO-8601 date-time.
    """
    parsed = dt.datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True, kw_only=True)
class WireMessage:
    """An encoded message, ready for any AMQP client to publish."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    correlation_id: str | None = None
    reply_to: str | None = None
    priority: int | None = None
    delivery_mode: int = 2
    expiration: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskMessage:
    """One task, as protocol v2 carries it.

    ``timelimit`` is ``(hard, soft)`` in seconds, in that order on the wire (WIRE.md §3.2).
    ``eta`` and ``expires`` are timezone-aware datetimes or None.
    """

    id: str
    task: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    embed: dict[str, Any] = field(default_factory=lambda: dict(_EMPTY_EMBED))
    root_id: str | None = None
    parent_id: str | None = None
    group: str | None = None
    group_index: int | None = None
    retries: int = 0
    eta: dt.datetime | None = None
    expires: dt.datetime | None = None
    timelimit: tuple[float | None, float | None] = (None, None)
    ignore_result: bool = False
    shadow: str | None = None
    origin: str | None = None
    clock: int | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    priority: int | None = None
    content_type: str = codec.MSGPACK
    extra_headers: dict[str, Any] = field(default_factory=dict)
    # How many ``Task.replace`` calls led here (Celery's header; 0 for a task sent as itself).
    replaced_task_nesting: int = 0
    # Celery's stamps (``Signature.stamp``): the names stamped, and their values (wire/task/stamps.py).
    stamped_headers: list[str] | None = None
    stamps: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new_id() -> str:
        """A fresh task id (a random uuid4 string, as Celery's)."""
        return uuid4_str()

    @property
    def display_name(self) -> str:
        """The name to show in logs and events (``shadow`` wins, as in Celery)."""
        return self.shadow or self.task


def eta_and_expires(message: TaskMessage) -> dict[str, str | None]:
    """A task's ``eta`` and ``expires`` as Celery writes them (headers, ``task.request``, events)."""
    return {
        "eta": message.eta.isoformat() if message.eta else None,
        "expires": message.expires.isoformat() if message.expires else None,
    }


def encode_task(message: TaskMessage, *, serializer: str) -> WireMessage:
    """Encode a task as Celery 5 does: headers for routing data, body ``[args, kwargs, embed]``.

    Raises:
        TypeError: args or kwargs hold a value the serializer cannot encode.
        ValueError: a header value is outside what every AMQP peer can decode.
    """
    headers: dict[str, Any] = {
        "lang": "py",
        "task": message.task,
        "id": message.id,
        "shadow": message.shadow,
        **eta_and_expires(message),
        "group": message.group,
        "group_index": message.group_index,
        "retries": message.retries,
        "timelimit": [_wire_limit(message.timelimit[0]), _wire_limit(message.timelimit[1])],
        "root_id": message.root_id or message.id,
        "parent_id": message.parent_id,
        "argsrepr": safe_repr(message.args),
        "kwargsrepr": safe_repr(message.kwargs),
        "origin": message.origin or _ORIGIN,
        "ignore_result": message.ignore_result,
        "replaced_task_nesting": message.replaced_task_nesting,
        "stamped_headers": message.stamped_headers,
        "stamps": message.stamps,
    }
    headers.update(message.extra_headers)
    if message.clock is not None:
        headers[CLOCK_HEADER] = message.clock
    _check_header_ints(headers)
    try:
        body, content_type, content_encoding = codec.encode(
            [list(message.args), dict(message.kwargs), message.embed], serializer
        )
    except TypeError as exc:
        # Raised where the task is sent, often far from where the value was made: name the task.
        raise TypeError(f"cannot send task {message.task!r} (id {message.id}): {exc}") from exc
    expiration = None
    if message.expires is not None:
        remaining_ms = (message.expires - dt.datetime.now(dt.UTC)).total_seconds() * 1000
        expiration = str(max(0, int(remaining_ms)))
    return WireMessage(
        body=body,
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        correlation_id=message.id,
        reply_to=message.reply_to,
        priority=message.priority if message.priority is not None else 0,
        expiration=expiration,
    )


def _wire_limit(value: float | None) -> int | None:
    # pika cannot send floats and pamqp sends them as 32-bit (WIRE.md §2.2): round up to whole
    # seconds so a limit is never shortened.
    if value is None:
        return None
    whole = int(value)
    return whole if whole == value else whole + 1


_PLAIN_HEADER_TYPES: Final = frozenset({str, bool, type(None)})


def _check_header_ints(value: Any) -> None:
    # About twenty values per send: exact scalar types first, and a dict before the Mapping ABC.
    if type(value) in _PLAIN_HEADER_TYPES or isinstance(value, str):
        return
    if isinstance(value, int):
        if not -_INT32 <= value < _INT32:
            raise ValueError(f"header int {value} is outside the signed 32-bit range")
    elif isinstance(value, dict) or isinstance(value, Mapping):
        for item in value.values():
            _check_header_ints(item)
    elif isinstance(value, list):
        for item in value:
            _check_header_ints(item)
    else:
        raise ValueError(f"header value of type {type(value).__name__} is not portable")


def decode_task(
    body: bytes,
    headers: Mapping[str, Any] | None,
    *,
    content_type: str | None,
    accept: frozenset[str],
    max_bytes: int,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    priority: int | None = None,
) -> TaskMessage:
    """Decode and validate a delivered task message.

    Only ``task`` and ``id`` headers are required; every other header is optional (WIRE.md §3.2).

    Raises:
        ContentDisallowed: the content type is not accepted (the body is not read).
        MessageTooLarge: the body is over ``max_bytes``.
        DecodeError: the body does not decode.
        InvalidTaskMessage: it decodes but is not a protocol-v2 task.
    """
    if not isinstance(headers, Mapping):
        raise InvalidTaskMessage("message has no headers; protocol v1 is not supported")
    task = headers.get("task")
    task_id = headers.get("id")
    if not isinstance(task, str) or not task:
        raise InvalidTaskMessage("missing or empty 'task' header (protocol v1 is not supported)")
    if not isinstance(task_id, str) or not task_id:
        raise InvalidTaskMessage("missing or empty 'id' header")
    get = headers.get
    compression = get("compression")
    if compression is not None:
        body = codec.decompress(body, compression, max_bytes=max_bytes)
    payload = codec.decode(body, content_type, accept=accept, max_bytes=max_bytes)
    args, kwargs, embed = _split_body(payload)
    # Each header checked where the common case is cheap (None, or exactly its type), by the
    # helpers otherwise; in the order of the fields, so a bad message fails as it always did.
    root_id = get("root_id")
    if root_id is not None and type(root_id) is not str:
        root_id = _optional_str(headers, "root_id")
    parent_id = get("parent_id")
    if parent_id is not None and type(parent_id) is not str:
        parent_id = _optional_str(headers, "parent_id")
    group = get("group")
    if group is not None and type(group) is not str:
        group = _optional_str(headers, "group")
    group_index = get("group_index")
    if group_index is not None and type(group_index) is not int:
        group_index = _optional_int(headers, "group_index")
    retries = get("retries")
    if type(retries) is not int:
        retries = _optional_int(headers, "retries")
    eta = _optional_datetime(headers, "eta") if get("eta") is not None else None
    expires = _optional_datetime(headers, "expires") if get("expires") is not None else None
    timelimit = _timelimit(get("timelimit"))
    ignore_result = bool(get("ignore_result", False))
    shadow = get("shadow")
    if shadow is not None and type(shadow) is not str:
        shadow = _optional_str(headers, "shadow")
    origin = get("origin")
    if origin is not None and type(origin) is not str:
        origin = _optional_str(headers, "origin")
    clock = get(CLOCK_HEADER)
    known = _KNOWN_HEADERS
    extra = {k: v for k, v in headers.items() if k not in known}
    nesting = get("replaced_task_nesting")
    if type(nesting) is not int:
        nesting = _optional_int(headers, "replaced_task_nesting")
    return _assemble(
        id=task_id,
        task=task,
        args=args,
        kwargs=kwargs,
        embed=embed,
        root_id=root_id,
        parent_id=parent_id,
        group=group,
        group_index=group_index,
        retries=retries or 0,
        eta=eta,
        expires=expires,
        timelimit=timelimit,
        ignore_result=ignore_result,
        shadow=shadow,
        origin=origin,
        clock=clock if isinstance(clock, int) else None,
        reply_to=reply_to or None,
        correlation_id=correlation_id or None,
        priority=priority,
        content_type=content_type or codec.JSON,
        extra_headers=extra,
        replaced_task_nesting=nesting or 0,
        stamped_headers=_stamped_headers(get("stamped_headers")),
        stamps=_stamps(get("stamps")),
    )


# A frozen dataclass's __init__ sets each of its 25 fields through object.__setattr__ (about
# 4.7 us a message); a decoded message is assembled through the fields' slots instead, still
# frozen, every field given (a field added to TaskMessage and not here fails at once).
_FIELD_SETTERS: Final = tuple((f.name, getattr(TaskMessage, f.name).__set__) for f in fields(TaskMessage))


def _assemble(**values: Any) -> TaskMessage:
    if len(values) != len(_FIELD_SETTERS):
        raise TypeError(f"a TaskMessage has {len(_FIELD_SETTERS)} fields, got {sorted(values)}")
    message: TaskMessage = object.__new__(TaskMessage)
    for name, set_field in _FIELD_SETTERS:
        set_field(message, values[name])
    return message


_KNOWN_HEADERS: Final = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps", "compression", CLOCK_HEADER,
    }
)  # fmt: skip


def _split_body(payload: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    if not isinstance(payload, list | tuple) or len(payload) != 3:
        raise InvalidTaskMessage("body must be a 3-element array [args, kwargs, embed]")
    args, kwargs, embed = payload
    if not isinstance(args, list | tuple):
        raise InvalidTaskMessage(f"args must be an array, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidTaskMessage("kwargs must be a map with string keys")
    if embed is None:
        embed = dict(_EMPTY_EMBED)
    if not isinstance(embed, dict):
        raise InvalidTaskMessage(f"embed must be a map, got {type(embed).__name__}")
    return list(args), kwargs, embed


def _stamped_headers(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
        raise InvalidTaskMessage("header 'stamped_headers' must be a list of names")
    return list(value)


def _stamps(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidTaskMessage(f"header 'stamps' must be a map, got {type(value).__name__}")
    return dict(value)


def _optional_str(headers: Mapping[str, Any], key: str) -> str | None:
    value = headers.get(key)
    if value is None or isinstance(value, str):
        return value
    raise InvalidTaskMessage(f"header {key!r} must be a string, got {type(value).__name__}")


def _optional_int(headers: Mapping[str, Any], key: str) -> int | None:
    value = headers.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise InvalidTaskMessage(f"header {key!r} must be an integer, got {type(value).__name__}")


def _optional_datetime(headers: Mapping[str, Any], key: str) -> dt.datetime | None:
    value = headers.get(key)
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        raise InvalidTaskMessage(f"header {key!r} must be an ISO-8601 string")
    try:
        return parse_iso_datetime(value)
    except ValueError:
        raise InvalidTaskMessage(f"header {key!r} is not ISO-8601: {value[:64]!r}") from None


def _timelimit(value: Any) -> tuple[float | None, float | None]:
    if value is None:
        return (None, None)
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise InvalidTaskMessage("header 'timelimit' must be [hard, soft]")
    limits: list[float | None] = []
    for item in value:
        if item is None:
            limits.append(None)
        elif isinstance(item, int | float) and not isinstance(item, bool) and item >= 0:
            limits.append(float(item) if item else None)
        else:
            raise InvalidTaskMessage("header 'timelimit' values must be non-negative numbers")
    return (limits[0], limits[1])
