"""ReorderBuffer: live events released in Lamport order ``(clock, "hostname.pid")`` after a hold."""

from __future__ import annotations

from typing import Any

from control.protocol.event_order import ReorderBuffer


def _event(clock: Any, hostname: str = "w1@h", pid: int = 1, **fields: Any) -> dict[str, Any]:
    return {"clock": clock, "hostname": hostname, "pid": pid, **fields}


def test_nothing_is_released_before_its_window_passed():
    buffer = ReorderBuffer(0.5)
    buffer.push(_event(1), now=10.0)
    assert buffer.pop_ready(10.49) == []
    assert len(buffer) == 1
    assert buffer.pop_ready(10.5) == [_event(1)]
    assert len(buffer) == 0


def test_a_later_arrival_with_a_smaller_clock_goes_first():
    buffer = ReorderBuffer(0.5)
    buffer.push(_event(7, "w1@h"), now=10.0)
    buffer.push(_event(3, "w2@h"), now=10.2)
    assert [e["clock"] for e in buffer.pop_ready(10.7)] == [3, 7]


def test_a_held_smaller_event_blocks_larger_ones_whose_window_passed():
    buffer = ReorderBuffer(0.5)
    buffer.push(_event(7), now=10.0)
    buffer.push(_event(3, "w2@h"), now=10.4)
    # 7's window passed at 10.5 but 3, still held, must go first: nothing is released yet.
    assert buffer.pop_ready(10.6) == []
    assert [e["clock"] for e in buffer.pop_ready(10.9)] == [3, 7]


def test_equal_clocks_are_ordered_by_hostname_then_pid():
    buffer = ReorderBuffer(0.0)
    buffer.push(_event(5, "w2@h", 1), now=1.0)
    buffer.push(_event(5, "w1@h", 9), now=1.0)
    buffer.push(_event(5, "w1@h", 2), now=1.0)
    assert [(e["hostname"], e["pid"]) for e in buffer.drain()] == [("w1@h", 2), ("w1@h", 9), ("w2@h", 1)]


def test_identical_keys_keep_arrival_order_and_never_compare_the_events():
    buffer = ReorderBuffer(0.0)
    buffer.push(_event(5, type="task-received"), now=1.0)
    buffer.push(_event(5, type="task-started"), now=1.0)
    assert [e["type"] for e in buffer.drain()] == ["task-received", "task-started"]


def test_a_missing_or_non_integer_clock_sorts_as_zero():
    buffer = ReorderBuffer(0.0)
    buffer.push(_event(2, "a@h"), now=1.0)
    buffer.push(_event(None, "b@h"), now=1.0)
    buffer.push(_event(True, "c@h"), now=1.0)  # a bool is not a clock
    buffer.push(_event("9", "d@h"), now=1.0)
    assert [e["hostname"] for e in buffer.drain()] == ["b@h", "c@h", "d@h", "a@h"]


def test_drain_releases_everything_in_order_regardless_of_the_window():
    buffer = ReorderBuffer(60.0)
    for clock in (4, 1, 3, 2):
        buffer.push(_event(clock), now=0.0)
    assert [e["clock"] for e in buffer.drain()] == [1, 2, 3, 4]
    assert len(buffer) == 0 and buffer.drain() == []
