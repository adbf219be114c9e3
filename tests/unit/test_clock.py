from __future__ import annotations

import threading

import pytest

from broker_svc.clock import MAX_CLOCK, EventOrder, LamportClock, parse_clock


def test_forward_increments_by_one_and_returns_the_new_value():
    clock = LamportClock()
    assert clock.forward() == 1
    assert clock.forward() == 2
    assert clock.value == 2


def test_adjust_sets_max_of_local_and_received_plus_one():
    clock = LamportClock(5)
    assert clock.adjust(10) == 11
    assert clock.adjust(3) == 12  # a smaller received value still moves the clock past local


@pytest.mark.parametrize("abusive", [2**64, MAX_CLOCK + 1, -1, "x", None, 1.5, True, b"9", "99999999999"])
def test_abusive_received_values_are_ignored(abusive):
    clock = LamportClock(7)
    assert clock.adjust(abusive) == 7
    assert clock.value == 7


def test_clock_saturates_at_the_safe_maximum():
    clock = LamportClock(MAX_CLOCK - 1)
    assert clock.adjust(MAX_CLOCK) == MAX_CLOCK
    assert clock.forward() == MAX_CLOCK


def test_string_clocks_from_celery_stats_are_understood():
    assert parse_clock("42") == 42
    assert parse_clock("-4") is None


def test_forward_is_thread_safe():
    clock = LamportClock()
    threads = [threading.Thread(target=lambda: [clock.forward() for _ in range(10_000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.value == 40_000


def test_events_order_by_clock_then_origin():
    events = [EventOrder(3, "b.1"), EventOrder(2, "z.9"), EventOrder(3, "a.2")]
    assert sorted(events) == [EventOrder(2, "z.9"), EventOrder(3, "a.2"), EventOrder(3, "b.1")]


def test_initial_value_is_validated():
    with pytest.raises(ValueError):
        LamportClock(-1)
