"""Delivery counting and the broker's dead-letter reasons (worker.rules.deliveries), pure parts."""

from __future__ import annotations

import pytest

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings
from worker.rules.deliveries import (
    BROKER_COUNT_HEADER,
    DELIVERIES_HEADER,
    broker_dead_letter,
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


@pytest.mark.parametrize(
    ("headers", "reason", "origin"),
    [
        (
            {"x-death": [{"reason": "expired", "queue": "q"}, {"reason": "maxlen", "queue": "r"}]},
            "expired",
            "q",
        ),
        ({"x-death": [{"reason": "maxlen"}]}, "maxlen", None),
        ({"x-death": "garbage"}, "unknown", None),
        (None, "unknown", None),
    ],
)
def test_the_brokers_reason_for_a_dead_letter_is_its_newest_x_death(headers, reason, origin):
    assert broker_dead_letter(headers) == (reason, origin)


def test_settings_choose_quorum_per_queue_and_a_delivery_limit():
    settings = Settings.from_env({"CLOCKWORK_QUORUM_QUEUES": "a, b,,", "CLOCKWORK_DELIVERY_LIMIT": "5"})
    assert settings.quorum_queues == ("a", "b") and settings.delivery_limit == 5
    assert settings.queue_type("a") == "quorum" and settings.queue_type("c") == "classic"
    assert Settings().delivery_limit == 3 and Settings().quorum_queues == ()
    with pytest.raises(ConfigurationError):
        Settings(delivery_limit=-1)
    with pytest.raises(ConfigurationError):
        Settings.from_env({"CLOCKWORK_DELIVERY_LIMIT": "many"})
