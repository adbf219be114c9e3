"""The deliveries a consuming child's socket holds unread, looked at and left there (amqp/peek.py).

The bytes are AMQP frames as the broker writes them, sent through a real socket pair; what the
connection has read and not parsed yet is passed beside it, as ``FeedConnection.held`` does.
"""

from __future__ import annotations

import socket
import struct

from broker_svc.amqp import frames
from broker_svc.amqp.peek import peeked_deliveries
from broker_svc.wire.amqp_fields import encode_properties

_TAGS = {"ctag-1": "jobs"}


def _delivery(tag: int, task_id: str, body: bytes, *, frame_max: int = 131_072) -> bytes:
    # basic.deliver, then the content header and body frames (those of a publish, less its method).
    deliver = frames.method(
        1, 60, 60,
        frames.short_string("ctag-1") + struct.pack(">QB", tag, 0) + frames.short_string("")
        + frames.short_string("jobs"),
    )  # fmt: skip
    properties = encode_properties(content_type="application/json", headers={"id": task_id})
    publish = frames.publish_frames(
        1,
        exchange="",
        routing_key="jobs",
        mandatory=False,
        properties=properties,
        body=body,
        frame_max=frame_max,
    )
    method_size = 7 + struct.unpack_from(">I", publish, 3)[0] + 1
    return deliver + publish[method_size:]


def _socket_holding(data: bytes) -> tuple[socket.socket, socket.socket]:
    ours, broker = socket.socketpair()
    broker.sendall(data)
    return ours, broker


def test_whole_deliveries_are_listed_in_order_and_left_in_the_socket():
    first, second = _delivery(7, "a", b"x" * 10), _delivery(8, "b", b"y" * 5000, frame_max=4096)
    cut_short = _delivery(9, "c", b"z" * 100)[:-20]  # still arriving
    read, unread = first[:30], first[30:] + second + frames.HEARTBEAT + cut_short
    ours, broker = _socket_holding(unread)
    try:
        # The first 30 bytes were read by the connection already, not parsed yet.
        held = peeked_deliveries(ours, read, _TAGS, generation=3)
        assert held is not None
        assert [(d.headers["id"], d.tag, len(d.body), d.queue, d.generation) for d in held] == [
            ("a", 7, 10, "jobs", 3),
            ("b", 8, 5000, "jobs", 3),  # two body frames
        ]
        assert ours.recv(1 << 20) == unread  # nothing was taken from the socket
    finally:
        ours.close()
        broker.close()


def test_a_channel_closed_by_the_broker_means_nothing_is_held():
    close = frames.method(1, 20, 40, struct.pack(">H", 406) + frames.short_string("timed out") + b"\0" * 4)
    ours, broker = _socket_holding(_delivery(1, "a", b"{}") + close)
    try:
        assert peeked_deliveries(ours, b"", _TAGS, generation=1) is None
    finally:
        ours.close()
        broker.close()
