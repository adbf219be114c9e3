from __future__ import annotations

import datetime as dt
import decimal
import json
import pickle
import uuid
import zlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_svc.errors import ContentDisallowed, DecodeError, MessageTooLarge
from broker_svc.wire import codec

ACCEPT = codec.accept_set(["msgpack", "json"])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text() | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=20,
)


@given(json_values)
def test_msgpack_round_trips(value):
    body, content_type, _ = codec.encode(value, "msgpack")
    assert codec.decode(body, content_type, accept=ACCEPT, max_bytes=1 << 20) == value


@given(json_values)
def test_json_round_trips(value):
    body, content_type, encoding = codec.encode(value, "json")
    assert encoding == "utf-8"
    assert codec.decode(body, content_type, accept=ACCEPT, max_bytes=1 << 20) == value


def test_json_wraps_types_as_kombu_does():
    value = {
        "when": dt.datetime(2026, 11, 21, 8, 0, tzinfo=dt.UTC),
        "amount": decimal.Decimal("1.10"),
        "id": uuid.UUID(int=5),
        "raw": b"\xff\x00",
    }
    body, content_type, _ = codec.encode(value, "json")
    wire = json.loads(body)
    assert wire["when"] == {"__type__": "datetime", "__value__": "2026-11-21T08:00:00+00:00"}
    assert wire["amount"] == {"__type__": "decimal", "__value__": "1.10"}
    assert codec.decode(body, content_type, accept=ACCEPT, max_bytes=1 << 20) == value


def test_pickle_is_refused_without_being_read(monkeypatch):
    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(a))
    with pytest.raises(ContentDisallowed):
        codec.decode(pickle.dumps([1]), "application/x-python-serialize", accept=ACCEPT, max_bytes=100)
    assert calls == []


def test_unknown_serializer_names_are_refused():
    with pytest.raises(ContentDisallowed):
        codec.accept_set(["pickle"])
    with pytest.raises(ContentDisallowed):
        codec.encode(1, "yaml")


def test_oversized_bodies_are_refused_before_decoding():
    with pytest.raises(MessageTooLarge):
        codec.decode(b"x" * 101, codec.JSON, accept=ACCEPT, max_bytes=100)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
        msgpack.packb(msgpack.ExtType(5, b"x")),
        b"\x91" * 100_000,  # nesting deeper than any sane task
    ],
)
def test_bad_msgpack_raises_decode_error(body):
    with pytest.raises(DecodeError):
        codec.decode(body, codec.MSGPACK, accept=ACCEPT, max_bytes=1 << 20)


def test_bad_json_raises_decode_error():
    with pytest.raises(DecodeError):
        codec.decode(b"[" * 100_000, codec.JSON, accept=ACCEPT, max_bytes=1 << 20)
    with pytest.raises(DecodeError):
        codec.decode(b"\xff", codec.JSON, accept=ACCEPT, max_bytes=1 << 20)


def test_decompression_is_bounded():
    bomb = zlib.compress(b"\0" * 10_000_000)
    with pytest.raises(MessageTooLarge):
        codec.decompress(bomb, "application/x-gzip", max_bytes=1000)
    assert codec.decompress(zlib.compress(b"abc"), "application/x-gzip", max_bytes=10) == b"abc"
    with pytest.raises(ContentDisallowed):
        codec.decompress(b"", "application/x-brotli", max_bytes=10)
