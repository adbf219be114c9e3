"""Matrix rows R8-R11: a 3-node cluster with quorum task queues loses a node, freezes, splits, restarts.

Each test publishes N journaled tasks at a steady pace from a publisher thread while a real worker
consumes them, injects its fault mid-stream, then checks the journal: every confirmed task ran
(0 lost), duplicates are bounded, and no client call blocked past its configured timeout. Clients
get the cluster as a failover list (``url1;url2;url3``) and shorter timeouts than the defaults
(``CLIENT_TIMEOUTS``), so a fault costs seconds, not the default 30 s confirm timeout.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from broker_svc import LamportClock, Publisher, PublishError, Settings, TaskMessage
from broker_svc.connection.pending import PendingPublish
from broker_svc.settings import ConfirmMode
from broker_svc.topology import task_queue
from tests.infra.cluster import RabbitCluster
from tests.infra.rabbitmq_tools import RabbitNodeError
from tests.reliability.journal import SIZES, Journal, Verdict, check, report
from tests.support.waiting import poll, wait_for
from tests.support.workers import WorkerProcess

# A 3-node cluster starves beside other tests on 2 cores: `make test` runs these after the rest.
pytestmark = pytest.mark.alone

# Short client timeouts so each fault costs seconds (the defaults are 30 s each).
CONFIRM_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 3.0
CLIENT_TIMEOUTS: dict[str, Any] = {
    "confirm_timeout_s": CONFIRM_TIMEOUT_S,
    "connect_timeout_s": CONNECT_TIMEOUT_S,
    "reconnect_window_s": 180.0,  # outlasts a full cluster restart (R11): nothing fails, it waits
    "heartbeat_s": 5,
}
CONCURRENCY = 2
PREFETCH_MULTIPLIER = 8
PREFETCH = CONCURRENCY * PREFETCH_MULTIPLIER
WORKER_ARGS = [
    "--broker-heartbeat",
    "5",
    "--without-mingle",
    "--prefetch-multiplier",
    str(PREFETCH_MULTIPLIER),
]
APP = "tests.reliability.journal_tasks:app"


def _ci(n: int) -> bool:
    return n <= 1_000


def publish_window_s(n: int) -> float:
    """How long the producer takes for ``n`` tasks: long enough for the fault to land mid-stream."""
    return 12.0 if _ci(n) else 40.0


# ==== Producer ==============================================================================


@dataclass
class Producer:
    """Publishes ``n`` journaled tasks at a steady pace from a thread and times every call.

    A second thread follows the confirms in publish order, timing each publish from hand-over to
    settlement, and journals each one as confirmed or not.
    """

    publisher: Publisher
    journal: Journal
    queue: str
    n: int
    window_s: float
    task: str = "journal.noop"
    sent: list[tuple[str, float, PendingPublish]] = field(default_factory=list)
    max_send_s: float = 0.0
    send_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    settled: int = 0
    confirmed_ids: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    _done_sending: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Producer:
        self._threads = [
            threading.Thread(target=self._send_all, name="producer", daemon=True),
            threading.Thread(target=self._follow_confirms, name="confirms", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def wait_sent(self, count: int, timeout_s: float = 60.0) -> None:
        wait_for(lambda: len(self.sent) >= count, timeout_s=timeout_s, message=f"{count} tasks not sent")

    def finish(self, timeout_s: float) -> None:
        """Wait until every task was sent and settled (confirmed or failed) or ``timeout_s`` passes."""
        poll(lambda: self._done_sending.is_set() and self.settled >= len(self.sent), timeout_s=timeout_s)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        for task_id, _t0, _pending in self.sent[self.settled :]:
            self.journal.published(task_id, confirmed=False)  # never settled: not confirmed

    @property
    def retries(self) -> int:
        """Publishes sent more than once (after a nack, a confirm timeout or a lost connection)."""
        return sum(max(0, pending.attempts - 1) for _id, _t0, pending in self.sent)

    @property
    def failure_kinds(self) -> dict[str, int]:
        """Why publishes failed: error text (first 80 characters) -> count."""
        kinds: dict[str, int] = {}
        for _id, _t0, pending in self.sent:
            if pending.done and pending.error is not None:
                key = f"{type(pending.error).__name__}: {str(pending.error)[:80]}"
                kinds[key] = kinds.get(key, 0) + 1
        return kinds

    @property
    def max_latency_s(self) -> float:
        return max(self.latencies, default=0.0)

    def _send_all(self) -> None:
        started = time.monotonic()
        try:
            for k in range(self.n):
                # Steady pace: the fault must land while tasks are still going out.
                pause = started + k * self.window_s / self.n - time.monotonic()
                if pause > 0 and self._stop.wait(pause):
                    return
                task_id = str(uuid.uuid4())
                message = TaskMessage(id=task_id, task=self.task, ignore_result=True, correlation_id=task_id)
                t0 = time.monotonic()
                try:
                    pending = self.publisher.send(message, queue=self.queue, queue_type="quorum")
                except Exception as exc:  # counted and reported: a send must not raise mid-fault
                    self.send_errors.append(f"{type(exc).__name__}: {exc}")
                    self.journal.published(task_id, confirmed=False)
                    continue
                self.max_send_s = max(self.max_send_s, time.monotonic() - t0)
                self.sent.append((task_id, t0, pending))
        finally:
            self._done_sending.set()

    def _follow_confirms(self) -> None:
        while not self._stop.is_set():
            if self.settled >= len(self.sent):
                if self._done_sending.is_set():
                    return
                self._stop.wait(0.01)
                continue
            task_id, t0, pending = self.sent[self.settled]
            if not pending.wait(0.1):
                continue
            self.latencies.append(time.monotonic() - t0)
            confirmed = pending.error is None
            (self.confirmed_ids if confirmed else self.failed).append(task_id)
            self.journal.published(task_id, confirmed=confirmed)
            self.settled += 1


# ==== Helpers ===============================================================================


def declare_task_queue(url: str, queue: str) -> None:
    """Declare ``queue`` as the library does (quorum), through the node at ``url``."""
    spec = task_queue(queue, queue_type="quorum")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().queue_declare(
            spec.name, durable=spec.durable, auto_delete=spec.auto_delete, arguments=spec.arguments or None
        )
    finally:
        connection.close()


def delete_queue(cluster: RabbitCluster, queue: str) -> None:
    for url in cluster.urls:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(url))
        except pika.exceptions.AMQPError:
            continue
        try:
            connection.channel().queue_delete(queue)
            return
        except pika.exceptions.AMQPError:
            continue
        finally:
            if connection.is_open:
                connection.close()


def client_settings(url: str, queue: str) -> Settings:
    return Settings(broker_url=url, quorum_queues=(queue,), **CLIENT_TIMEOUTS)


@contextmanager
def open_publisher(url: str, queue: str, name: str) -> Iterator[Publisher]:
    """A publisher for the test's producer; failed publishes are in the journal, so closing it
    does not raise for them (``Publisher.close`` would)."""
    publisher = Publisher(client_settings(url, queue), clock=LamportClock(), name=name)
    try:
        yield publisher
    finally:
        try:
            publisher.close(timeout=5.0)
        except PublishError:
            pass


def start_worker(url: str, queue: str, journal: Journal) -> WorkerProcess:
    env = {**journal.env, "CLOCKWORK_QUORUM_QUEUES": queue}
    worker = WorkerProcess(
        url, app=APP, queues=[queue], concurrency=CONCURRENCY, extra_args=WORKER_ARGS, env=env
    )
    return worker.wait_ready(timeout_s=60)


@contextmanager
def chaos_run(cluster: RabbitCluster, tmp_path: Path, *, leader: int) -> Iterator[tuple[str, Journal]]:
    """A fresh quorum task queue led by node ``leader``, and a journal; the queue is deleted afterwards."""
    queue = f"chaos-{uuid.uuid4().hex[:10]}"
    declare_task_queue(cluster.urls[leader], queue)
    cluster.transfer_leadership(queue, leader)
    try:
        yield queue, Journal(tmp_path / "journal")
    finally:
        cluster.restore()
        delete_queue(cluster, queue)


def hold_fault(since: float, duration_s: float) -> None:
    """Keep a fault in place until ``duration_s`` after ``since`` (monotonic).

    This is the fault's length, which the test sets; it is not a wait for a condition.
    """
    left = since + duration_s - time.monotonic()
    if left > 0:
        threading.Event().wait(left)


class LeaderWatch:
    """Times, from ``since``, how long until node ``ask`` names a leader of ``queue`` other than ``old``.

    Polls in a thread, so the fault's length stays what the test set (the CLI takes ~0.5 s a call).
    """

    def __init__(self, cluster: RabbitCluster, queue: str, *, old: int, ask: int, since: float) -> None:
        self.seconds: float | None = None
        self._stop = threading.Event()

        def watch() -> None:
            deadline = since + 90.0
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    if cluster.leader_of(queue, node=ask) not in (old, None):
                        self.seconds = round(time.monotonic() - since, 2)
                        return
                except RabbitNodeError:  # the asked node is busy or restarting: ask again
                    pass
                self._stop.wait(0.2)

        self._thread = threading.Thread(target=watch, name="leader-watch", daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(timeout=35)
        return self.seconds


def latency_during(producer: Producer, start: float, end: float) -> float:
    """The longest settle time of the publishes handed over between ``start`` and ``end`` (monotonic)."""
    worst = 0.0
    for (_id, t0, _pending), latency in zip(producer.sent, producer.latencies, strict=False):
        if start <= t0 <= end:
            worst = max(worst, latency)
    return round(worst, 3)


def finish_and_check(
    producer: Producer, journal: Journal, workers: list[WorkerProcess], *, timeout_s: float
) -> Verdict:
    producer.finish(timeout_s=timeout_s)
    try:
        journal.wait_executed(producer.confirmed_ids, timeout_s=timeout_s)
    except AssertionError as exc:
        logs = "\n".join(w.log_text()[-3000:] for w in workers)
        raise AssertionError(f"{exc}\nworker logs (tails):\n{logs}") from None
    return check(journal)


def allowed_duplicates(producer: Producer, worker_reconnects: int = 2) -> int:
    """At-least-once bound: each republished task may run twice, and each lost worker connection
    may hand back what it held (prefetch plus the tasks running)."""
    return producer.retries + worker_reconnects * (PREFETCH + CONCURRENCY)


def assert_sound(verdict: Verdict, producer: Producer, allowed: int) -> None:
    assert not producer.send_errors, producer.send_errors[:3]
    # Each fault is shorter than the client's bounds, so every publish must end confirmed.
    assert len(producer.failed) == 0, f"{len(producer.failed)} publishes failed: {producer.failure_kinds}"
    assert verdict.lost == 0, verdict
    assert verdict.unexpected == 0, verdict
    assert verdict.duplicated <= allowed, (verdict, allowed)
    # A repeat run with no redelivery mark can only be a second copy the publisher sent itself.
    assert verdict.unmarked_duplicates <= producer.retries, verdict


# ==== R8 ====================================================================================


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", SIZES)
def test_r8_sigkill_of_the_quorum_leader_node_loses_no_confirmed_task(
    fault_cluster: RabbitCluster, tmp_path: Path, n: int
) -> None:
    cluster = fault_cluster
    down_s = 10.0  # the matrix's: restart the killed node after 10 s
    with chaos_run(cluster, tmp_path, leader=0) as (queue, journal):
        # Publisher and worker both sit on the leader's node: both must fail over.
        url = cluster.failover_url_from(0)
        with (
            start_worker(url, queue, journal) as worker,
            open_publisher(url, queue, "r8-producer") as publisher,
        ):
            producer = Producer(publisher, journal, queue, n, publish_window_s(n)).start()
            producer.wait_sent(n // 4)
            killed_at = time.monotonic()
            cluster.kill_node(0)
            watch = LeaderWatch(cluster, queue, old=0, ask=1, since=killed_at)
            hold_fault(killed_at, down_s)
            cluster.start_node(0)
            new_leader_s = watch.stop()
            verdict = finish_and_check(producer, journal, [worker], timeout_s=120)
        allowed = allowed_duplicates(producer)
        report(
            "R8",
            verdict,
            n=n,
            duplicates=verdict.duplicated,
            allowed_duplicates=allowed,
            max_publish_latency_s=round(producer.max_latency_s, 3),
            max_latency_during_fault_s=latency_during(producer, killed_at, killed_at + down_s),
            max_send_call_s=round(producer.max_send_s, 3),
            publish_retries=producer.retries,
            publish_failed=len(producer.failed),
            publish_failures=producer.failure_kinds,
            new_leader_s=new_leader_s,
            node_down_s=down_s,
            confirm_timeout_s=CONFIRM_TIMEOUT_S,
        )
        assert new_leader_s is not None, "no new leader within 90 s of the kill"
        assert_sound(verdict, producer, allowed)


# ==== R9 ====================================================================================


def publisher_bound_s() -> float:
    """The longest one publish may take to settle: each attempt's confirm timeout (checked every
    0.5 s) and a reconnect, ``publish_attempts`` times (the default, 3)."""
    return Settings().publish_attempts * (CONFIRM_TIMEOUT_S + 0.5 + CONNECT_TIMEOUT_S) + 2.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", SIZES)
def test_r9_a_frozen_leader_blocks_no_client_call_past_its_timeout(
    fault_cluster: RabbitCluster, tmp_path: Path, n: int
) -> None:
    cluster = fault_cluster
    frozen_s = 12.0 if _ci(n) else 20.0  # the matrix's 20 s; shortened on CI
    with chaos_run(cluster, tmp_path, leader=0) as (queue, journal):
        # As the baseline: clients on other nodes (the frozen one last in their list).
        url = cluster.failover_url_from(1)
        with (
            start_worker(url, queue, journal) as worker,
            open_publisher(url, queue, "r9-producer") as publisher,
        ):
            producer = Producer(publisher, journal, queue, n, publish_window_s(n)).start()
            producer.wait_sent(n // 4)
            frozen_at = time.monotonic()
            cluster.freeze(0)
            watch = LeaderWatch(cluster, queue, old=0, ask=1, since=frozen_at)
            hold_fault(frozen_at, frozen_s)
            cluster.thaw(0)
            new_leader_s = watch.stop()
            verdict = finish_and_check(producer, journal, [worker], timeout_s=120)
        allowed = allowed_duplicates(producer)
        bound_s = publisher_bound_s()
        report(
            "R9",
            verdict,
            n=n,
            duplicates=verdict.duplicated,
            allowed_duplicates=allowed,
            max_publish_latency_s=round(producer.max_latency_s, 3),
            max_latency_during_fault_s=latency_during(producer, frozen_at, frozen_at + frozen_s),
            publish_latency_bound_s=bound_s,
            max_send_call_s=round(producer.max_send_s, 3),
            publishes_timed_out=sum(1 for _id, _t0, p in producer.sent if p.attempts > 1),
            publish_retries=producer.retries,
            publish_failed=len(producer.failed),
            publish_failures=producer.failure_kinds,
            new_leader_s=new_leader_s,
            frozen_s=frozen_s,
            frozen_s_shortened_on_ci=_ci(n),
            confirm_timeout_s=CONFIRM_TIMEOUT_S,
        )
        assert producer.max_send_s < CONFIRM_TIMEOUT_S, producer.max_send_s
        assert producer.max_latency_s <= bound_s, (producer.max_latency_s, bound_s)
        assert_sound(verdict, producer, allowed)


# R10 and R11 run at both sizes under ``-m chaos`` only: the default suite is at its 30-minute
# budget (29:38 on 2026-11-27), and these two rows are its longest cluster runs (28 s and 41 s).
CHAOS_SIZES = [pytest.param(1_000, id="n1000", marks=pytest.mark.chaos), *SIZES[1:]]


# ==== R10 ===================================================================================


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", CHAOS_SIZES)
def test_r10_a_publisher_on_the_minority_side_times_out_and_fails_over(
    fault_cluster: RabbitCluster, tmp_path: Path, n: int
) -> None:
    cluster = fault_cluster
    split_s = 15.0 if _ci(n) else 20.0  # the matrix's 20 s; shortened on CI
    with chaos_run(cluster, tmp_path, leader=0) as (queue, journal):
        # The publisher starts on the leader's node, which the partition isolates; the worker
        # consumes on the majority side.
        with (
            start_worker(cluster.failover_url_from(1), queue, journal) as worker,
            open_publisher(cluster.failover_url_from(0), queue, "r10-producer") as publisher,
        ):
            producer = Producer(publisher, journal, queue, n, publish_window_s(n)).start()
            producer.wait_sent(n // 4)
            split_at = time.monotonic()
            cluster.partition(0)
            watch = LeaderWatch(cluster, queue, old=0, ask=1, since=split_at)
            hold_fault(split_at, split_s)
            cluster.heal(0)
            new_leader_s = watch.stop()
            verdict = finish_and_check(producer, journal, [worker], timeout_s=120)
        # How long the minority-side client blocked: the longest wait of a publish made during the
        # split (it times out on the minority node, fails over and is confirmed by the majority).
        blocked_s = latency_during(producer, split_at, split_at + split_s)
        allowed = allowed_duplicates(producer)
        report(
            "R10",
            verdict,
            n=n,
            duplicates=verdict.duplicated,
            allowed_duplicates=allowed,
            minority_client_blocked_s=blocked_s,
            max_publish_latency_s=round(producer.max_latency_s, 3),
            max_send_call_s=round(producer.max_send_s, 3),
            publish_retries=producer.retries,
            publish_failed=len(producer.failed),
            publish_failures=producer.failure_kinds,
            new_leader_s=new_leader_s,
            partition_s=split_s,
            partition_s_shortened_on_ci=_ci(n),
            confirm_timeout_s=CONFIRM_TIMEOUT_S,
        )
        assert blocked_s <= CONFIRM_TIMEOUT_S + 0.5 + CONNECT_TIMEOUT_S + 5.0, blocked_s
        assert producer.max_send_s < CONFIRM_TIMEOUT_S, producer.max_send_s
        assert_sound(verdict, producer, allowed)


# ==== R11 ===================================================================================


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", CHAOS_SIZES)
def test_r11_clients_reconnect_by_themselves_after_a_full_cluster_restart(
    fault_cluster: RabbitCluster, tmp_path: Path, n: int
) -> None:
    cluster = fault_cluster
    with chaos_run(cluster, tmp_path, leader=0) as (queue, journal):
        url = cluster.failover_url
        with (
            start_worker(url, queue, journal) as worker,
            open_publisher(url, queue, "r11-producer") as publisher,
        ):
            worker_pid = worker.pid
            producer = Producer(publisher, journal, queue, n, publish_window_s(n)).start()
            producer.wait_sent(n // 4)
            stopped_at = time.monotonic()
            cluster.stop_all()
            up_wall = time.time()  # every node is down: any run journaled later came after the restart
            up_at = time.monotonic()
            cluster.up()
            booted_s = time.monotonic() - up_at
            resumed = poll(lambda: [e.at for e in journal.executions() if e.at > up_wall], timeout_s=120)
            resume_s = round(min(resumed) - up_wall, 2) if resumed else None
            verdict = finish_and_check(producer, journal, [worker], timeout_s=180)
            assert worker.proc.poll() is None and worker.pid == worker_pid, (
                "the worker process had to restart"
            )
        allowed = allowed_duplicates(producer)
        report(
            "R11",
            verdict,
            n=n,
            duplicates=verdict.duplicated,
            allowed_duplicates=allowed,
            consuming_resumed_s=resume_s,
            cluster_boot_s=round(booted_s, 2),
            cluster_stop_s=round(up_at - stopped_at, 2),
            max_publish_latency_s=round(producer.max_latency_s, 3),
            publish_retries=producer.retries,
            publish_failed=len(producer.failed),
            publish_failures=producer.failure_kinds,
        )
        assert resume_s is not None, "consuming did not resume within 120 s of the restart"
        assert_sound(verdict, producer, allowed)


# ==== P1 (nightly measurement) ===============================================================


def confirmed_rate(url: str, queue: str, n: int, *, confirm: ConfirmMode) -> float:
    """Publish ``n`` tasks to quorum queue ``queue`` and return confirmed publishes per second."""
    settings = Settings(broker_url=url, quorum_queues=(queue,), confirm=confirm, **CLIENT_TIMEOUTS)
    with Publisher(settings, clock=LamportClock(), name=f"p1-{confirm}") as publisher:
        publisher.send(
            TaskMessage(id=str(uuid.uuid4()), task="journal.noop"), queue=queue, queue_type="quorum"
        )
        publisher.flush(30)  # the queue exists and the connection is warm before timing
        started = time.monotonic()
        for _ in range(n):
            task_id = str(uuid.uuid4())
            message = TaskMessage(id=task_id, task="journal.noop", ignore_result=True, correlation_id=task_id)
            publisher.send(message, queue=queue, queue_type="quorum")
        publisher.flush(120)  # raises if any publish failed: a rate only counts confirmed ones
        return n / (time.monotonic() - started)


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_p1_confirmed_publishes_per_second_to_a_three_node_quorum_queue(cluster: RabbitCluster) -> None:
    n = 5_000
    queues = [f"p1-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    try:
        one_by_one = confirmed_rate(cluster.urls[0], queues[0], n, confirm="each")
        pipelined = confirmed_rate(cluster.urls[0], queues[1], n, confirm="pipelined")
    finally:
        for queue in queues:
            delete_queue(cluster, queue)
    report(
        "P1",
        None,
        n=n,
        one_by_one_per_s=round(one_by_one),
        pipelined_per_s=round(pipelined),
        speedup=round(pipelined / one_by_one, 1),
        baseline_one_by_one_per_s=546,
    )
    assert pipelined >= 5 * one_by_one, (pipelined, one_by_one)
