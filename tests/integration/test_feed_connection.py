"""A consuming child's own connection against the real broker: consume, settle, publish, heartbeats, loss."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import pytest

from broker_svc import Settings
from broker_svc.amqp.feed_connection import ConnectionLost, FeedConnection, TaskDelivery
from broker_svc.errors import BrokerUnavailable, Unroutable
from broker_svc.topology import QueueSpec, dead_letter_queue, task_queue
from broker_svc.wire.task.task_message import WireMessage
from tests.support.amqp import channel, delete_queues, drain, publish_raw, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("fc")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(name, durable=True)
    yield name
    delete_queues(test_vhost_url, name, f"{name}.made")


def _connection(
    url: str, queue: str, *, prefetch: int = 1, heartbeat_s: int = 30, declare: Sequence[QueueSpec] = ()
) -> FeedConnection:
    settings = Settings(broker_url=url, heartbeat_s=heartbeat_s, confirm_timeout_s=5.0)
    connection = FeedConnection(
        settings, name="test-feed", queues=[queue], prefetch=prefetch, declare=declare
    )
    connection.connect()
    return connection


def _holding(connection: FeedConnection, count: int) -> bool:
    # What arrived is read first: held() alone shows only what a read already took.
    connection.check()
    return len(connection.held()) == count


def _message(body: bytes = b"{}") -> WireMessage:
    return WireMessage(body=body, content_type="application/json", content_encoding="utf-8", headers={"k": 1})


def test_deliveries_carry_their_properties_and_acks_remove_them(test_vhost_url: str, queue: str):
    for i in range(3):
        publish_raw(
            test_vhost_url,
            queue,
            b"x" * 70_000,
            headers={"id": f"t{i}", "n": i},
            reply_to="r",
            correlation_id=f"c{i}",
        )
    connection = _connection(test_vhost_url, queue, prefetch=2)
    try:
        got = []
        for _ in range(3):
            delivery = connection.next_delivery(5.0)
            assert delivery is not None
            got.append(delivery)
            connection.ack(delivery)  # with prefetch 2, the third comes only after an ack
        assert [d.headers["id"] for d in got] == ["t0", "t1", "t2"]
        first = got[0]
        assert len(first.body) == 70_000 and first.reply_to == "r" and first.correlation_id == "c0"
        assert first.queue == queue and first.routing_key == queue and not first.redelivered
        assert first.headers["n"] == 0
        assert connection.next_delivery(0.3) is None
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0


def test_prefetch_bounds_what_is_delivered_unacked(test_vhost_url: str, queue: str):
    for i in range(5):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=2)
    try:
        held = [connection.next_delivery(5.0), connection.next_delivery(5.0)]
        assert connection.next_delivery(0.5) is None  # two unacked: the broker sends no third
        assert all(held)
    finally:
        connection.close()


def test_a_new_prefetch_binds_at_once_and_keeps_what_was_delivered(test_vhost_url: str, queue: str):
    # basic.qos alone binds only later consumers: set_prefetch makes each queue's consumer anew,
    # sized to what is outstanding (a cancelled consumer's deliveries count against no limit).
    for i in range(8):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=1)
    try:
        first = connection.next_delivery(5.0)
        assert first is not None and connection.next_delivery(0.3) is None  # one unacked at prefetch 1
        connection.set_prefetch(4)
        more = [connection.next_delivery(5.0) for _ in range(3)]
        assert all(more) and connection.next_delivery(0.3) is None  # 1 of the old consumer + 3: 4 in all
        assert connection.prefetch == 4
        connection.set_prefetch(1)
        fifth = connection.next_delivery(5.0)  # the newest consumer's one (at least one each)
        assert fifth is not None and connection.next_delivery(0.3) is None
        for delivery in [first, *more, fifth]:
            assert delivery is not None and delivery.queue == queue
            connection.ack(delivery)  # the cancelled consumers' deliveries are acked as any other
        for _ in range(3):  # then one at a time
            connection.catch_up()  # nothing to catch up at prefetch 1
            delivery = connection.next_delivery(5.0)
            assert delivery is not None and connection.next_delivery(0.3) is None
            connection.ack(delivery)
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0  # all 8 acked: nothing lost or requeued


def _all_delivered(connection: FeedConnection) -> list[TaskDelivery]:
    got = []
    while (delivery := connection.next_delivery(0.3)) is not None:
        got.append(delivery)
    return got


def test_each_parked_copy_lets_one_more_come_and_catch_up_restores_the_whole_prefetch(
    test_vhost_url: str, queue: str
):
    # A park (hold) makes the consumers anew. Sized to what is outstanding, the broker sends one
    # more per parked copy; with a whole prefetch each time, a burst of copies after a reconnect
    # left hundreds held in one child (R6 under --threads).
    for i in range(40):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=4)
    try:
        taken = _all_delivered(connection)
        assert len(taken) == 4
        for parked in range(1, 6):
            connection.hold(1, connection.generation)
            more = _all_delivered(connection)
            assert len(more) == 1, f"park {parked}: {len(more)} more came"
            taken += more
        assert len(taken) == 9  # the prefetch and the five parked copies
        for delivery in taken:
            connection.ack(delivery)
        # The newest consumer (limit 1) may have taken one more since its delivery was acked.
        taken = _all_delivered(connection)
        assert len(taken) <= 1
        connection.catch_up()  # what cancelled consumers held is settled: the whole 4 + 5 again
        taken += _all_delivered(connection)
        assert 9 <= len(taken) <= 10, len(taken)
        for delivery in taken:
            connection.ack(delivery)
    finally:
        connection.close()


@pytest.fixture
def quorum_queue(test_vhost_url: str) -> Iterator[QueueSpec]:
    spec = task_queue(unique_queue("fcq"), queue_type="quorum")
    yield spec
    delete_queues(test_vhost_url, spec.name)


@pytest.mark.parametrize("change", ["set_prefetch", "pause", "hold"])
def test_a_quorum_consumer_changed_right_after_an_ack_returns_nothing_to_the_queue(
    test_vhost_url: str, quorum_queue: QueueSpec, change: str
):
    # A quorum queue returns what reaches a consumer after its cancel, counted as a delivery
    # (x-delivery-count): without waiting for what was on its way, each change right after an ack
    # counted one task a delivery it never had.
    connection = _connection(test_vhost_url, quorum_queue.name, prefetch=4, declare=[quorum_queue])
    try:
        for i in range(60):
            publish_raw(test_vhost_url, quorum_queue.name, b"{}", headers={"id": f"t{i}"})
        counts: dict[str, int] = {}
        for step in range(8):
            delivery = connection.next_delivery(5.0)
            assert delivery is not None
            counts[delivery.headers["id"]] = delivery.headers.get("x-delivery-count", 0)
            connection.ack(delivery)  # the broker sends one more to fill its place...
            if change == "set_prefetch":  # ...and at once the consumer is made anew
                connection.set_prefetch(4 + (step % 2))
            elif change == "pause":
                for held in connection.pause() or []:
                    counts[held.headers["id"]] = held.headers.get("x-delivery-count", 0)
                    connection.ack(held)
                connection.resume()
            else:
                connection.hold(1 if step % 2 == 0 else -1, connection.generation)
        while (delivery := connection.next_delivery(0.5)) is not None:
            counts[delivery.headers["id"]] = delivery.headers.get("x-delivery-count", 0)
            connection.ack(delivery)
    finally:
        connection.close()
    assert len(counts) == 60, len(counts)
    assert {task: n for task, n in counts.items() if n} == {}


def test_a_nack_with_requeue_comes_back_redelivered(test_vhost_url: str, queue: str):
    publish_raw(test_vhost_url, queue, b"{}", headers={"id": "again"})
    connection = _connection(test_vhost_url, queue)
    try:
        first = connection.next_delivery(5.0)
        assert first is not None
        connection.nack(first, requeue=True)
        second = connection.next_delivery(5.0)
        assert second is not None and second.redelivered and second.headers["id"] == "again"
        connection.ack(second)
    finally:
        connection.close()


def test_a_settle_from_a_lost_connection_is_not_sent(test_vhost_url: str, queue: str):
    publish_raw(test_vhost_url, queue, b"{}", headers={"id": "stale"})
    connection = _connection(test_vhost_url, queue)
    try:
        old = connection.next_delivery(5.0)
        assert old is not None
        connection.drop()  # as a failed read would
        connection.connect()
        connection.ack(old)  # its tag belongs to the lost channel: not sent, no 406
        again = connection.next_delivery(5.0)
        assert again is not None and again.redelivered and again.generation == old.generation + 1
        connection.ack(again)
        assert connection.next_delivery(0.3) is None
    finally:
        connection.close()


class _CountingReads(FeedConnection):
    """The real connection, counting the checks that read while deliveries waited in hand."""

    reads = 0
    looks_in_hand = 0

    def _receive(self, sock: socket.socket, flags: int = 0) -> int | None:
        self.reads += 1
        return super()._receive(sock, flags)

    def check(self, delivery: TaskDelivery | None = None) -> None:
        in_hand, reads = bool(self.held()), self.reads
        super().check(delivery)
        if in_hand and self.reads > reads:
            self.looks_in_hand += 1


def test_a_burst_of_short_tasks_looks_at_the_socket_once_a_millisecond_not_once_a_task(
    test_vhost_url: str, queue: str
):
    for i in range(300):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    settings = Settings(broker_url=test_vhost_url, confirm_timeout_s=5.0)
    connection = _CountingReads(settings, name="test-feed", queues=[queue], prefetch=50)
    connection.connect()
    try:
        wait_for(lambda: _holding(connection, 50), timeout_s=5, message="the prefetch delivered")
        looks, started, ids = connection.looks_in_hand, time.monotonic(), []
        for _ in range(300):  # as a child's loop: take, settle, check
            delivery = connection.next_delivery(5.0)
            assert delivery is not None
            ids.append(delivery.headers["id"])
            connection.ack(delivery)
            connection.check(delivery)
        elapsed_ms = (time.monotonic() - started) * 1000
        assert ids == [f"t{i}" for i in range(300)]
        # While deliveries wait in hand, one look per millisecond at most (one per task before); a
        # machine so slow that a task takes a millisecond looks after each, as it should.
        in_hand = connection.looks_in_hand - looks
        assert in_hand <= elapsed_ms + 1, (in_hand, elapsed_ms)
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0


def test_publishes_are_confirmed_returned_when_unroutable_and_declare_first(test_vhost_url: str, queue: str):
    connection = _connection(test_vhost_url, queue)
    made = f"{queue}.made"
    try:
        connection.publish(_message(b'{"a": 1}'), queue)
        with pytest.raises(Unroutable):
            connection.publish(_message(), f"{queue}.nobody")
        connection.publish(_message(), made, declare=[QueueSpec(made, durable=True)])
        connection.publish(_message(), made, declare=[QueueSpec(made, durable=True)])  # declared once
    finally:
        connection.close()
    assert [m.body for m in drain(test_vhost_url, queue)] == [b'{"a": 1}']
    assert queue_depth(test_vhost_url, made) == 2


def test_publish_all_is_confirmed_together_and_ack_all_settles_each(test_vhost_url: str, queue: str):
    # A stalled child's hand-back: every copy out at once and confirmed, then the originals acked.
    for i in range(5):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=5)
    made = f"{queue}.made"
    with channel(test_vhost_url) as ch:
        ch.queue_declare(made, durable=True)
    try:
        held = [connection.next_delivery(5.0) for _ in range(5)]
        assert all(d is not None for d in held)
        connection.publish_all([(_message(f'{{"n": {i}}}'.encode()), made) for i in range(5)])
        assert queue_depth(test_vhost_url, made) == 5  # confirmed: the broker has them all
        connection.ack_all([d for d in held if d is not None])
        with pytest.raises(Unroutable):  # one the broker returns fails the whole call, named
            connection.publish_all([(_message(), made), (_message(), f"{queue}.nobody")])
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0  # unacked ones would be back after the close
    assert [m.body for m in drain(test_vhost_url, made)][:5] == [f'{{"n": {i}}}'.encode() for i in range(5)]


def test_queues_take_turns_among_what_a_deep_prefetch_holds(test_vhost_url: str, queue: str):
    # A quiet queue's task waits for one task of a busy queue, not for all the child holds of it.
    quiet = f"{queue}.made"
    with channel(test_vhost_url) as ch:
        ch.queue_declare(quiet, durable=True)
    for i in range(20):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"busy{i}"})
    settings = Settings(broker_url=test_vhost_url, confirm_timeout_s=5.0)
    connection = FeedConnection(settings, name="test-feed", queues=[queue, quiet], prefetch=30)
    connection.connect()
    try:
        wait_for(lambda: _holding(connection, 20), timeout_s=5, message="the busy queue's 20 delivered")
        first = connection.next_delivery(5.0)  # the busy queue's turn
        for i in range(2):
            publish_raw(test_vhost_url, quiet, b"{}", headers={"id": f"quiet{i}"})
        wait_for(lambda: _holding(connection, 21), timeout_s=5, message="the quiet queue's 2 delivered")
        taken = [first, *(connection.next_delivery(5.0) for _ in range(21))]
        ids = [d.headers["id"] for d in taken if d is not None]
        assert ids[:4] == ["busy0", "quiet0", "busy1", "quiet1"], ids
        assert [i for i in ids if i.startswith("busy")] == [f"busy{i}" for i in range(20)]  # FIFO
        for delivery in taken:
            if delivery is not None:
                connection.ack(delivery)
    finally:
        connection.close()


def test_a_channel_error_is_a_lost_connection_that_connects_again(test_vhost_url: str, queue: str):
    connection = _connection(test_vhost_url, queue)
    try:
        with pytest.raises(ConnectionLost, match="PRECONDITION_FAILED"):
            # The queue exists as durable: declaring it otherwise makes the broker close the channel.
            connection.publish(_message(), queue, declare=[QueueSpec(queue, durable=False)])
        connection.connect()
        connection.publish(_message(), queue)
    finally:
        connection.close()


def test_heartbeats_go_out_while_a_task_runs(test_vhost_url: str, queue: str):
    connection = _connection(test_vhost_url, queue, heartbeat_s=1)
    try:
        with connection.running():
            time.sleep(3.5)  # past the broker's two missed heartbeats
        connection.publish(_message(), queue)  # still connected
    finally:
        connection.close()


def test_without_them_the_broker_drops_a_silent_connection(test_vhost_url: str, queue: str):
    # The control for the test above: the same wait outside ``running()`` sends nothing.
    connection = _connection(test_vhost_url, queue, heartbeat_s=1)
    try:
        time.sleep(3.5)
        with pytest.raises(ConnectionLost):
            connection.publish(_message(), queue)
            connection.next_delivery(3.0)
    finally:
        connection.close()


def test_cancel_hands_back_what_was_delivered_and_not_taken(test_vhost_url: str, queue: str):
    for i in range(3):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=3)
    try:
        taken = connection.next_delivery(5.0)
        assert taken is not None
        left = connection.cancel()  # what came before the broker's cancel-ok
        assert connection.next_delivery(0.5) is None  # and nothing after it
        for delivery in left:
            connection.nack(delivery, requeue=True)
        connection.ack(taken)
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 2


def test_held_shows_what_waits_unread_behind_a_running_task_without_taking_it(
    test_vhost_url: str, queue: str
):
    # inspect reserved: while a task runs, what the broker sends behind it stays in the socket.
    publish_raw(test_vhost_url, queue, b"{}", headers={"id": "t0"})
    connection = _connection(test_vhost_url, queue, prefetch=4)
    try:
        running = connection.next_delivery(5.0)
        assert running is not None and running.headers["id"] == "t0"
        with connection.running():
            for i in range(1, 4):  # sent now, nobody reads them: only a peek sees them
                publish_raw(test_vhost_url, queue, b"x" * (20_000 * i), headers={"id": f"t{i}"})
            wait_for(lambda: len(connection.held()) == 3, timeout_s=5, message="the other three never showed")
            held = connection.held()
        assert [d.headers["id"] for d in held] == ["t1", "t2", "t3"]
        assert [len(d.body) for d in held] == [20_000, 40_000, 60_000]  # each whole
        assert all(d.queue == queue and d.generation == running.generation for d in held)
        assert [d.tag for d in held] == [running.tag + 1, running.tag + 2, running.tag + 3]
        connection.ack(running)
        taken = [connection.next_delivery(5.0) for _ in range(3)]  # the peek took nothing
        assert [d.headers["id"] for d in taken if d is not None] == ["t1", "t2", "t3"]
        assert connection.held() == []
        for delivery in taken:
            assert delivery is not None
            connection.ack(delivery)
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 0


def test_failover_goes_to_the_next_url_and_a_refusal_says_why(test_vhost_url: str, queue: str):
    parts = urlsplit(test_vhost_url)
    dead = urlunsplit(parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:1"))
    settings = Settings(broker_url=f"{dead};{test_vhost_url}", connect_timeout_s=2.0)
    connection = FeedConnection(settings, name="test-feed", queues=[queue], prefetch=1)
    connection.connect()
    connection.close()
    wrong = Settings(broker_url=test_vhost_url.replace("guest:guest", "guest:wrong"), connect_timeout_s=2.0)
    with pytest.raises(BrokerUnavailable, match="ACCESS_REFUSED|403|closed"):
        FeedConnection(wrong, name="test-feed", queues=[queue], prefetch=1).connect()


def test_a_queue_deleted_under_the_consumer_is_declared_again_on_the_next_connect(test_vhost_url: str):
    name = unique_queue("fc-gone")
    specs = (dead_letter_queue(name), task_queue(name, queue_type="classic"))
    settings = Settings(broker_url=test_vhost_url, confirm_timeout_s=5.0)
    connection = FeedConnection(settings, name="test-feed", queues=[name], prefetch=1, declare=specs)
    try:
        connection.connect()  # declared before it is consumed: nobody made it before
        delete_queues(test_vhost_url, name)
        with pytest.raises(ConnectionLost) as lost:
            connection.next_delivery(5.0)
        assert lost.value.cancelled_queue == name and not lost.value.consumer_timeout
        connection.connect()
        # Back as declared (durable, bound to its exchange): a publish through the exchange arrives.
        with channel(test_vhost_url) as ch:
            assert ch.queue_declare(name, durable=True, passive=True).method.consumer_count == 1
            ch.basic_publish(exchange=name, routing_key=name, body=b"{}")
        delivery = connection.next_delivery(5.0)
        assert delivery is not None and delivery.queue == name
        connection.ack(delivery)
    finally:
        connection.close()
        delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.mark.parametrize("seen_by", ["next_delivery", "check"])
def test_prefetched_deliveries_of_a_channel_closed_meanwhile_are_not_handed_out(
    test_vhost_url: str, queue: str, seen_by: str
):
    # What a consumer_timeout does under a long task: the broker closes the channel and requeues
    # everything it held, prefetched deliveries included, which may then run elsewhere. The next
    # delivery's read sees the close (t1, t2 still in our socket), and so does a check after the
    # ack with t1, t2 read already and in hand: its last read is old by then.
    for i in range(3):
        publish_raw(test_vhost_url, queue, b"{}", headers={"id": f"t{i}"})
    connection = _connection(test_vhost_url, queue, prefetch=3)
    try:
        first = connection.next_delivery(5.0)
        assert first is not None
        if seen_by == "check":
            wait_for(lambda: _holding(connection, 2), timeout_s=5, message="two more in hand")
        connection.ack(dataclasses.replace(first, tag=first.tag + 100))  # the broker: 406, channel closed
        wait_for(lambda: queue_depth(test_vhost_url, queue) == 3, timeout_s=10, message="all requeued")
        with pytest.raises(ConnectionLost, match="406"):
            if seen_by == "check":
                connection.check(first)
            else:
                connection.next_delivery(0)  # not the prefetched t1: the broker has it back
    finally:
        connection.close()
    assert queue_depth(test_vhost_url, queue) == 3
