"""Our content-header encoder against pika's: the same bytes for any table pika accepts."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
from typing import Any

import pika
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_svc.wire.amqp_fields import encode_properties, encode_table

_names = st.text(min_size=0, max_size=20)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
    | st.text(max_size=40)
    | st.binary(max_size=20)
    | st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2200, 1, 1)).map(
        lambda value: value.replace(microsecond=0)
    )
)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_names, children, max_size=4),
    max_leaves=12,
)
_tables = st.dictionaries(_names, _values, max_size=12)
_short = st.none() | st.text(max_size=30)


def _pika(**fields: Any) -> bytes:
    return b"".join(pika.BasicProperties(**fields).encode())


@settings(max_examples=400, deadline=None)
@given(table=_tables)
def test_a_table_is_encoded_as_pika_encodes_it(table: dict[str, Any]) -> None:
    # Twice: the second encoding is built from the kept entries.
    for _ in range(2):
        assert encode_properties(headers=table) == _pika(headers=table)


@settings(max_examples=200, deadline=None)
@given(
    content_type=_short,
    content_encoding=_short,
    headers=st.none() | _tables,
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 255),
    correlation_id=_short,
    reply_to=_short,
    expiration=st.none() | st.integers(0, 10**9).map(str),
)
def test_every_property_is_encoded_as_pika_encodes_it(**fields: Any) -> None:
    assert encode_properties(**fields) == _pika(**fields)


def test_a_celery_message_header_table_matches() -> None:
    headers = {
        "lang": "py",
        "task": "proj.add",
        "id": "3f1c0e3c-1b7e-4c53-a3a1-0c1c1c1c1c1c",
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": "3f1c0e3c-1b7e-4c53-a3a1-0c1c1c1c1c1c",
        "parent_id": None,
        "argsrepr": "(2, 2)",
        "kwargsrepr": "{}",
        "origin": "gen1@host",
        "ignore_result": False,
        "clock": 1 << 40,
    }
    assert encode_table(headers) == b"".join(_table_with_pika(headers))


def test_subclasses_and_rare_types_follow_pikas_order() -> None:
    class Color(enum.StrEnum):
        RED = "red"

    table = {"enum": Color.RED, "dec": decimal.Decimal("1.25"), "whole": decimal.Decimal("7")}
    assert encode_properties(headers=table) == _pika(headers=table)


@pytest.mark.parametrize("value", [1.5, (1, 2), {1, 2}, object()])
def test_a_value_pika_cannot_carry_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="AMQP header value"):
        encode_table({"x": value})


def test_overlong_names_and_integers_are_value_errors() -> None:
    with pytest.raises(ValueError, match="255 bytes"):
        encode_table({"k" * 256: 1})
    with pytest.raises(ValueError, match="255 bytes"):
        encode_properties(correlation_id="c" * 256)
    with pytest.raises(ValueError, match="64 bits"):
        encode_table({"big": 1 << 63})


def test_true_and_one_are_kept_apart() -> None:
    assert encode_table({"flag": True}) != encode_table({"flag": 1})
    assert encode_table({"flag": 1}) == b"".join(_table_with_pika({"flag": 1}))


def _table_with_pika(table: dict[str, Any]) -> list[bytes]:
    pieces: list[bytes] = []
    pika.data.encode_table(pieces, table)
    return pieces
