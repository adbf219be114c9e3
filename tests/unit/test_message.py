from __future__ import annotations

import datetime as dt

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_svc.errors import ContentDisallowed, InvalidTaskMessage
from broker_svc.wire import codec
from broker_svc.wire.task.task_message import TaskMessage, decode_task, encode_task

ACCEPT = codec.accept_set(["msgpack", "json"])

args_strategy = st.lists(st.integers(-(2**31), 2**31) | st.text(max_size=20) | st.none(), max_size=5)
kwargs_strategy = st.dictionaries(
    st.text(min_size=1, max_size=10), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10), max_size=4
)


def _decode(wire):
    return decode_task(
        wire.body,
        wire.headers,
        content_type=wire.content_type,
        accept=ACCEPT,
        max_bytes=1 << 20,
        correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
        priority=wire.priority,
    )


@given(args_strategy, kwargs_strategy, st.sampled_from(["msgpack", "json"]), st.integers(0, 2**31 - 1))
def test_task_round_trips(args, kwargs, serializer, clock):
    message = TaskMessage(
        id=TaskMessage.new_id(), task="t.x", args=args, kwargs=kwargs, clock=clock, reply_to="r"
    )
    decoded = _decode(encode_task(message, serializer=serializer))
    assert (decoded.id, decoded.task, decoded.args, decoded.kwargs) == (message.id, "t.x", args, kwargs)
    assert decoded.clock == clock
    assert decoded.reply_to == "r"


def test_headers_match_celery_protocol_v2():
    eta = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    message = TaskMessage(id="abc", task="t.x", args=[1], eta=eta, timelimit=(10.0, 5.5), clock=3)
    wire = encode_task(message, serializer="json")
    h = wire.headers
    assert h["task"] == "t.x" and h["id"] == "abc" and h["lang"] == "py"
    assert h["root_id"] == "abc" and h["parent_id"] is None
    assert h["eta"] == "2030-01-01T00:00:00+00:00"
    assert h["timelimit"] == [10, 6]  # [hard, soft], whole seconds rounded up, never floats
    assert h["argsrepr"] == "[1]" and h["kwargsrepr"] == "{}"
    assert h["clock"] == 3
    assert wire.correlation_id == "abc" and wire.delivery_mode == 2 and wire.priority == 0
    assert msgpack.unpackb(encode_task(message, serializer="msgpack").body) == [[1], {}, message.embed]


def test_expires_sets_the_amqp_expiration_in_milliseconds():
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    wire = encode_task(TaskMessage(id="a", task="t", expires=expires), serializer="json")
    assert wire.expiration is not None and 55_000 < int(wire.expiration) <= 60_000


def test_a_message_with_only_task_and_id_headers_is_accepted():
    decoded = decode_task(
        b"[[3,4],{},{}]", {"task": "t.add", "id": "x"}, content_type=codec.JSON, accept=ACCEPT, max_bytes=100
    )
    assert decoded.args == [3, 4] and decoded.retries == 0 and decoded.timelimit == (None, None)


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (None, b"[[],{},{}]"),
        ({"id": "x"}, b"[[],{},{}]"),
        ({"task": "t"}, b"[[],{},{}]"),
        ({"task": "t", "id": "x"}, b'{"args": []}'),
        ({"task": "t", "id": "x"}, b"[1, {}, {}]"),
        ({"task": "t", "id": "x"}, b"[[], [], {}]"),
        ({"task": "t", "id": "x", "eta": "tomorrow"}, b"[[],{},{}]"),
        ({"task": "t", "id": "x", "retries": "1"}, b"[[],{},{}]"),
        ({"task": "t", "id": "x", "timelimit": [1]}, b"[[],{},{}]"),
    ],
)
def test_invalid_task_messages_are_rejected(headers, body):
    with pytest.raises(InvalidTaskMessage):
        decode_task(body, headers, content_type=codec.JSON, accept=ACCEPT, max_bytes=100)


def test_disallowed_content_type_is_rejected_before_decoding():
    with pytest.raises(ContentDisallowed):
        decode_task(b"\x80", {"task": "t", "id": "x"}, content_type="application/x-python-serialize",
                    accept=ACCEPT, max_bytes=100)  # fmt: skip


def test_header_ints_outside_32_bits_are_refused_on_encode():
    with pytest.raises(ValueError):
        encode_task(TaskMessage(id="a", task="t", retries=2**40), serializer="json")


def test_ints_beyond_64_bits_are_a_type_error():
    with pytest.raises(TypeError):
        encode_task(TaskMessage(id="a", task="t", args=[2**70]), serializer="msgpack")


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
@pytest.mark.parametrize("kwargs", [{"args": [object()]}, {"kwargs": {"when": object()}}])
def test_an_argument_that_cannot_be_encoded_names_the_task_and_its_id(serializer: str, kwargs: dict):
    with pytest.raises(TypeError, match=r"^cannot send task 'proj\.add' \(id id-7\): .*object"):
        encode_task(TaskMessage(id="id-7", task="proj.add", **kwargs), serializer=serializer)


@pytest.mark.parametrize(
    "extra",
    [
        {"x-deep": {"a": [1, {"b": 2**31}]}},  # nested in a table and a list
        {"x-float": 1.5},  # pika cannot send a float; pamqp sends 32 bits
        {"x-tuple": (1, 2)},  # not a list: not portable
    ],
)
def test_extra_headers_are_checked_all_the_way_down(extra):
    with pytest.raises(ValueError):
        encode_task(TaskMessage(id="a", task="t", extra_headers=extra), serializer="json")


def test_subclassed_header_values_still_pass_the_check():
    class Name(str):
        pass

    class Table(dict):  # a Mapping that is not exactly a dict
        pass

    wire = encode_task(
        TaskMessage(id="a", task="t", extra_headers={"x-name": Name("n"), "x-table": Table(n=2**31 - 1)}),
        serializer="json",
    )
    assert wire.headers["x-table"] == {"n": 2**31 - 1}
