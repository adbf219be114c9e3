"""``SharedFeedConnection``: the threads of one ``--threads`` child on one connection, acks coalesced."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pika
import pytest

from broker_svc import Settings
from broker_svc.amqp.delivery import ConnectionLost, TaskDelivery
from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from tests.support.amqp import channel, delete_queues, publish_raw, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("sfc")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(name, durable=True)
    yield name
    delete_queues(test_vhost_url, name)


def _connection(url: str, queue: str, *, prefetch: int) -> SharedFeedConnection:
    settings = Settings(broker_url=url, heartbeat_s=30, confirm_timeout_s=5.0)
    connection = SharedFeedConnection(settings, name="test-shared-feed", queues=[queue], prefetch=prefetch)
    connection.connect()
    return connection


def _fill(url: str, queue: str, count: int) -> None:
    with channel(url) as ch:
        for i in range(count):
            ch.basic_publish("", queue, b"{}", properties=pika.BasicProperties(headers={"id": f"t{i}"}))


def test_threads_taking_and_acking_at_once_settle_every_delivery_once(test_vhost_url: str, queue: str):
    _fill(test_vhost_url, queue, 600)
    connection = _connection(test_vhost_url, queue, prefetch=8)
    taken: list[str] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while (delivery := connection.next_delivery(1.5)) is not None:
                taken.append(delivery.headers["id"])
                connection.ack(delivery)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    connection.close()  # anything unacked would go back to the queue now
    assert not errors
    assert sorted(taken) == sorted(f"t{i}" for i in range(600))
    assert queue_depth(test_vhost_url, queue) == 0


@contextlib.contextmanager
def _two_delivered(url: str, queue: str) -> Iterator[tuple[SharedFeedConnection, TaskDelivery, TaskDelivery]]:
    # Two messages delivered and held unacked on a connection closed at the end.
    for i in range(2):
        publish_raw(url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(url, queue, prefetch=2)
    try:
        first, second = connection.next_delivery(5.0), connection.next_delivery(5.0)
        assert first is not None and second is not None
        yield connection, first, second
    finally:
        connection.close()


def _ack_behind_the_lock(
    connection: SharedFeedConnection, delivery: TaskDelivery
) -> tuple[threading.Thread, list[BaseException | None]]:
    # Another thread acks while the caller holds the socket lock: its ack waits in the queue.
    outcome: list[BaseException | None] = []

    def ack() -> None:
        try:
            connection.ack(delivery)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=ack)
    thread.start()
    wait_for(lambda: len(connection._settles) == 1, timeout_s=5, message="the second ack queued")
    return thread, outcome


def test_an_ack_queued_behind_another_write_goes_out_with_it(test_vhost_url: str, queue: str):
    with _two_delivered(test_vhost_url, queue) as (connection, first, second):
        with connection._lock:  # as a thread in the middle of a write
            thread, outcome = _ack_behind_the_lock(connection, second)
            connection.ack(first)  # writes both
            assert not connection._settles
        thread.join(5)
        assert outcome == [None]  # found its ack sent, and returned
    assert queue_depth(test_vhost_url, queue) == 0  # both acked: nothing came back at the close


def test_an_ack_queued_behind_a_failed_write_fails_in_its_own_thread_too(test_vhost_url: str, queue: str):
    with _two_delivered(test_vhost_url, queue) as (connection, first, second):
        with connection._lock:
            thread, outcome = _ack_behind_the_lock(connection, second)
            sock = connection._sock
            assert sock is not None
            sock.shutdown(socket.SHUT_WR)  # the next write fails
            with pytest.raises(ConnectionLost):
                connection.ack(first)
        thread.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionLost)
        connection.connect()
        again = [connection.next_delivery(5.0), connection.next_delivery(5.0)]
        # Neither ack reached the broker, and neither thread said it had.
        assert sorted(d.headers["id"] for d in again if d is not None and d.redelivered) == ["t0", "t1"]


def _closed_by_the_broker(session_broker, url: str, name: str) -> None:
    # The broker closes the connection named ``name``; return once its close can be peeked at.
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close a connection from its side)")
    vhost = unquote(urlsplit(url).path[1:]) or "/"
    out = session_broker.rabbitmqctl(
        "list_connections", "-p", vhost, "-q", "--no-table-headers", "pid", "client_properties"
    )
    (pid,) = [line.split("\t", 1)[0] for line in out.splitlines() if name in line]
    session_broker.rabbitmqctl("close_connection", pid, "test: a close told once")


@pytest.mark.parametrize("first", ["the peek", "a read"])
def test_a_close_seen_by_the_heartbeat_peek_and_by_a_read_at_once_is_told_once(
    session_broker, test_vhost_url: str, queue: str, first: str
):
    # The heartbeat thread peeks for a close while no thread holds the role, and a thread may take
    # the role just then and read the same close: its loss is made before the peek marks the close
    # seen, so both would tell it (CI saw two feed_connection_lost lines for one close).
    connection = _connection(test_vhost_url, queue, prefetch=1)
    # The test stages the peek and the read itself: the heartbeat thread, which peeks on its own
    # every second, could tell the close first (it did, under load). Stopped and waited for.
    connection._beating.clear()
    for thread in threading.enumerate():
        if thread.name == "clockwork-beat-test-shared-feed":
            thread.join(timeout=5)
            assert not thread.is_alive()
    told: list[ConnectionLost] = []
    connection.on_close_seen = told.append
    try:
        sock = connection._sock
        assert sock is not None
        _closed_by_the_broker(session_broker, test_vhost_url, "test-shared-feed")

        def close_arrived() -> bool:
            try:
                return bool(sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT))
            except BlockingIOError:
                return False

        wait_for(close_arrived, timeout_s=10, message="the broker's close on the socket")
        read_loss = ConnectionLost("connection test-shared-feed: the broker closed the connection")
        if first == "the peek":
            connection._peek_close(sock)
            assert len(told) == 1 and "while a task runs" in str(told[0])
            assert connection.loss_to_tell(read_loss) is None
        else:
            assert connection.loss_to_tell(read_loss) is read_loss
            connection._peek_close(sock)
            assert told == []
    finally:
        with contextlib.suppress(ConnectionLost):
            connection.close()


def test_a_loss_told_before_another_thread_connected_again_is_not_told_again(test_vhost_url: str, queue: str):
    # Threads meet one loss at different times: a thread whose settle was queued behind the failed
    # write raises it only after the first thread told it and connected again (CI saw a second
    # feed_connection_lost line, "lost before a settle went out", for one forced close).
    connection = _connection(test_vhost_url, queue, prefetch=1)
    try:
        seen = connection._lost("read failed: test")  # a thread sees its connection fail, drops it
        queued_behind = seen.again()  # what a thread whose ack rode on that write raises later
        told = connection.loss_to_tell(seen)
        assert told is not None and "read failed: test" in str(told)
        connection.connect()  # the first thread connects again
        assert connection.loss_to_tell(queued_behind) is None  # the old connection's, told already
        fresh = connection._lost("read failed: the new connection")
        assert connection.loss_to_tell(fresh) is fresh  # the new connection's own loss is told
    finally:
        with contextlib.suppress(ConnectionLost):
            connection.close()


def test_held_shows_what_no_thread_has_taken_and_leaves_it_for_them(test_vhost_url: str, queue: str):
    _fill(test_vhost_url, queue, 1)
    connection = _connection(test_vhost_url, queue, prefetch=5)
    try:
        first = connection.next_delivery(5.0)
        assert first is not None
        with channel(test_vhost_url) as ch:  # sent now, while no thread reads: only a peek sees them
            for i in range(1, 5):
                ch.basic_publish("", queue, b"{}", properties=pika.BasicProperties(headers={"id": f"t{i}"}))
        wait_for(lambda: len(connection.held()) == 4, timeout_s=5, message="the other four never showed")
        assert sorted(d.headers["id"] for d in connection.held()) == ["t1", "t2", "t3", "t4"]
        taken = [connection.next_delivery(5.0) for _ in range(4)]
        assert sorted(d.headers["id"] for d in taken if d is not None) == ["t1", "t2", "t3", "t4"]
        assert connection.held() == []
        for delivery in [first, *taken]:
            assert delivery is not None
            connection.ack(delivery)
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0
