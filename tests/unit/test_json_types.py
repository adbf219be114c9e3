"""kombu's JSON types in both directions, and across the pool hand-off, byte for byte as kombu writes them."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid

import pytest
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from broker_svc.errors import DecodeError
from broker_svc.wire import codec
from worker import ipc

UUID = uuid.UUID("12345678-1234-5678-1234-567812345678")
VALUES: dict[str, object] = {
    "datetime": dt.datetime(2026, 11, 24, 20, 1, 2, 345678, tzinfo=dt.UTC),
    "naive": dt.datetime(2026, 11, 24, 20, 1, 2),
    "date": dt.date(2026, 11, 24),
    "time": dt.time(20, 1, 2, 5),
    "decimal": decimal.Decimal("12345.678901234567890"),
    "uuid": UUID,
    "text_bytes": b"plain text",
    "binary": b"\xff\x00\xfe",
}
ACCEPT = codec.accept_set(["json", "msgpack"])


def test_we_decode_what_kombu_encodes():
    body = kombu_dumps([[VALUES], {}, {}]).encode()
    assert codec.decode(body, codec.JSON, accept=ACCEPT, max_bytes=1 << 20) == [[VALUES], {}, {}]


def test_kombu_decodes_what_we_encode_and_we_write_its_bytes():
    body, content_type, _ = codec.encode(VALUES, "json")
    assert content_type == codec.JSON
    assert kombu_loads(body) == VALUES
    assert json.loads(body) == json.loads(kombu_dumps(VALUES))


def test_a_plain_hex_uuid_is_read_too():
    body = json.dumps({"u": {"__type__": "uuid", "__value__": UUID.hex}}).encode()
    assert codec.decode(body, codec.JSON, accept=ACCEPT, max_bytes=1 << 20) == {"u": UUID}


def test_a_malformed_wrapper_is_a_decode_error_not_a_crash():
    body = json.dumps({"__type__": "uuid", "__value__": {"nope": 1}}).encode()
    with pytest.raises(DecodeError):
        codec.decode(body, codec.JSON, accept=ACCEPT, max_bytes=1 << 20)


def test_every_json_type_crosses_the_pool_hand_off_and_back():
    frame = {"op": "run", "args": [VALUES, list(VALUES.values())], "nested": {"set": {1, 2}}}
    data = ipc.encode_frame(frame)
    decoded = ipc.decode_frame(data[ipc.HEADER.size :])
    assert decoded["args"] == [VALUES, list(VALUES.values())]
    assert sorted(decoded["nested"]["set"]) == [1, 2]


def test_an_object_nothing_can_carry_is_still_a_clear_error():
    with pytest.raises(TypeError, match="object"):
        ipc.encode_frame({"op": "done", "value": object()})
