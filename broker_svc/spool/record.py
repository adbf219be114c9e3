"""One spooled task as bytes: a length-prefixed, checksummed record of the encoded wire message.

A record is a fixed header (payload length, CRC-32, sequence number, time spooled) and a msgpack
payload holding what a publish needs: exchange, queue, queue type, ETA, the AMQP properties and
the body, as the client encoded them. The task id is in the headers, so a replay sends the same
task. A record cut short by a crash, or one whose checksum does not match, ends a scan: what
follows it was never acknowledged to anyone as written in order.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack

from broker_svc.wire.codec import refuse_ext
from broker_svc.wire.task.task_message import WireMessage

__all__ = [
    "HEADER",
    "QueueKind",
    "RawRecord",
    "SpooledMessage",
    "decode_payload",
    "encode_payload",
    "frame",
    "scan",
]

# payload length, CRC-32 of (payload, sequence, time), sequence number, time spooled (epoch s)
HEADER: Final = struct.Struct("<IIQd")
_CHECKED: Final = struct.Struct("<Qd")
_VERSION: Final = 1
_MAX_PAYLOAD: Final = 1 << 31

QueueKind = Literal["classic", "quorum"]


@dataclass(frozen=True, slots=True)
class SpooledMessage:
    """What a spooled record holds: the message and where it goes.

    Attributes:
        exchange: the exchange it is published to (empty: the default exchange).
        queue: its routing key (the task queue for the default exchange).
        queue_type: the task queue to declare first, ``classic`` or ``quorum``; None declares none.
        eta_s: the task's ETA (epoch seconds), routed through a delay queue when it is sent.
        mandatory: returned by the broker when no queue takes it.
        message: the encoded message.
    """

    exchange: str
    queue: str
    queue_type: QueueKind | None
    eta_s: float | None
    mandatory: bool
    message: WireMessage


def encode_payload(spooled: SpooledMessage) -> bytes:
    """The payload of a record of ``spooled`` (the costly part, done before a number is given).

    Raises:
        TypeError: a header value msgpack cannot carry.
    """
    m = spooled.message
    payload: bytes = msgpack.packb(
        [
            _VERSION, spooled.exchange, spooled.queue, spooled.queue_type, spooled.eta_s, spooled.mandatory,
            m.content_type, m.content_encoding, m.headers, m.correlation_id, m.reply_to, m.priority,
            m.delivery_mode, m.expiration, m.body,
        ],
        use_bin_type=True,
    )  # fmt: skip
    return payload


def frame(seq: int, at: float, payload: bytes) -> bytes:
    """The record of ``payload``, numbered ``seq`` and spooled at ``at`` (epoch seconds)."""
    return HEADER.pack(len(payload), _checksum(seq, at, payload), seq, at) + payload


def _checksum(seq: int, at: float, payload: bytes) -> int:
    return zlib.crc32(_CHECKED.pack(seq, at), zlib.crc32(payload))


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A record found by ``scan``: its number, time, payload and where it ends in the buffer."""

    seq: int
    at: float
    payload: bytes
    end: int


def scan(buffer: bytes, start: int) -> tuple[list[RawRecord], int]:
    """The whole, valid records in ``buffer`` from ``start``, and the offset where they end.

    The scan stops at the first record that is cut short or fails its checksum, or whose
    sequence number does not grow; the returned offset is then where that record starts.
    """
    records: list[RawRecord] = []
    offset = start
    last_seq = -1
    size = len(buffer)
    while offset + HEADER.size <= size:
        length, crc, seq, at = HEADER.unpack_from(buffer, offset)
        begin = offset + HEADER.size
        end = begin + length
        if length >= _MAX_PAYLOAD or end > size or seq <= last_seq:
            break
        payload = bytes(buffer[begin:end])
        if _checksum(seq, at, payload) != crc:
            break
        records.append(RawRecord(seq, at, payload, end))
        last_seq = seq
        offset = end
    return records, offset


def decode_payload(payload: bytes) -> SpooledMessage:
    """The message a record's payload holds.

    Raises:
        ValueError: not a payload this version wrote (the checksum matched, so a newer format).
    """
    fields: list[Any] = msgpack.unpackb(
        payload, raw=False, use_list=True, strict_map_key=False, ext_hook=refuse_ext
    )
    if not fields or fields[0] != _VERSION or len(fields) != 15:
        raise ValueError(f"unknown spool record format {fields[:1]!r}")
    (
        _, exchange, queue, queue_type, eta_s, mandatory, content_type, content_encoding, headers,
        correlation_id, reply_to, priority, delivery_mode, expiration, body,
    ) = fields  # fmt: skip
    message = WireMessage(
        body=body,
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        correlation_id=correlation_id,
        reply_to=reply_to,
        priority=priority,
        delivery_mode=delivery_mode,
        expiration=expiration,
    )
    return SpooledMessage(exchange, queue, queue_type, eta_s, bool(mandatory), message)
