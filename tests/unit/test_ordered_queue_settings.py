"""Ordered queues are declared alike everywhere: topology, Settings, app.conf (ours and Celery's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker_svc import App, ConfigurationError, Settings
from broker_svc.topology import SINGLE_ACTIVE_ARGUMENT, ordered_queue, task_queue


def test_an_ordered_queue_is_a_task_queue_with_a_single_active_consumer():
    spec = ordered_queue("ledger")
    assert spec.single_active and spec.arguments == {SINGLE_ACTIVE_ARGUMENT: True}
    assert spec.exchange == task_queue("ledger").exchange and spec.routing_key == "ledger"
    quorum = ordered_queue("ledger", queue_type="quorum")
    assert quorum.declare_options()["arguments"] == {"x-queue-type": "quorum", SINGLE_ACTIVE_ARGUMENT: True}
    assert not task_queue("ledger").single_active
    assert task_queue("ledger").declare_options()["arguments"] is None  # Celery's plain queue, unchanged


def test_settings_declare_the_named_queues_ordered_and_the_rest_as_before():
    settings = Settings(ordered_queues=("ledger",), quorum_queues=("ledger",))
    assert settings.task_queue("ledger") == ordered_queue("ledger", queue_type="quorum")
    assert settings.task_queue("celery") == task_queue("celery")


def test_app_conf_task_ordered_queues_sets_the_field():
    app = App("conf-ordered")
    app.conf.task_ordered_queues = ["ledger", "audit"]
    assert app.settings.ordered_queues == ("ledger", "audit")


def test_celery_task_queues_with_single_active_consumer_are_ordered():
    app = App("conf-task-queues")
    app.conf.task_ordered_queues = "audit"
    app.conf.task_queues = [
        SimpleNamespace(
            name="ledger", queue_arguments={"x-single-active-consumer": True, "x-queue-type": "quorum"}
        ),
        {"name": "plain", "queue_arguments": None},
    ]
    assert app.settings.ordered_queues == ("audit", "ledger")
    assert app.settings.quorum_queues == ("ledger",)
    assert app.settings.task_queue("plain") == task_queue("plain")


def test_a_task_queues_entry_without_a_name_is_refused():
    app = App("conf-bad-queues")
    with pytest.raises(ConfigurationError):
        app.conf.task_queues = [{"queue_arguments": {}}]
