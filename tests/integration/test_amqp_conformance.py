"""Our AMQP 0-9-1 client against the real broker: what the broker sees and what it sends us.

For both concurrency policies of the one core (``FeedConnection``, one reader; ``SharedFeedConnection``,
threads sharing it) and, where it applies, ``LeaseConnection`` on the same core: the tuning the
broker lists for the connection, a body split into several frames, the broker's ``basic.cancel``
when a queue is deleted under its consumer, and a close the broker sends (``rabbitmqctl
close_connection``, only of connections these tests made, found by their unique names). What needs a
broker of its own (a small ``frame_max``, alarms, TLS, a restart) is in
``tests/reliability/test_amqp_conformance_nodes.py``; heartbeats while a task runs are in
``tests/integration/test_feed_connection.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import Settings
from broker_svc.amqp.channel import Channel
from broker_svc.amqp.delivery import ConnectionLost
from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.amqp.lease_connection import LeaseConnection
from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from broker_svc.topology import QueueSpec
from broker_svc.wire.task.task_message import WireMessage
from tests.support.amqp import channel, delete_queues, drain
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue

KINDS = ["single", "shared", "lease"]
FEEDS = ["single", "shared"]


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("conf")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(name, durable=True)
    yield name
    delete_queues(test_vhost_url, name)


def open_connection(kind: str, url: str, queue: str, *, name: str, heartbeat_s: int = 30) -> Channel:
    """A connected client of ``kind`` consuming ``queue`` (the lease one declares it as it is)."""
    settings = Settings(broker_url=url, heartbeat_s=heartbeat_s, confirm_timeout_s=10.0)
    connection: Channel
    if kind == "lease":
        connection = LeaseConnection(settings, name=name, queue=QueueSpec(queue, durable=True))
    else:
        feed = FeedConnection if kind == "single" else SharedFeedConnection
        connection = feed(settings, name=name, queues=[queue], prefetch=1)
    connection.connect()
    return connection


def wait_a_little(connection: Channel, timeout_s: float) -> object:
    """Read for up to ``timeout_s`` with the connection's own wait (frames are dispatched)."""
    if isinstance(connection, LeaseConnection):
        return connection.next_delivery(timeout_s)
    assert isinstance(connection, FeedConnection)
    return connection.next_delivery(timeout_s)


def listed(session_broker, url: str, name: str, *columns: str) -> list[str] | None:
    """The broker's ``list_connections`` columns for the connection named ``name``; None if absent."""
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to see the connection from its side)")
    vhost = unquote(urlsplit(url).path[1:]) or "/"
    out = session_broker.rabbitmqctl(
        "list_connections", "-p", vhost, "-q", "--no-table-headers", *columns, "client_properties"
    )
    rows = [line.split("\t") for line in out.splitlines() if f'"{name}"' in line]
    assert len(rows) <= 1, rows
    return rows[0][: len(columns)] if rows else None


def _name(kind: str) -> str:
    return f"conformance-{kind}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("kind", KINDS)
def test_the_broker_lists_the_heartbeat_asked_and_one_channel(session_broker, test_vhost_url, queue, kind):
    # Asked 1 s against the broker's 60 s: the smaller wins (connection.tune-ok), and the client
    # opens one channel, within any channel_max the broker offers.
    name = _name(kind)
    connection = open_connection(kind, test_vhost_url, queue, name=name, heartbeat_s=1)
    try:
        row = listed(session_broker, test_vhost_url, name, "timeout", "channel_max", "frame_max", "channels")
        assert row is not None
        timeout, channel_max, frame_max, channels = map(int, row)
        assert (timeout, channel_max, channels) == (1, 1, 1)
        assert 4096 <= frame_max <= 131_072
        # A heartbeat of 1 s is kept: the connection is still there past two missed ones.
        wait_a_little(connection, 2.5)
        assert listed(session_broker, test_vhost_url, name, "timeout") == ["1"]
    finally:
        connection.close()


@pytest.mark.parametrize("kind", FEEDS)
def test_a_body_over_several_frames_is_published_and_consumed_whole(test_vhost_url, queue, kind):
    # 300 kB against a frame_max of at most 128 KiB: three body frames or more each way.
    body = bytes(range(256)) * 1200
    connection = open_connection(kind, test_vhost_url, queue, name=_name(kind))
    assert isinstance(connection, FeedConnection)
    try:
        message = WireMessage(
            body=body, content_type="application/octet-stream", content_encoding="binary", headers={}
        )
        connection.publish(message, queue)
        delivery = connection.next_delivery(10.0)
        assert delivery is not None and delivery.body == body
        connection.ack(delivery)
    finally:
        connection.close()
    assert drain(test_vhost_url, queue) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_queue_deleted_under_the_consumer_is_a_cancel_that_names_it(test_vhost_url, queue, kind):
    connection = open_connection(kind, test_vhost_url, queue, name=_name(kind))
    try:
        delete_queues(test_vhost_url, queue)
        with pytest.raises(ConnectionLost) as lost:
            wait_a_little(connection, 10.0)
        assert lost.value.cancelled_queue == queue
        assert repr(queue) in str(lost.value) and "cancelled" in str(lost.value)
        assert not lost.value.consumer_timeout
    finally:
        connection.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_close_from_the_broker_is_answered_and_reported_with_its_reason(
    session_broker, test_vhost_url, queue, kind
):
    name = _name(kind)
    connection = open_connection(kind, test_vhost_url, queue, name=name)
    try:
        row = listed(session_broker, test_vhost_url, name, "pid")
        assert row is not None
        session_broker.rabbitmqctl("close_connection", row[0], f"conformance test closes {name}")
        with pytest.raises(ConnectionLost) as lost:
            wait_a_little(connection, 10.0)
        said = str(lost.value)
        assert "320" in said and "CONNECTION_FORCED" in said and f"conformance test closes {name}" in said
        assert connection._sock is None  # dropped: the caller connects again
        wait_for(
            lambda: listed(session_broker, test_vhost_url, name, "pid") is None,
            timeout_s=10, message="the broker still lists the connection it closed",
        )  # fmt: skip
        connection.connect()  # and it does, as the same client
        assert listed(session_broker, test_vhost_url, name, "pid") is not None
    finally:
        connection.close()
    wait_for(
        lambda: listed(session_broker, test_vhost_url, name, "pid") is None,
        timeout_s=10, message="a client close left the connection listed",
    )  # fmt: skip
