"""The worker's inspect views: where each delivery is, in Celery's TASK_INFO shape."""

from __future__ import annotations

import datetime as dt
from typing import Any

from broker_svc.wire.task_message import TaskMessage
from worker.state import Tracked, WorkerState

DELIVERY = {"exchange": "", "routing_key": "q", "priority": 0, "redelivered": False}


def _tracked(task_id: str, **fields: Any) -> Tracked:
    return Tracked(
        TaskMessage(id=task_id, task="t.add", args=[1, 2], kwargs={"k": "v"}, **fields), dict(DELIVERY)
    )


def test_a_delivery_moves_from_reserved_to_active_and_each_view_shows_it_once():
    state = WorkerState("w1@host", pids=lambda: {"a": 4242})
    a, b = _tracked("a"), _tracked("b")
    state.reserved_tasks.update(a=a, b=b)
    assert [i["id"] for i in state.reserved()] == ["a", "b"]
    del state.reserved_tasks["a"]
    state.start(a)
    [info] = state.active()
    assert info == {
        "id": "a", "name": "t.add", "args": [1, 2], "kwargs": {"k": "v"}, "type": "t.add",
        "hostname": "w1@host", "time_start": a.time_start, "acknowledged": False,
        "delivery_info": DELIVERY, "worker_pid": 4242,
    }  # fmt: skip
    assert isinstance(info["time_start"], float)
    assert state.active(safe=True)[0]["args"] == "[1, 2]"
    assert state.running("a") is a.request and state.running("b") is None
    assert state.query(["a", "b", "zzz"]) == {
        "a": ["active", state.active()[0]],
        "b": ["reserved", state.reserved()[0]],
    }


def test_scheduled_shows_eta_and_priority():
    state = WorkerState("w1@host", pids=dict)
    eta = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    state.scheduled_tasks["s"] = _tracked("s", eta=eta, priority=5)
    [entry] = state.scheduled()
    assert entry["eta"] == eta.isoformat() and entry["priority"] == 5
    assert entry["request"]["id"] == "s"
    assert state.query(["s"])["s"][0] == "reserved"
