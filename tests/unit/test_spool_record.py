"""A spooled record: its bytes round-trip, and a scan stops at what a crash can leave."""

from __future__ import annotations

import msgpack
import pytest

from broker_svc.spool.record import HEADER, SpooledMessage, decode_payload, encode_payload, frame, scan
from broker_svc.wire.task.task_message import WireMessage


def _spooled(n: int = 1, *, queue_type: str | None = "classic") -> SpooledMessage:
    message = WireMessage(
        body=b"\x93\x91" + bytes([n % 256]) * 10,
        content_type="application/x-msgpack",
        content_encoding="binary",
        headers={"id": f"id-{n}", "task": "t.x", "retries": 0, "eta": None, "nested": {"a": [1, "b", None]}},
        correlation_id=f"id-{n}",
        reply_to="clockwork.reply.x",
        priority=3,
        delivery_mode=2,
        expiration=None,
    )
    return SpooledMessage("", "jobs", queue_type, 1_900_000_000.5, True, message)  # type: ignore[arg-type]


def _records(count: int, start_seq: int = 0) -> bytes:
    return b"".join(frame(start_seq + n, 1000.0 + n, encode_payload(_spooled(n))) for n in range(count))


def test_a_record_round_trips_every_field_of_the_message():
    spooled = _spooled(7)
    records, end = scan(frame(42, 1234.5, encode_payload(spooled)), 0)
    assert [(r.seq, r.at) for r in records] == [(42, 1234.5)]
    assert decode_payload(records[0].payload) == spooled
    assert end == len(frame(42, 1234.5, encode_payload(spooled)))


def test_an_exchange_publish_keeps_no_queue_type():
    spooled = _spooled(1, queue_type=None)
    [record], _ = scan(frame(0, 0.0, encode_payload(spooled)), 0)
    assert decode_payload(record.payload).queue_type is None


@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size, HEADER.size + 5])
def test_a_scan_stops_before_a_record_cut_short(cut: int):
    data = _records(3)
    whole, _ = scan(data, 0)
    torn = data[: whole[1].end + cut]  # the third record cut after ``cut`` bytes
    records, end = scan(torn, 0)
    assert [r.seq for r in records] == [0, 1]
    assert end == whole[1].end


def test_a_scan_stops_at_a_checksum_mismatch_and_at_a_tail_of_zeros():
    data = bytearray(_records(3))
    whole, _ = scan(bytes(data), 0)
    data[whole[1].end - 1] ^= 0xFF  # a flipped bit in the second record's payload
    records, end = scan(bytes(data), 0)
    assert [r.seq for r in records] == [0] and end == whole[0].end
    zeros = _records(2) + b"\0" * 64  # what a power loss can leave after delayed allocation
    records, end = scan(zeros, 0)
    assert [r.seq for r in records] == [0, 1] and end == len(zeros) - 64


def test_a_scan_stops_where_numbers_stop_growing():
    data = _records(2, start_seq=5) + _records(1, start_seq=3)
    records, _ = scan(data, 0)
    assert [r.seq for r in records] == [5, 6]


def test_an_unknown_format_is_refused_and_ext_types_are_never_decoded():
    with pytest.raises(ValueError, match="unknown spool record format"):
        decode_payload(msgpack.packb([99, "x"]))
    ext = msgpack.packb([1, msgpack.ExtType(5, b"boom")], use_bin_type=True)
    with pytest.raises(ValueError, match="ext type"):
        decode_payload(ext)
