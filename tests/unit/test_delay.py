"""Delay buckets and delay queues: which queue an ETA task waits in, and how it is declared."""

from __future__ import annotations

import math

import pytest

from broker_svc.connection.pending import PendingPublish
from broker_svc.topology import (
    DELAY_HOLD_WINDOW_S,
    MAX_DELAY_BUCKET_MS,
    MIN_DELAY_BUCKET_MS,
    delay_bucket_ms,
    delay_queue,
    task_queue,
)
from broker_svc.wire.task.task_message import WireMessage


@pytest.mark.parametrize(
    ("remaining_s", "bucket_ms"),
    [
        (0.128, 128), (0.2, 128), (0.256, 256), (0.999, 512), (1.0, 512), (1.024, 1024), (3.0, 2048),
        (3599.9, 2**21), (3600.0, 2**21), (86_400.0, 2**26), (2.0**31 / 1000 - 1, 2**30),
    ],
)  # fmt: skip
def test_the_bucket_is_the_largest_power_of_two_of_ms_not_above_the_time_left(remaining_s, bucket_ms):
    assert delay_bucket_ms(remaining_s, hold_window_s=0.0) == bucket_ms


def test_a_bucket_never_exceeds_the_time_left_and_at_least_halves_it():
    for ms in range(129, 5_000_000, 997):
        remaining_s = ms / 1000
        bucket_ms = delay_bucket_ms(remaining_s, hold_window_s=DELAY_HOLD_WINDOW_S)
        assert bucket_ms is not None
        assert bucket_ms & (bucket_ms - 1) == 0, bucket_ms
        assert bucket_ms <= ms < 2 * bucket_ms, (ms, bucket_ms)


def test_the_default_hold_window_is_the_shortest_bucket():
    assert MIN_DELAY_BUCKET_MS == 128
    assert DELAY_HOLD_WINDOW_S == 0.128
    assert delay_bucket_ms(0.128, hold_window_s=DELAY_HOLD_WINDOW_S) is None
    assert delay_bucket_ms(0.129, hold_window_s=DELAY_HOLD_WINDOW_S) == 128


@pytest.mark.parametrize("remaining_s", [-5.0, 0.0, 0.05, 0.5, 0.999, 1.0])
def test_tasks_due_within_the_hold_window_get_no_bucket(remaining_s):
    assert delay_bucket_ms(remaining_s, hold_window_s=1.0) is None


def test_a_wider_hold_window_keeps_more_in_memory():
    assert delay_bucket_ms(4.5, hold_window_s=5.0) is None
    assert delay_bucket_ms(5.5, hold_window_s=5.0) == 4096


def test_nothing_shorter_than_the_shortest_bucket_is_parked_even_without_a_hold_window():
    assert delay_bucket_ms(0.127, hold_window_s=0.0) is None
    assert delay_bucket_ms(0.128, hold_window_s=0.0) == 128


def test_long_delays_use_the_longest_bucket_and_go_round_again():
    assert MAX_DELAY_BUCKET_MS == 2**31  # about 24.9 days
    assert delay_bucket_ms(2.0**31 / 1000, hold_window_s=1.0) == 2**31
    assert delay_bucket_ms(365 * 86_400.0, hold_window_s=1.0) == 2**31
    assert delay_bucket_ms(math.inf, hold_window_s=1.0) == 2**31


def test_nan_and_a_negative_hold_window():
    assert delay_bucket_ms(math.nan, hold_window_s=1.0) is None
    with pytest.raises(ValueError, match="hold_window_s"):
        delay_bucket_ms(10.0, hold_window_s=-1.0)


def test_a_delay_queue_dead_letters_back_to_its_task_queue_after_its_bucket():
    spec = delay_queue("emails", 65_536)
    assert spec.name == "emails.delay.65536ms"
    assert spec.durable and not spec.exclusive and not spec.auto_delete
    assert spec.arguments == {
        "x-message-ttl": 65_536,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "emails",
    }
    # No x-expires: publishing does not count as use, so it would delete a queue still holding tasks.
    assert "x-expires" not in spec.arguments
    assert spec.exchange is None  # published to through the default exchange, by name
    assert delay_queue("emails", 2**31).arguments["x-message-ttl"] == 2**31


def test_delay_queues_are_named_per_task_queue_and_bucket():
    names = {delay_queue(q, 2**k).name for q in ("a", "b") for k in range(7, 32)}
    assert len(names) == 50
    assert task_queue("a").name not in names


@pytest.mark.parametrize("bucket_ms", [0, 64, 1000, 3 * 128, -128, 2**32])
def test_a_delay_queue_needs_a_power_of_two_bucket_in_range(bucket_ms):
    with pytest.raises(ValueError, match="power of two"):
        delay_queue("q", bucket_ms)


def _pending(eta_s: float | None) -> PendingPublish:
    wire = WireMessage(body=b"", content_type="application/json", content_encoding="utf-8", headers={})
    return PendingPublish(wire, exchange="", routing_key="jobs", declare=(task_queue("jobs"),), eta_s=eta_s)


def test_an_eta_message_is_routed_by_the_time_left_when_it_is_sent():
    pending = _pending(eta_s=1000.0)
    pending.route(now_s=990.0)  # 10 s left
    assert pending.routing_key == "jobs.delay.8192ms"
    assert [s.name for s in pending.declare] == ["jobs", "jobs.delay.8192ms"]  # task queue first
    assert pending.queue == "jobs"
    pending.route(now_s=999.0)  # sent again later (after a reconnect): 1 s left
    assert pending.routing_key == "jobs.delay.512ms"
    pending.route(now_s=999.95)  # within the hold window: straight to the task queue
    assert pending.routing_key == "jobs"
    assert [s.name for s in pending.declare] == ["jobs"]


def test_a_message_without_an_eta_goes_to_its_queue():
    pending = _pending(eta_s=None)
    pending.route(now_s=0.0)
    assert pending.routing_key == "jobs" and [s.name for s in pending.declare] == ["jobs"]
