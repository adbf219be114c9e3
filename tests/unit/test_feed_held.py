"""inspect reserved and stats ask every consuming child (worker.pool.feeding): a numbered question,
one answer per live child.

Each child here is answered for by hand on one end of a socket pair, so one can be slow, silent or
malformed on purpose; what a real child answers is tested against the broker in
tests/integration/test_children_threads.py, test_children_stats.py and
tests/interop/test_celery_cli.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from broker_svc import Settings
from worker.child.channel import ChildChannel
from worker.child.spec import FeedSpec
from worker.pool.feeding import Feeding
from worker.pool.state import WorkerState


@pytest.fixture
async def feeding() -> AsyncIterator[Feeding]:
    made = Feeding(FeedSpec(settings=Settings(), queues=("q",), prefetch=2, hostname="w@h"), slots=3)
    try:
        yield made
    finally:
        made.close()


class _Child(ChildChannel):
    """A child's end of its socket, answered for by the test."""

    def __init__(self, theirs: socket.socket, writer: asyncio.StreamWriter) -> None:
        super().__init__(theirs)
        self.theirs, self.writer = theirs, writer

    def close(self) -> None:
        self.writer.close()
        self.theirs.close()


async def _join(feeding: Feeding, slot: int) -> _Child:
    ours, theirs = socket.socketpair()
    _reader, writer = await asyncio.open_connection(sock=ours)
    feeding.joined(slot, writer)
    return _Child(theirs, writer)


async def _asked(child: _Child, op: str) -> int:
    # The child's side: the number of the next ``op`` question it gets.
    while (frame := await asyncio.to_thread(child.receive)) is not None:
        if frame["op"] == op:
            return int(frame["seq"])
    raise AssertionError("the socket closed before the child was asked")


def _task(task_id: str) -> dict[str, Any]:
    return {
        "id": task_id,
        "name": "t.add",
        "type": "t.add",
        "args": [1, 2],
        "kwargs": {},
        "delivery_info": {},
    }


async def test_the_answer_waits_for_every_live_child_and_joins_what_they_hold(feeding: Feeding):
    first, second = await _join(feeding, 0), await _join(feeding, 1)
    asking = asyncio.create_task(feeding.held(timeout_s=10.0))
    seq = await _asked(first, "held")
    assert await _asked(second, "held") == seq
    feeding.answered(1, {"op": "held", "seq": seq, "pid": 22, "tasks": [_task("b")]})
    await asyncio.sleep(0.05)
    assert not asking.done()  # the first child has not answered yet
    feeding.answered(0, {"op": "held", "seq": seq, "pid": 11, "tasks": [_task("a1"), _task("a2")]})
    held = await asyncio.wait_for(asking, 10.0)
    assert [(entry.slot, entry.pid, entry.info["id"]) for entry in held] == [
        (0, 11, "a1"),
        (0, 11, "a2"),
        (1, 22, "b"),
    ]
    # As inspect shows them: not started, each with its child's pid.
    state = WorkerState("w@h", feeding)
    shown = state.reserved(held)
    assert [(t["id"], t["time_start"], t["worker_pid"], t["hostname"]) for t in shown] == [
        ("a1", None, 11, "w@h"), ("a2", None, 11, "w@h"), ("b", None, 22, "w@h")
    ]  # fmt: skip
    assert state.query(["b", "zz"], held) == {"b": ["reserved", shown[2]]}
    # An answer after the wait ended is dropped, not kept for the next question.
    feeding.answered(0, {"op": "held", "seq": seq, "pid": 11, "tasks": [_task("late")]})
    reporting = asyncio.create_task(feeding.reported(timeout_s=10.0))
    seq = await _asked(first, "report")
    assert await _asked(second, "report") == seq
    for slot in (0, 1):
        feeding.answered(slot, {"op": "reported", "seq": seq})
    await asyncio.wait_for(reporting, 10.0)
    for child in (first, second):
        child.close()


async def test_a_silent_child_is_left_out_and_an_exited_or_malformed_one_is_not_waited_for(feeding: Feeding):
    silent, leaving, garbled = [await _join(feeding, slot) for slot in range(3)]
    with capture_logs() as logs:
        asking = asyncio.create_task(feeding.held(timeout_s=0.5))
        seq = await _asked(garbled, "held")
        feeding.answered(2, {"op": "held", "seq": seq, "pid": 33, "tasks": "not a list"})
        feeding.left(1)  # exited while asked: its answer will never come, nor is it needed
        assert await asyncio.wait_for(asking, 10.0) == []
    said = [(e["event"], e["log_level"], e.get("slots", e.get("slot"))) for e in logs]
    # Slot 0 has never answered the worker (a revoke, say): still starting.
    assert said == [("feed_child_not_answering", "info", [0]), ("feed_held_malformed", "error", 2)], logs
    # Once it has answered before, it is not starting: its task may hold the GIL. Said at info too.
    feeding.revoke_applied(0, {"op": "revoke_applied", "seq": 0})
    with capture_logs() as logs:
        await feeding.reported(timeout_s=0.2)
    told = [(e["event"], e["log_level"], e["op"], e["slots"], e["starting"]) for e in logs]
    assert told == [("feed_child_not_answering", "info", "report", [0, 2], [2])]  # slot 2 is silent too
    for child in (silent, leaving, garbled):
        child.close()
