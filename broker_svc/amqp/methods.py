"""The AMQP 0-9-1 method frames a consuming child's connection sends, and the ones it parses.

Pure bytes in, bytes out (``broker_svc/amqp/feed_connection.py`` does the I/O). Method ids are
``(class, method)`` as in the spec; the argument layouts are the spec's, tested against pika's.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

from broker_svc.amqp import frames
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_table

__all__ = [
    "BASIC_ACK",
    "BASIC_NACK",
    "BASIC_RETURN",
    "Deliver",
    "close_reason",
    "connection_open",
    "declare_frames",
    "parse_deliver",
    "start_ok",
    "tune_ok",
]

# What a confirm-mode channel is sent about a publish: a confirm, a nack, a mandatory one returned.
BASIC_ACK: Final = (60, 80)
BASIC_NACK: Final = (60, 120)
BASIC_RETURN: Final = (60, 50)

_DELIVER_TAIL: Final = struct.Struct(">QB")


class Deliver(NamedTuple):
    """basic.deliver's arguments."""

    consumer_tag: str
    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str


def start_ok(name: str, user: str, password: str) -> bytes:
    """connection.start-ok: PLAIN login (the broker always offers it), our client properties."""
    response = f"\0{user}\0{password}".encode()
    return frames.method(0, 10, 11, (
        frames.client_properties(name) + frames.short_string("PLAIN")
        + struct.pack(">I", len(response)) + response + frames.short_string("en_US")
    ))  # fmt: skip


def tune_ok(frame_max: int, heartbeat_s: int) -> bytes:
    """connection.tune-ok: one channel, the agreed frame size and heartbeat."""
    return frames.method(0, 10, 31, struct.pack(">HIH", 1, frame_max, heartbeat_s))


def connection_open(virtual_host: str) -> bytes:
    """connection.open of ``virtual_host``."""
    return frames.method(0, 10, 40, frames.short_string(virtual_host) + b"\x00\x00")


def declare_frames(channel: int, spec: QueueSpec) -> list[tuple[tuple[int, int], bytes]]:
    """queue.declare, then (when the spec names one) exchange.declare and queue.bind, each with the
    method id of the answer to wait for."""
    bits = (2 if spec.durable else 0) | (4 if spec.exclusive else 0) | (8 if spec.auto_delete else 0)
    queue = b"\x00\x00" + frames.short_string(spec.name) + bytes((bits,)) + encode_table(spec.arguments)
    sent = [((50, 11), frames.method(channel, 50, 10, queue))]
    exchange = spec.exchange
    if exchange is not None:
        bits = (2 if exchange.durable else 0) | (4 if exchange.auto_delete else 0)
        declare = (
            b"\x00\x00" + frames.short_string(exchange.name) + frames.short_string(exchange.type)
            + bytes((bits,)) + encode_table({})
        )  # fmt: skip
        bind = (
            b"\x00\x00" + frames.short_string(spec.name) + frames.short_string(exchange.name)
            + frames.short_string(spec.routing_key) + b"\x00" + encode_table({})
        )  # fmt: skip
        sent.append(((40, 11), frames.method(channel, 40, 10, declare)))
        sent.append(((50, 21), frames.method(channel, 50, 20, bind)))
    return sent


def parse_deliver(payload: bytes) -> Deliver:
    """basic.deliver's arguments from its method payload."""
    offset = 4
    tag_size = payload[offset]
    consumer_tag = payload[offset + 1 : offset + 1 + tag_size].decode()
    offset += 1 + tag_size
    delivery_tag, redelivered = _DELIVER_TAIL.unpack_from(payload, offset)
    offset += 9
    exchange = payload[offset + 1 : offset + 1 + payload[offset]].decode()
    offset += 1 + payload[offset]
    routing_key = payload[offset + 1 : offset + 1 + payload[offset]].decode()
    return Deliver(consumer_tag, delivery_tag, bool(redelivered & 1), exchange, routing_key)


def close_reason(payload: bytes) -> tuple[int, str]:
    """The reply code and text of connection.close, channel.close or basic.return."""
    code = struct.unpack_from(">H", payload, 4)[0]
    return code, payload[7 : 7 + payload[6]].decode(errors="replace")
