"""Dead letters read and planned for a requeue (broker_svc.wire.records.dead_letter), without a broker."""

from __future__ import annotations

import datetime as dt
import json
import pickle
import zlib
from typing import Any

import msgpack
import pytest

from broker_svc.wire.records.dead_letter import (
    DeadLetter,
    dead_queue_name,
    letter_key,
    marker_key,
    plan_requeue,
    view_body,
)
from broker_svc.wire.records.dedup import (
    DEADLINE_HEADER,
    KEY_HEADER,
    TARGET_QUEUE_HEADER,
    TIMEOUT_HEADER,
    shard_of,
)

NOW = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
BODY = json.dumps([[1, 2], {"k": "v"}, {}]).encode()


def dead_headers(**extra: Any) -> dict[str, Any]:
    return {
        "id": "t-1", "task": "app.add", "retries": 0, "x-clockwork-reason": "delivery_limit",
        "x-clockwork-error": "3 deliveries did not finish", "x-clockwork-queue": "orders",
        "x-clockwork-dead-at": "2025-01-01T00:00:00.123456+00:00", "x-clockwork-deliveries": 3,
        "x-delivery-count": 2, **extra,
    }  # fmt: skip


def letter(headers: dict[str, Any] | None = None, body: bytes = BODY, **properties: Any) -> DeadLetter:
    props = {"content_type": "application/json", "delivery_mode": 2, "reply_to": None, **properties}
    return DeadLetter.read("orders.dead", dead_headers() if headers is None else headers, props, body)


def plan(dead: DeadLetter, to: str | None = None) -> Any:
    return plan_requeue(dead, to=to, namespace="shop", by="ctl1@h", clock=7, now=NOW)


def test_a_dead_letter_says_what_it_is_and_where_it_came_from():
    dead = letter()
    assert (dead.task_id, dead.task, dead.reason, dead.queue, dead.requeued) == (
        "t-1", "app.add", "delivery_limit", "orders", 0
    )  # fmt: skip
    assert dead.content_type == "application/json" and "reply_to" not in dead.properties
    # Without x-clockwork-queue: the dead queue's name without .dead; malformed headers read as none.
    bare = DeadLetter.read("billing.dead", {"id": 5, "task": None}, {}, b"")
    assert (bare.queue, bare.task_id, bare.task, bare.reason) == ("billing", None, None, None)
    assert letter().as_dict()["size"] == len(BODY)


def test_the_copy_drops_the_dead_letters_headers_and_the_delivery_counts_and_says_it_was_requeued():
    dead = letter(
        dead_headers(**{"x-clockwork-resent": True, "x-clockwork-rate-reserved": True, "x-death": []})
    )
    copy = plan(dead)
    assert (copy.routing_key, copy.queue) == ("orders", "orders")
    assert copy.headers["id"] == "t-1" and copy.headers["retries"] == 0 and copy.headers["clock"] == 7
    for gone in (
        "x-clockwork-reason", "x-clockwork-error", "x-clockwork-queue", "x-clockwork-dead-at",
        "x-clockwork-deliveries", "x-delivery-count", "x-clockwork-resent", "x-clockwork-rate-reserved",
        "x-death",
    ):  # fmt: skip
        assert gone not in copy.headers, gone
    assert copy.headers["x-clockwork-requeued"] == {
        "count": 1, "at": NOW.isoformat(), "by": "ctl1@h", "from": "orders.dead", "reason": "delivery_limit",
        "dead_at": "2025-01-01T00:00:00.123456+00:00", "key": dead.key,
    }  # fmt: skip
    # Dead-lettered again after a requeue: the next requeue counts on.
    again = letter({**copy.headers, **dead_headers()})
    assert again.requeued == 1 and plan(again).headers["x-clockwork-requeued"]["count"] == 2


def test_a_copy_goes_where_it_is_told_but_never_into_a_dead_queue():
    assert plan(letter(), to="other").routing_key == "other"
    with pytest.raises(ValueError, match="dead-letter queue"):
        plan(letter(), to="orders.dead")


def test_a_task_the_broker_dead_lettered_goes_back_to_the_queue_it_was_taken_from():
    deaths = [{"queue": "orders", "reason": "maxlen", "count": 1}]
    headers = dead_headers(**{"x-clockwork-queue": "clockwork.expired.shop", "x-death": deaths})
    dead = DeadLetter.read("clockwork.expired.shop.dead", headers, {}, BODY)
    copy = plan(dead)
    assert copy.routing_key == "orders" and "x-death" not in copy.headers
    assert plan(dead, to="other").routing_key == "other"


def test_a_task_with_a_dedup_key_goes_back_through_its_gate():
    headers = dead_headers(**{KEY_HEADER: "user-7", TIMEOUT_HEADER: 60, TARGET_QUEUE_HEADER: "orders",
                              DEADLINE_HEADER: 1})  # fmt: skip
    copy = plan(letter(headers), to="priority")
    assert copy.routing_key == f"clockwork.dedup.shop.{shard_of('user-7')}"
    assert copy.headers[TARGET_QUEUE_HEADER] == "priority" and copy.queue == "priority"
    assert DEADLINE_HEADER not in copy.headers and copy.headers[KEY_HEADER] == "user-7"


def test_a_marker_is_the_requeued_copy_and_a_dead_letter_again_is_not():
    dead = letter()
    copy = plan(dead).headers
    assert marker_key(copy) == dead.key
    assert marker_key({**copy, "x-clockwork-reason": "rejected"}) is None  # the worker's dead letter
    assert marker_key(dead_headers()) is None and marker_key(None) is None
    assert marker_key({"x-clockwork-requeued": "not a map"}) is None


def test_a_dead_letters_key_is_stable_and_differs_per_dead_lettering():
    headers = dead_headers(**{"x-death": [{"time": dt.datetime(2025, 1, 1), "count": 1}], "raw": b"\xff"})
    assert letter_key(headers, BODY) == letter_key(dict(reversed(headers.items())), BODY)
    later = {**headers, "x-clockwork-dead-at": "2025-01-01T00:00:00.123457+00:00"}
    assert letter_key(later, BODY) != letter_key(headers, BODY)
    assert letter_key(headers, BODY + b" ") != letter_key(headers, BODY)


def test_json_and_msgpack_bodies_are_decoded_even_compressed():
    assert view_body(letter()).value == [[1, 2], {"k": "v"}, {}]
    packed = letter(body=msgpack.packb([[1], {}, {}]), content_type="application/x-msgpack")
    assert view_body(packed).decoded and view_body(packed).value == [[1], {}, {}]
    zipped = letter({**dead_headers(), "compression": "application/x-gzip"}, body=zlib.compress(BODY))
    assert view_body(zipped).value == [[1, 2], {"k": "v"}, {}]


def test_a_pickle_is_never_loaded_and_bad_bodies_show_as_a_safe_excerpt():
    body = pickle.dumps([[1], {}, {}])
    view = view_body(letter(body=body, content_type="application/x-python-serialize"))
    assert not view.decoded and view.value is None and "application/x-python-serialize" in (view.why or "")
    assert view.excerpt == repr(body) and "\x80" not in view.excerpt
    broken = view_body(letter(body=b"\x1b[2J{" + b"x" * 300))
    assert not broken.decoded and "\x1b" not in broken.excerpt and broken.excerpt.endswith(" ...")
    assert json.dumps(broken.as_dict())  # always printable as JSON


def test_queue_names_take_the_task_queue_or_its_dead_queue():
    assert dead_queue_name("orders") == dead_queue_name("orders.dead") == "orders.dead"
    with pytest.raises(ValueError):
        dead_queue_name("")
