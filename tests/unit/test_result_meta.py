"""Celery's key-value result format: key names, the global key prefix, the stored meta."""

from __future__ import annotations

import pytest

from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.results.meta import ResultKeys, chord_member, extended_fields, is_redis_url, result_meta
from broker_svc.wire.task.task_message import TaskMessage


def test_keys_are_celerys_and_take_the_global_prefix_with_celerys_separator_rule():
    assert ResultKeys().task("abc") == "celery-task-meta-abc"
    assert ResultKeys().group("g1", ".j") == "celery-taskset-meta-g1.j"
    assert (
        ResultKeys.from_transport_options({"global_keyprefix": "app"}).task("a") == "app_celery-task-meta-a"
    )
    assert (
        ResultKeys.from_transport_options({"global_keyprefix": "app:"}).task("a") == "app:celery-task-meta-a"
    )
    assert ResultKeys.from_transport_options(None).prefix == ""
    with pytest.raises(ValueError):
        ResultKeys().task("")


def test_the_meta_has_celerys_fields_in_its_order_with_the_task_id_last():
    done = Outcome(task_id="t1", status="SUCCESS", result=5, children=[[["c1", None], None]])
    meta = result_meta(done, group_id="g", parent_id="p", extended=None)
    assert list(meta) == [
        "status",
        "result",
        "traceback",
        "children",
        "date_done",
        "group_id",
        "parent_id",
        "task_id",
    ]
    assert meta["date_done"] and meta["task_id"] == "t1" and meta["children"] == [[["c1", None], None]]
    started = result_meta(
        Outcome(task_id="t1", status="STARTED"), group_id=None, parent_id=None, extended=None
    )
    assert started["date_done"] is None and "group_id" not in started and "parent_id" not in started


def test_extended_fields_are_celerys_result_extended():
    request = TaskMessage(id="t1", task="proj.add", args=[1, 2], kwargs={"z": 3}, retries=2)
    fields = extended_fields(request, hostname="w@h", queue="celery")
    assert fields == {"name": "proj.add", "args": [1, 2], "kwargs": {"z": 3}, "worker": "w@h", "retries": 2,
                      "queue": "celery"}  # fmt: skip
    failed = Outcome(
        task_id="t1", status="FAILURE", result=wire_exception("ValueError", "x", module="builtins")
    )
    assert result_meta(failed, group_id=None, parent_id=None, extended=fields)["name"] == "proj.add"


def test_a_chord_member_and_redis_urls():
    assert chord_member("t1", "SUCCESS", 4) == [1, "t1", "SUCCESS", 4]
    assert is_redis_url("redis://localhost:6379/0") and is_redis_url("rediss://h/1")
    assert not is_redis_url("rpc://") and not is_redis_url(None) and not is_redis_url("redisx://h")
