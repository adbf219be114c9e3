"""Delivery counting and the dedupe window (worker.consume.admission), pure parts."""

from __future__ import annotations

import pytest

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings
from worker.consume.admission import (
    BROKER_COUNT_HEADER,
    DELIVERIES_HEADER,
    DedupeWindow,
    carries_count,
    delivery_count,
)


@pytest.mark.parametrize(
    ("headers", "redelivered", "count", "carried"),
    [
        ({}, False, 0, True),  # a first delivery
        (None, True, 1, False),  # a classic redelivery: the worker must copy the count
        ({DELIVERIES_HEADER: 2}, False, 2, True),  # a copy the worker made
        ({DELIVERIES_HEADER: 2}, True, 3, False),  # that copy redelivered (classic)
        ({BROKER_COUNT_HEADER: 2}, True, 2, True),  # a quorum redelivery: the broker counts
        ({DELIVERIES_HEADER: 1, BROKER_COUNT_HEADER: 2}, True, 3, True),  # a child death, then quorum
        ({DELIVERIES_HEADER: -5, BROKER_COUNT_HEADER: "7"}, False, 0, True),  # junk counts nothing
        ({DELIVERIES_HEADER: True}, False, 0, True),  # a bool is not a count
        ({DELIVERIES_HEADER: 2**40}, False, 0, True),  # nor is an absurd one
    ],
)
def test_delivery_count_reads_ours_and_the_brokers(headers, redelivered, count, carried):
    assert delivery_count(headers, redelivered=redelivered) == count
    assert carries_count(headers, redelivered=redelivered) is carried


def test_dedupe_window_remembers_finished_ids_for_its_ttl():
    window = DedupeWindow(ttl_s=10)
    key = ("a", 0)
    assert not window.seen(key, now=0)
    window.start(key)
    assert window.seen(key, now=0)  # running here: a second copy is a duplicate
    window.release(key)
    assert not window.seen(key, now=0)  # handed back unfinished: not a duplicate
    window.finished(key, now=0)
    assert window.seen(key, now=9.9)
    assert not window.seen(("a", 1), now=1)  # its retry is not a duplicate
    assert not window.seen(key, now=10.1)  # expired
    assert len(window) == 0


def test_dedupe_window_is_bounded():
    window = DedupeWindow(ttl_s=100, max_ids=3)
    for i in range(10):
        window.finished((str(i), 0), now=i)
    assert len(window) == 3
    assert not window.seen(("0", 0), now=10) and window.seen(("9", 0), now=10)
    # Expired entries leave as new ones come, even below the bound.
    window.finished(("late", 0), now=500)
    assert len(window) == 1


def test_dedupe_window_refuses_nonsense():
    with pytest.raises(ValueError):
        DedupeWindow(ttl_s=0)


def test_settings_choose_quorum_per_queue_and_a_delivery_limit():
    settings = Settings.from_env({"CLOCKWORK_QUORUM_QUEUES": "a, b,,", "CLOCKWORK_DELIVERY_LIMIT": "5"})
    assert settings.quorum_queues == ("a", "b") and settings.delivery_limit == 5
    assert settings.queue_type("a") == "quorum" and settings.queue_type("c") == "classic"
    assert Settings().delivery_limit == 3 and Settings().quorum_queues == ()
    with pytest.raises(ConfigurationError):
        Settings(delivery_limit=-1)
    with pytest.raises(ConfigurationError):
        Settings.from_env({"CLOCKWORK_DELIVERY_LIMIT": "many"})
