"""What a task reads of its request as Celery fills it: ``time_limit``/``soft_time_limit`` from the
message's ``timelimit`` header, ``properties`` from its AMQP properties (``message_properties``).

tests/interop/test_celery_task_api.py compares both with a Celery worker's on the same message.
"""

from __future__ import annotations

from broker_svc.amqp.frames import Properties
from broker_svc.tasks.request import Request
from worker.rules.job_request import message_properties


def test_time_limits_are_the_timelimit_header():
    request = Request.from_worker(
        {"id": "t", "timelimit": [30.0, 20.0]}, task="x", args=[], kwargs={}, send_update=None
    )
    assert (request.time_limit, request.soft_time_limit) == (30.0, 20.0)
    none = Request.from_worker(
        {"id": "t", "timelimit": [None, None]}, task="x", args=[], kwargs={}, send_update=None
    )
    assert (none.time_limit, none.soft_time_limit) == (None, None)
    assert (Request().time_limit, Request().properties) == (None, None)  # outside a worker


def test_properties_reach_the_request_as_the_worker_sent_them():
    properties = {"content_type": "application/json", "priority": 3}
    request = Request.from_worker(
        {"id": "t", "properties": properties}, task="x", args=[], kwargs={}, send_update=None
    )
    assert request.properties == properties


def test_message_properties_are_py_amqps_names_in_its_order_only_those_present():
    header = Properties(
        body_size=10, content_type="application/json", content_encoding="utf-8",
        headers={"id": "t", "task": "x"}, delivery_mode=2, priority=0, correlation_id="t", reply_to="r",
    )  # fmt: skip
    found = message_properties(header)
    assert found == {
        "content_type": "application/json", "content_encoding": "utf-8",
        "application_headers": {"id": "t", "task": "x"}, "delivery_mode": 2, "priority": 0,
        "correlation_id": "t", "reply_to": "r",
    }  # fmt: skip
    assert list(found) == [
        "content_type", "content_encoding", "application_headers", "delivery_mode", "priority",
        "correlation_id", "reply_to",
    ]  # fmt: skip


def test_message_properties_include_the_rarer_ones_when_sent():
    header = Properties(
        body_size=0, expiration="60000", message_id="m", timestamp=1_700_000_000, type="t", user_id="guest",
        app_id="billing",
    )  # fmt: skip
    assert message_properties(header) == {
        "expiration": "60000", "message_id": "m", "timestamp": 1_700_000_000, "type": "t", "user_id": "guest",
        "app_id": "billing",
    }  # fmt: skip
    assert message_properties(None) is None
