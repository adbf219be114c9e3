"""AMQP 0-9-1 frames for a consuming pool child's own connection: split, read and written by hand.

Pure (no sockets). A consuming child spends most of its time here, once per delivery: the
general-purpose clients (pika, pamqp) decode each frame through layers of objects, and at one
delivery in flight per child that is most of the child's CPU. This module reads exactly the frames
a consumer meets (deliver, content header and body, confirms, returns, closes, heartbeats) and
writes the few it sends; the connection's life cycle is in ``broker_svc/amqp/feed_connection.py``.

Header tables decode as pika decodes them: long strings as ``str`` (``bytes`` if not UTF-8),
timestamps as UTC datetimes, decimals as ``Decimal``; floats stay floats (pika truncates them).
"""

from __future__ import annotations

import datetime as dt
import decimal
import struct
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.wire.amqp_fields import encode_table

__all__ = [
    "FRAME_BODY",
    "FRAME_END",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "HEARTBEAT",
    "Frame",
    "FrameError",
    "Properties",
    "decode_properties",
    "decode_table",
    "method",
    "next_frame",
    "publish_frames",
    "short_string",
]

FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = b"\xce"
HEARTBEAT: Final = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_FRAME_HEAD = struct.Struct(">BHI")
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U64 = struct.Struct(">Q")
_METHOD_ID = struct.Struct(">HH")
_HEADER_HEAD = struct.Struct(">HHQH")  # class, weight, body size, first property-flags word


class FrameError(ValueError):
    """The broker sent bytes that are not AMQP 0-9-1 as we read it (the connection must go)."""


# Not frozen (nor Properties): a child builds three frames and a header per delivery, and a
# frozen dataclass's __init__ costs about three times as much. Nobody changes one once built.
@dataclass(slots=True)
class Frame:
    """One frame: its type, channel and payload (a method frame's starts with class and method ids)."""

    type: int
    channel: int
    payload: bytes

    @property
    def method_id(self) -> tuple[int, int]:
        """``(class_id, method_id)`` of a method frame."""
        class_id, method_id = _METHOD_ID.unpack_from(self.payload, 0)
        return class_id, method_id


def next_frame(buffer: bytearray) -> Frame | None:
    """Take one whole frame off the front of ``buffer``; None if it does not hold one yet.

    Raises:
        FrameError: the frame does not end with the frame-end octet.
    """
    if len(buffer) < 7:
        return None
    kind, channel, size = _FRAME_HEAD.unpack_from(buffer, 0)
    end = 7 + size
    if len(buffer) < end + 1:
        return None
    if buffer[end] != 0xCE:
        raise FrameError(f"frame of type {kind} does not end with 0xCE")
    payload = bytes(buffer[7:end])
    del buffer[: end + 1]
    return Frame(kind, channel, payload)


def method(channel: int, class_id: int, method_id: int, arguments: bytes = b"") -> bytes:
    """A method frame's bytes."""
    payload = _METHOD_ID.pack(class_id, method_id) + arguments
    return _FRAME_HEAD.pack(FRAME_METHOD, channel, len(payload)) + payload + FRAME_END


def short_string(value: str) -> bytes:
    """An AMQP short string (length octet, UTF-8).

    Raises:
        ValueError: longer than 255 bytes.
    """
    raw = value.encode()
    if len(raw) > 255:
        raise ValueError(f"AMQP short string over 255 bytes: {value[:40]!r}...")
    return _U8.pack(len(raw)) + raw


def publish_frames(
    channel: int,
    *,
    exchange: str,
    routing_key: str,
    mandatory: bool,
    properties: bytes,
    body: bytes,
    frame_max: int,
) -> bytes:
    """``basic.publish``, its content header and body frames, as one write.

    ``properties``: the flags and fields (``broker_svc.wire.amqp_fields.encode_properties``).
    """
    arguments = (
        b"\x00\x00" + short_string(exchange) + short_string(routing_key) + (b"\x01" if mandatory else b"\x00")
    )
    header = _U16.pack(60) + b"\x00\x00" + _U64.pack(len(body)) + properties
    parts = [
        method(channel, 60, 40, arguments),
        _FRAME_HEAD.pack(FRAME_HEADER, channel, len(header)),
        header,
        FRAME_END,
    ]
    chunk = frame_max - 8  # a body frame's payload: the frame less its 7-byte head and end octet
    for start in range(0, len(body), chunk):
        piece = body[start : start + chunk]
        parts += (_FRAME_HEAD.pack(FRAME_BODY, channel, len(piece)), piece, FRAME_END)
    return b"".join(parts)


@dataclass(slots=True)
class Properties:
    """A content header: the body's size and the basic properties a consumer reads."""

    body_size: int
    content_type: str | None = None
    content_encoding: str | None = None
    headers: dict[str, Any] | None = None
    delivery_mode: int | None = None
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: int | None = None
    type: str | None = None
    user_id: str | None = None
    app_id: str | None = None


def decode_properties(payload: bytes) -> Properties:
    """A content header frame's payload.

    Raises:
        FrameError: the header is cut short or holds a type we do not know.
    """
    try:
        _class, _weight, body_size, flags = _HEADER_HEAD.unpack_from(payload, 0)
        offset = _HEADER_HEAD.size
        while flags & 0x0001:  # a continuation word: no basic property lives there
            (flags_more,) = _U16.unpack_from(payload, offset)
            offset += 2
            flags = (flags & ~0x0001) | (flags_more & 0x0001)
        values: dict[str, Any] = {}
        lowest = flags & -flags  # the fields come highest bit first: none is left below this one
        for bit, name, kind in _PROPERTY_FIELDS:
            if not flags & bit:
                if bit < lowest:
                    break
                continue
            if kind == "s":
                length = payload[offset]
                values[name] = payload[offset + 1 : offset + 1 + length].decode()
                offset += 1 + length
            elif kind == "o":
                values[name] = payload[offset]
                offset += 1
            elif kind == "t":
                (values[name],) = _U64.unpack_from(payload, offset)
                offset += 8
            else:
                values[name], offset = _table(payload, offset)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise FrameError(f"malformed content header: {exc}") from exc
    return Properties(body_size=body_size, **values)


_PROPERTY_FIELDS: Final = (
    (0x8000, "content_type", "s"),
    (0x4000, "content_encoding", "s"),
    (0x2000, "headers", "F"),
    (0x1000, "delivery_mode", "o"),
    (0x0800, "priority", "o"),
    (0x0400, "correlation_id", "s"),
    (0x0200, "reply_to", "s"),
    (0x0100, "expiration", "s"),
    (0x0080, "message_id", "s"),
    (0x0040, "timestamp", "t"),
    (0x0020, "type", "s"),
    (0x0010, "user_id", "s"),
    (0x0008, "app_id", "s"),
    (0x0004, "cluster_id", "s"),
)


def decode_table(data: bytes) -> dict[str, Any]:
    """A whole encoded field table (its length first), as pika decodes it.

    Raises:
        FrameError: cut short, or a value type AMQP does not define.
    """
    try:
        table, _ = _table(data, 0)
    except (struct.error, IndexError) as exc:
        raise FrameError(f"malformed field table: {exc}") from exc
    return table


# Header names repeat on every delivery (Celery's twenty, ours, the broker's): each is decoded
# once. Bounded, as a peer could send names without end.
_KEYS: Final[dict[bytes, str]] = {}
_KEYS_MAX: Final = 1024


def _table(data: bytes, offset: int) -> tuple[dict[str, Any], int]:
    # A task's header table holds about 20 entries, decoded for every delivery: the common types
    # (long strings, void, ints, booleans, nested tables), most common first, are read here in the
    # loop, the rest by ``_value``.
    (length,) = _U32.unpack_from(data, offset)
    offset += 4
    end = offset + length
    if end > len(data):
        raise FrameError("a field table is cut short")
    table: dict[str, Any] = {}
    unpack_u32, unpack_i32, keys = _U32.unpack_from, _I32.unpack_from, _KEYS
    while offset < end:
        key_end = offset + 1 + data[offset]
        raw_key = data[offset + 1 : key_end]
        key = keys.get(raw_key)
        if key is None:
            key = raw_key.decode("utf-8", "replace")
            if len(keys) < _KEYS_MAX:
                keys[raw_key] = key
        kind = data[key_end]
        offset = key_end + 1
        if kind == 83:  # S
            (size,) = unpack_u32(data, offset)
            offset += 4
            raw = data[offset : offset + size]
            if len(raw) != size:
                raise FrameError("a long string is cut short")
            offset += size
            try:
                table[key] = raw.decode()
            except UnicodeDecodeError:
                table[key] = raw
        elif kind == 86:  # V
            table[key] = None
        elif kind == 73:  # I
            (table[key],) = unpack_i32(data, offset)
            offset += 4
        elif kind == 116:  # t
            table[key] = bool(data[offset])
            offset += 1
        elif kind == 70:  # F
            table[key], offset = _table(data, offset)
        else:
            table[key], offset = _value(data, offset - 1)
    if offset != end:
        raise FrameError("a field table's entries overrun its length")
    return table, end


def _value(data: bytes, offset: int) -> tuple[Any, int]:
    kind = data[offset : offset + 1]
    offset += 1
    if kind == b"S":
        (length,) = _U32.unpack_from(data, offset)
        if offset + 4 + length > len(data):
            raise FrameError("a long string is cut short")
        raw = data[offset + 4 : offset + 4 + length]
        try:
            return raw.decode(), offset + 4 + length
        except UnicodeDecodeError:
            return raw, offset + 4 + length
    reader = _READERS.get(kind)
    if reader is not None:
        fmt, to_python = reader
        (value,) = fmt.unpack_from(data, offset)
        return to_python(value), offset + fmt.size
    if kind == b"F":
        return _table(data, offset)
    if kind == b"A":
        (length,) = _U32.unpack_from(data, offset)
        offset += 4
        end = offset + length
        items = []
        while offset < end:
            item, offset = _value(data, offset)
            items.append(item)
        return items, end
    if kind == b"D":
        places = data[offset]
        (raw,) = struct.unpack_from(">i", data, offset + 1)
        return decimal.Decimal(raw) * (decimal.Decimal(10) ** -places), offset + 5
    if kind == b"V":
        return None, offset
    if kind == b"x":
        (length,) = _U32.unpack_from(data, offset)
        return bytes(data[offset + 4 : offset + 4 + length]), offset + 4 + length
    raise FrameError(f"unknown field type {kind!r} in a table")


def _timestamp(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


_READERS: Final[dict[bytes, tuple[struct.Struct, Any]]] = {
    b"t": (struct.Struct(">B"), bool),
    b"b": (struct.Struct(">b"), int),
    b"B": (struct.Struct(">B"), int),
    b"U": (struct.Struct(">h"), int),
    b"s": (struct.Struct(">h"), int),
    b"u": (struct.Struct(">H"), int),
    b"I": (struct.Struct(">i"), int),
    b"i": (struct.Struct(">I"), int),
    b"L": (struct.Struct(">q"), int),
    b"l": (struct.Struct(">q"), int),
    b"f": (struct.Struct(">f"), float),
    b"d": (struct.Struct(">d"), float),
    b"T": (struct.Struct(">Q"), _timestamp),
}

# Written by the connection's handshake: its client properties as a table (capabilities included).
CLIENT_CAPABILITIES: Final = {
    "publisher_confirms": True,
    "consumer_cancel_notify": True,
    "basic.nack": True,
    "connection.blocked": True,
    "authentication_failure_close": True,
}


def client_properties(connection_name: str) -> bytes:
    """The ``client-properties`` table of ``connection.start-ok``."""
    return encode_table(
        {"product": "clockwork", "connection_name": connection_name, "capabilities": CLIENT_CAPABILITIES}
    )
