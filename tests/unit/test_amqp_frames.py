"""The hand-written frames of a consuming child's connection, checked against pika's own codec."""

from __future__ import annotations

import datetime as dt
import struct

import pika.data
import pika.frame
import pika.spec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_svc.amqp import frames
from broker_svc.wire.amqp_fields import encode_properties, encode_table

_scalars = (
    st.text(max_size=40)
    | st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
    | st.booleans()
    | st.none()
    | st.binary(max_size=20)
    | st.datetimes(min_value=dt.datetime(1971, 1, 1), max_value=dt.datetime(2100, 1, 1)).map(
        lambda d: d.replace(microsecond=0, tzinfo=dt.UTC)
    )
)
_keys = st.text(min_size=1, max_size=20).filter(lambda k: len(k.encode()) <= 255)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)
_tables = st.dictionaries(_keys, _values, max_size=8)


@given(_tables)
def test_a_table_decodes_to_what_was_encoded_and_to_what_pika_reads(table):
    encoded = encode_table(table)
    ours = frames.decode_table(encoded)
    assert ours == table
    theirs, _ = pika.data.decode_table(encoded, 0)
    assert ours == theirs


@given(
    content_type=st.none() | st.sampled_from(["application/json", "application/x-msgpack"]),
    headers=st.none() | _tables,
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 9),
    correlation_id=st.none() | st.text(max_size=36).filter(lambda s: len(s.encode()) <= 255),
    reply_to=st.none() | st.text(max_size=36).filter(lambda s: len(s.encode()) <= 255),
    body_size=st.integers(0, 1 << 40),
)
def test_a_content_header_reads_as_pika_reads_it(
    content_type, headers, delivery_mode, priority, correlation_id, reply_to, body_size
):
    properties = encode_properties(
        content_type=content_type, headers=headers, delivery_mode=delivery_mode, priority=priority,
        correlation_id=correlation_id, reply_to=reply_to,
    )  # fmt: skip
    payload = struct.pack(">HHQ", 60, 0, body_size) + properties
    ours = frames.decode_properties(payload)
    theirs = pika.spec.BasicProperties()
    theirs.decode(properties)
    assert ours.body_size == body_size
    for name in ("content_type", "delivery_mode", "priority", "correlation_id", "reply_to"):
        assert getattr(ours, name) == getattr(theirs, name)
    assert ours.headers == theirs.headers


def test_frames_come_off_a_buffer_only_when_whole():
    data = frames.method(1, 60, 80, struct.pack(">QB", 7, 0)) + frames.HEARTBEAT
    buffer = bytearray(data[:5])
    assert frames.next_frame(buffer) is None
    buffer += data[5:]
    first = frames.next_frame(buffer)
    assert first is not None and first.type == frames.FRAME_METHOD and first.channel == 1
    assert first.method_id == (60, 80)
    beat = frames.next_frame(buffer)
    assert beat is not None and beat.type == frames.FRAME_HEARTBEAT
    assert frames.next_frame(buffer) is None and not buffer


def test_a_frame_without_its_end_octet_is_an_error():
    bad = bytearray(frames.HEARTBEAT[:-1] + b"\x00")
    with pytest.raises(frames.FrameError, match="0xCE"):
        frames.next_frame(bad)


def test_a_publish_is_split_into_body_frames_pika_reads_back():
    body = bytes(range(256)) * 100  # 25,600 bytes over 4,096-byte frames
    properties = encode_properties(content_type="application/json", headers={"id": "x"}, delivery_mode=2)
    data = frames.publish_frames(
        1, exchange="", routing_key="q", mandatory=True, properties=properties, body=body, frame_max=4096
    )
    decoded, offset = [], 0
    while offset < len(data):
        used, frame = pika.frame.decode_frame(data[offset:])
        decoded.append(frame)
        offset += used
    publish, header, *bodies = decoded
    assert publish.method.NAME == "Basic.Publish" and publish.method.routing_key == "q"
    assert publish.method.mandatory is True
    assert header.body_size == len(body) and header.properties.headers == {"id": "x"}
    assert b"".join(f.fragment for f in bodies) == body
    assert all(len(f.fragment) <= 4096 - 8 for f in bodies)


def test_a_table_cut_short_is_an_error():
    encoded = encode_table({"key": "value"})
    with pytest.raises(frames.FrameError):
        frames.decode_table(encoded[:-2])


@pytest.mark.parametrize("value", ["value", 7, True, None, [1, "a"], {"a": 1}])
def test_a_value_that_overruns_its_table_is_an_error(value):
    # The table's length is intact; the entry's own length (or the table's end) is not.
    encoded = bytearray(encode_table({"k": value}))
    if isinstance(value, str):
        encoded[8:12] = (100).to_bytes(4, "big")  # the long string's length, past the table's end
    else:
        encoded[0:4] = (len(encoded) - 4 - 1).to_bytes(4, "big")  # the table ends inside the entry
        encoded = encoded[:-1]
    with pytest.raises(frames.FrameError):
        frames.decode_table(bytes(encoded))
