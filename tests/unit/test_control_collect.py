"""ReplyCollector: which replies count, and when a call may stop waiting."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from control.protocol.collector import ReplyCollector

T = "ticket-1"


def collector(expected=None, limit=None, timeout_s=5.0, now=100.0) -> ReplyCollector:
    return ReplyCollector(T, expected=expected, limit=limit, timeout_s=timeout_s, now=now)


def test_a_reply_with_our_ticket_is_taken_and_another_ticket_is_not():
    c = collector()
    assert c.offer({"ticket": T}, {"a@h": {"ok": "pong"}})
    assert not c.offer({"ticket": "other"}, {"b@h": {"ok": "pong"}})
    assert c.replies == [{"a@h": {"ok": "pong"}}]
    assert c.answered == {"a@h"}


def test_a_reply_without_a_ticket_header_counts_as_ours_as_in_kombu():
    c = collector()
    assert c.offer({}, {"a@h": 1})
    assert c.offer(None, {"b@h": None})
    assert c.answered == {"a@h", "b@h"}


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        "text",
        None,
        {},
        {"a@h": 1, "b@h": 2},
        {1: "x"},
        {"": "x"},
    ],
)
def test_malformed_bodies_are_skipped_and_counted_never_raised(body):
    c = collector()
    with capture_logs() as logs:
        assert not c.offer({"ticket": T}, body)
    assert c.skipped == 1 and c.replies == []
    assert logs[0]["event"] == "control_reply_malformed"


def test_a_duplicate_node_keeps_the_last_reply_in_arrival_order_and_warns():
    c = collector()
    c.offer({}, {"a@h": 1})
    c.offer({}, {"b@h": 2})
    with capture_logs() as logs:
        c.offer({}, {"a@h": 3})
    assert c.replies == [{"b@h": 2}, {"a@h": 3}]
    assert [entry["event"] for entry in logs] == ["control_reply_duplicate_node"]


def test_a_destination_list_is_done_once_every_named_node_answered():
    c = collector(expected=frozenset({"a@h", "b@h"}))
    assert not c.done(100.1)
    c.offer({}, {"a@h": 1})
    assert not c.done(100.2)
    assert c.missing == {"b@h"}
    c.offer({}, {"b@h": 1})
    assert c.done(100.3) and c.missing == frozenset()


def test_membership_is_ignored_when_there_is_a_destination():
    c = collector(expected=frozenset({"a@h"}))
    c.expect({"x@h", "y@h"})
    assert c.expected == frozenset({"a@h"})
    c.offer({}, {"a@h": 1})
    assert c.done(100.1)


def test_without_a_destination_it_waits_until_membership_is_known():
    c = collector()
    c.offer({}, {"a@h": 1})
    assert not c.done(100.1)  # nobody says who is alive yet
    assert c.expected is None and c.missing == frozenset()
    c.expect({"a@h", "b@h"})
    assert not c.done(100.2) and c.missing == {"b@h"}
    c.offer({}, {"b@h": 1})
    assert c.done(100.3)


def test_an_empty_membership_leaves_the_expected_set_unknown_so_the_timeout_bounds_the_call():
    c = collector(timeout_s=2.0)
    c.expect(set())
    c.offer({}, {"a@h": 1})
    assert c.expected is None
    assert not c.done(101.9)
    assert c.done(102.0)


def test_a_node_whose_heartbeats_stop_no_longer_holds_the_call_but_is_reported_missing():
    c = collector()
    c.expect({"a@h", "dead@h"})
    c.offer({}, {"a@h": 1})
    assert not c.done(100.5)
    c.expect({"a@h"})  # dead@h's heartbeats expired
    assert c.done(101.0)
    assert c.missing == {"dead@h"} and c.expected == frozenset({"a@h", "dead@h"})


def test_when_every_member_expires_during_the_call_it_is_done():
    c = collector()
    c.expect({"dead@h"})
    assert not c.done(100.5)
    c.expect(set())
    assert c.done(101.0) and c.missing == {"dead@h"}


def test_the_limit_stops_the_call():
    c = collector(limit=2)
    c.offer({}, {"a@h": 1})
    assert not c.done(100.1)
    c.offer({}, {"b@h": 1})
    assert c.done(100.1)


def test_the_deadline_is_a_total_upper_bound():
    c = collector(expected=frozenset({"a@h"}), timeout_s=1.5)
    assert not c.done(101.49)
    assert c.done(101.5)
    assert c.missing == {"a@h"}


def test_a_node_that_answered_without_being_expected_is_not_missing_and_does_not_end_the_wait():
    c = collector()
    c.expect({"a@h"})
    c.offer({}, {"celery-without-heartbeats@h": 1})
    assert not c.done(100.1)
    assert c.missing == {"a@h"}
