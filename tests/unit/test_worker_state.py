"""The worker's inspect views over its children's board and answers, in Celery's TASK_INFO shape."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc.settings import Settings
from worker.child.spec import FeedSpec
from worker.pool.feeding import Feeding
from worker.pool.state import WorkerState
from worker.shared.board import Running

DELIVERY = {"exchange": "", "routing_key": "q", "priority": 0, "redelivered": False}


def _task(task_id: str) -> dict[str, Any]:
    return {"id": task_id, "name": "t.add", "type": "t.add", "args": [1, 2], "kwargs": {"k": "v"},
            "delivery_info": DELIVERY}  # fmt: skip


@pytest.fixture
def feeding() -> Iterator[Feeding]:
    made = Feeding(FeedSpec(settings=Settings(), queues=("q",), prefetch=1, hostname="w1@host"), slots=2)
    yield made
    made.close()


def test_a_task_on_the_board_is_active_and_one_held_is_reserved_each_shown_once(feeding: Feeding):
    state = WorkerState("w1@host", feeding)
    assert state.active() == [] and state.running_count == 0
    feeding.board.start(1, _task("a"))  # as the child in slot 1 writes it when the task starts
    [info] = state.active()
    assert info == {
        "id": "a", "name": "t.add", "args": [1, 2], "kwargs": {"k": "v"}, "type": "t.add",
        "hostname": "w1@host", "time_start": info["time_start"], "acknowledged": False,
        "delivery_info": DELIVERY, "worker_pid": os.getpid(),
    }  # fmt: skip
    assert isinstance(info["time_start"], float) and state.running_count == 1
    assert state.active(safe=True)[0]["args"] == "[1, 2]"
    held = [Running(slot=0, pid=4242, started=0.0, info=_task("b"))]  # a child's answer to "held"
    [reserved] = state.reserved(held)
    assert (reserved["id"], reserved["time_start"], reserved["worker_pid"]) == ("b", None, 4242)
    assert state.query(["a", "b", "zzz"], held) == {"a": ["active", info], "b": ["reserved", reserved]}
    feeding.board.end(1)
    assert state.active() == [] and state.query(["a"], held) == {}


def test_scheduled_lists_nothing_because_eta_tasks_wait_in_the_broker(feeding: Feeding):
    assert WorkerState("w1@host", feeding).scheduled() == []
