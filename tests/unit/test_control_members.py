"""Membership: who is alive from worker events (Celery's 2 x freq rule), robust to bad input."""

from __future__ import annotations

import pytest

from control.protocol.membership import Membership


def ev(kind="worker-heartbeat", host="a@h", ts=1000.0, **extra):
    return {"type": kind, "hostname": host, "timestamp": ts, **extra}


def test_a_node_is_alive_until_two_heartbeat_intervals_after_its_last_event():
    m = Membership()
    assert m.feed(ev(ts=1000.0, freq=2.0))
    assert m.alive(1000.0) == {"a@h"}
    assert m.alive(1003.999) == {"a@h"}
    assert m.alive(1004.0) == set()


def test_freq_defaults_to_two_seconds():
    m = Membership()
    m.feed(ev(ts=1000.0))
    assert m.alive(1003.9) == {"a@h"} and m.alive(1004.0) == set()
    m.feed(ev(host="b@h", ts=1000.0, freq=None))
    assert "b@h" in m.alive(1003.9)


def test_a_longer_freq_keeps_a_node_alive_longer():
    m = Membership()
    m.feed(ev(ts=1000.0, freq=10))
    assert m.alive(1019.0) == {"a@h"}


def test_worker_offline_removes_a_node_at_once():
    m = Membership()
    m.feed(ev("worker-online", ts=1000.0))
    m.feed(ev("worker-offline", ts=1001.0))
    assert m.alive(1001.5) == set()


def test_a_node_that_comes_back_after_offline_is_alive_again():
    m = Membership()
    m.feed(ev("worker-offline", ts=1000.0))
    m.feed(ev("worker-online", ts=1005.0))
    assert m.alive(1005.1) == {"a@h"}


def test_an_older_event_arriving_late_changes_nothing():
    m = Membership()
    m.feed(ev("worker-offline", ts=1001.0))
    assert not m.feed(ev("worker-heartbeat", ts=1000.5))
    assert m.alive(1001.5) == set()


def test_several_nodes_are_tracked_independently():
    m = Membership()
    m.feed(ev(host="a@h", ts=1000.0))
    m.feed(ev(host="b@h", ts=1003.0))
    m.feed(ev("worker-offline", host="c@h", ts=1003.0))
    assert m.alive(1004.5) == {"b@h"}
    assert len(m) == 3


def test_a_batch_body_is_a_list_of_events():
    m = Membership()
    used = m.feed_body([ev(host="a@h"), ev(host="b@h"), "junk", ev("task-succeeded", host="c@h")])
    assert used == 2
    assert m.feed_body(ev(host="d@h")) == 1
    assert m.alive(1001.0) == {"a@h", "b@h", "d@h"}


@pytest.mark.parametrize(
    "event",
    [
        None,
        "worker-heartbeat",
        [ev()],
        {"type": "worker-heartbeat", "timestamp": 1000.0},  # no hostname
        {"type": "worker-heartbeat", "hostname": "a@h"},  # no timestamp
        ev(kind="task-succeeded"),
        ev(kind=None),
        ev(host=""),
        ev(host=123),
        ev(host="x" * 300),
        ev(ts="1000"),
        ev(ts=True),
        ev(ts=float("nan")),
        ev(ts=float("inf")),
        ev(ts=10**400),
        ev(freq="2"),
        ev(freq=0),
        ev(freq=-1.0),
        ev(freq=float("nan")),
        ev(freq=True),
    ],
)
def test_malformed_events_are_ignored_never_raised(event):
    m = Membership()
    assert not m.feed(event)
    assert m.ignored == 1
    assert m.alive(1000.5) == set()


def test_integer_timestamps_are_accepted():
    m = Membership()
    assert m.feed(ev(ts=1000, freq=2))
    assert m.alive(1001) == {"a@h"}
