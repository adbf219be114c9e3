"""Every declarer reads a spec through ``declare_options()``: the flags RabbitMQ compares on redeclare."""

from __future__ import annotations

import dataclasses

from broker_svc.topology import (
    LEGACY_NAMESPACE,
    ExchangeOptions,
    ExchangeSpec,
    QueueOptions,
    QueueSpec,
    node_queue,
    pidbox_exchange,
    revocation_log,
    task_queue,
)


def test_a_task_queue_is_declared_with_celerys_flags_and_no_arguments():
    spec = task_queue("jobs")
    assert spec.declare_options() == {
        "durable": True,
        "exclusive": False,
        "auto_delete": False,
        "arguments": None,
    }
    assert spec.exchange is not None
    assert spec.exchange.declare_options() == {"durable": True, "auto_delete": False}


def test_a_quorum_task_queue_carries_its_type_argument():
    assert task_queue("jobs", queue_type="quorum").declare_options()["arguments"] == {
        "x-queue-type": "quorum"
    }


def test_a_node_queue_is_exclusive_auto_deleted_and_expiring():
    assert node_queue("w@h").declare_options() == {
        "durable": False,
        "exclusive": True,
        "auto_delete": True,
        "arguments": {"x-expires": 10_000, "x-message-ttl": 300_000},
    }
    assert pidbox_exchange().declare_options() == {"durable": False, "auto_delete": False}


def test_a_stream_keeps_its_arguments():
    spec = revocation_log(LEGACY_NAMESPACE)
    options = spec.declare_options()
    assert options["arguments"] == spec.arguments
    assert options["arguments"] is not None and options["arguments"]["x-queue-type"] == "stream"


def test_every_declare_flag_of_a_spec_reaches_the_options():
    # A field added to a spec must be read by declare_options() (or be one of the few that are
    # not a flag), or the three declarers would each have to remember it.
    not_flags = {"name", "type", "exchange", "routing_key"}
    for spec_type, options_type in ((QueueSpec, QueueOptions), (ExchangeSpec, ExchangeOptions)):
        flags = {f.name for f in dataclasses.fields(spec_type)} - not_flags
        assert flags == set(options_type.__annotations__), spec_type


def test_set_flags_are_passed_through_not_defaulted():
    exchange = ExchangeSpec(name="x", type="topic", durable=False, auto_delete=True)
    spec = QueueSpec(
        name="q", durable=False, exclusive=True, auto_delete=True, arguments={"a": 1}, exchange=exchange
    )
    assert spec.declare_options() == {
        "durable": False,
        "exclusive": True,
        "auto_delete": True,
        "arguments": {"a": 1},
    }
    assert exchange.declare_options() == {"durable": False, "auto_delete": True}
