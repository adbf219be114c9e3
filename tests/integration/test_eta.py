"""ETA and countdown: never early, parked in delay queues, and a backlog costs the worker nothing."""

from __future__ import annotations

import datetime as dt
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from broker_svc import App, AsyncResult, Publisher, Settings, Signature, TaskMessage, TaskRevokedError
from broker_svc.clock import LamportClock
from broker_svc.connection.pending import PendingPublish
from broker_svc.topology import DEFAULT_EXCHANGE, delay_queue, task_queue
from broker_svc.wire import codec
from broker_svc.wire.task.task_message import encode_task
from control.blocking.client import ControlClient
from tests.infra.rabbitmq_tools import Rabbitmqctl
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import channel, delete_queues, drain, queue_depth, queue_exists
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue
from worker.rules.prefetch_budget import MAX_PER_THREAD

STARTED_AT = "tests.integration.e2e_tasks.started_at"
ADD = "tests.integration.e2e_tasks.add"
NOOP = "tests.integration.e2e_tasks.noop"
HOUR_S = 3600.0
# The `worker` fixture: 2 children at the default prefetch budget, which parking (a republish to a
# delay queue, far quicker than the budget) takes to its cap: the bound of what a worker holds.
CONCURRENCY = 2
PREFETCH = MAX_PER_THREAD * CONCURRENCY
ACCEPT = codec.accept_set(["json", "msgpack"])


def delay_queue_names(queue: str) -> list[str]:
    return [delay_queue(queue, 2**k).name for k in range(7, 32)]


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    """A fresh task queue; its dead-letter and delay queues are deleted with it."""
    name = unique_queue("eta")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead", *delay_queue_names(name))


@pytest.fixture
def reply_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("eta-reply")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(name)
    yield name
    delete_queues(test_vhost_url, name)


@pytest.fixture
def ctl(session_broker: SessionBroker) -> Rabbitmqctl:
    if session_broker.rabbitmqctl is None:
        pytest.skip("unacked counts are read with rabbitmqctl, which this broker does not offer")
    return session_broker.rabbitmqctl


def eta_in(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)


def celery_style(url: str, queue: str, messages: list[TaskMessage]) -> None:
    """Publish as a Celery client does: ETA tasks straight into the task queue (no parking)."""
    with Publisher(Settings(broker_url=url), clock=LamportClock(), name="celery-style") as publisher:
        publisher.submit(
            [
                PendingPublish(
                    encode_task(m, serializer="json"),
                    exchange=DEFAULT_EXCHANGE,
                    routing_key=queue,
                    declare=(task_queue(queue),),
                )
                for m in messages
            ]
        )
        publisher.flush(timeout=60)


def wait_result(url: str, reply_queue: str, *, timeout_s: float) -> dict:
    got = wait_for(lambda: drain(url, reply_queue, limit=1), timeout_s=timeout_s, message="no result")
    body = codec.decode(got[0].body, got[0].properties.content_type, accept=ACCEPT, max_bytes=1 << 20)
    assert isinstance(body, dict)
    return body


def succeeded(worker: WorkerProcess, task_id: str) -> bool:
    return any(e.get("event") == "task_succeeded" and e.get("task_id") == task_id for e in worker.events())


# -- never early -------------------------------------------------------------------------------


def test_a_countdown_task_from_our_client_waits_in_a_delay_queue_and_never_starts_early(
    test_vhost_url: str, queue: str, client: App, worker: WorkerProcess
):
    eta = eta_in(3)
    result = client.send_task(STARTED_AT, queue=queue, eta=eta)
    client.flush(timeout=10)
    # Parked by the client itself: 3 s away is the 2,048 ms bucket; the task queue never saw it.
    assert queue_depth(test_vhost_url, f"{queue}.delay.2048ms") == 1
    started = result.get(timeout=20)
    assert eta.timestamp() <= started < eta.timestamp() + 2.5


def test_a_celery_style_eta_task_is_parked_by_the_worker_and_never_starts_early(
    test_vhost_url: str, queue: str, reply_queue: str, worker: WorkerProcess
):
    eta = eta_in(3)
    task_id = TaskMessage.new_id()
    message = TaskMessage(id=task_id, task=STARTED_AT, eta=eta, reply_to=reply_queue, correlation_id=task_id)
    celery_style(test_vhost_url, queue, [message])
    # The worker took it from the task queue and parked it instead of holding it unacked.
    wait_for(
        lambda: (
            queue_exists(test_vhost_url, f"{queue}.delay.2048ms")
            and queue_depth(test_vhost_url, f"{queue}.delay.2048ms") == 1
        ),
        timeout_s=1.5,
        message="the worker did not park the ETA task",
    )
    body = wait_result(test_vhost_url, reply_queue, timeout_s=20)
    assert body["status"] == "SUCCESS" and body["task_id"] == task_id
    assert eta.timestamp() <= body["result"] < eta.timestamp() + 2.5


def test_a_task_due_within_the_hold_window_waits_in_the_worker_and_never_starts_early(
    queue: str, client: App, worker: WorkerProcess
):
    eta = eta_in(0.1)
    started = client.send_task(STARTED_AT, queue=queue, eta=eta).get(timeout=10)
    assert eta.timestamp() <= started < eta.timestamp() + 1.0


# -- expiry ------------------------------------------------------------------------------------


def all_empty(url: str, queue: str) -> bool:
    names = [queue, *delay_queue_names(queue)[:6]]  # buckets up to 4 s
    return all(queue_depth(url, name) == 0 for name in names if queue_exists(url, name))


def test_a_task_that_expires_while_parked_is_revoked_and_never_runs(
    test_vhost_url: str, queue: str, client: App, worker: WorkerProcess
):
    result = client.send_task(STARTED_AT, queue=queue, countdown=2, expires=1)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    assert result.state == "REVOKED"
    # Settled for good: nothing is left anywhere to run it later.
    wait_for(lambda: all_empty(test_vhost_url, queue), timeout_s=5, message="the task is still queued")
    assert not succeeded(worker, result.id)


def test_a_parked_task_is_revoked_when_it_expires_not_at_its_eta(
    test_vhost_url: str, queue: str, client: App, worker: WorkerProcess
):
    # The client keeps the message's AMQP expiration on the parked copy: it dead-letters back to
    # the task queue when it expires (RabbitMQ strips the expiration as it does), and the worker
    # answers REVOKED then, not 4 s later.
    sent = time.monotonic()
    result = client.send_task(STARTED_AT, queue=queue, countdown=4, expires=1)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    assert time.monotonic() - sent < 3.0


def test_a_celery_style_task_that_expires_while_the_worker_parked_it_is_revoked(
    test_vhost_url: str, queue: str, reply_queue: str, worker: WorkerProcess
):
    task_id = TaskMessage.new_id()
    message = TaskMessage(
        id=task_id,
        task=STARTED_AT,
        eta=eta_in(2),
        expires=eta_in(1),
        reply_to=reply_queue,
        correlation_id=task_id,
    )
    celery_style(test_vhost_url, queue, [message])
    body = wait_result(test_vhost_url, reply_queue, timeout_s=20)
    assert body["status"] == "REVOKED" and body["task_id"] == task_id
    wait_for(lambda: all_empty(test_vhost_url, queue), timeout_s=5, message="the task is still queued")
    assert not succeeded(worker, task_id)


# -- a backlog of ETA tasks --------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class QueueCounts:
    ready: dict[str, int]
    unacked: dict[str, int]

    def delayed(self, queue: str) -> int:
        return sum(n for name, n in self.ready.items() if name.startswith(f"{queue}.delay."))


def queue_counts(ctl: Rabbitmqctl, vhost: str) -> QueueCounts:
    out = ctl(
        "list_queues", "-p", vhost, "name", "messages_ready", "messages_unacknowledged",
        "--no-table-headers", "--quiet",
    )  # fmt: skip
    counts = QueueCounts({}, {})
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1].isdigit():
            counts.ready[parts[0]] = int(parts[1])
            counts.unacked[parts[0]] = int(parts[2])
    return counts


@dataclass
class Sampler:
    """Samples the worker's RSS and its unacked deliveries in the background (rabbitmqctl paces it)."""

    ctl: Rabbitmqctl
    vhost: str
    queue: str
    pid: int
    rss_kib: list[int] = field(default_factory=list)
    unacked: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Sampler:
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._rss, self._unacked)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _rss(self) -> None:
        while not self._stop.wait(0.05):
            self.rss_kib.append(rss_kib(self.pid))

    def wait_for_next_sample(self) -> None:
        seen = len(self.unacked)
        wait_for(lambda: len(self.unacked) > seen, timeout_s=30, message="no broker sample")

    def _unacked(self) -> None:
        # rabbitmqctl starts an Erlang VM per call (~0.7 s of CPU): pace it, or the sampling
        # itself takes a core from the worker and the broker on a small machine.
        while True:
            self.unacked.append(queue_counts(self.ctl, self.vhost).unacked.get(self.queue, 0))
            if self._stop.wait(1.0):
                return


def timed_round_trip(client: App, queue: str, i: int) -> float:
    sent = time.monotonic()
    assert client.send_task(ADD, (i, 1), queue=queue).get(timeout=10) == i + 1
    return time.monotonic() - sent


def spread_countdowns(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0, HOUR_S) for _ in range(n)]


def percentile(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, len(ordered) * pct // 100)] if ordered else 0.0


def report(label: str, **figures: object) -> None:
    print(f"\n[{label}] " + " ".join(f"{k}={v}" for k, v in figures.items()))


@pytest.fixture
def prober(test_vhost_url: str) -> Iterator[App]:
    """A second client for the due tasks, so they never queue behind the backlog in one connection."""
    app = App("prober", settings=Settings(broker_url=test_vhost_url))
    yield app
    app.close(timeout=10)


def watch(sampler: Sampler, client: App, queue: str, *, seconds: float, latencies: list[float]) -> None:
    """Send one due task per broker sample (rabbitmqctl paces it) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sampler.wait_for_next_sample()
        latencies.append(timed_round_trip(client, queue, len(latencies)))


@pytest.mark.parametrize(
    ("n", "watch_s"),
    [(10_000, 8.0), pytest.param(100_000, 120.0, marks=[pytest.mark.chaos, pytest.mark.timeout(900)])],
)
def test_a_backlog_of_eta_tasks_waits_in_the_broker_while_due_tasks_run_at_once(
    n: int,
    watch_s: float,
    test_vhost_url: str,
    ctl: Rabbitmqctl,
    queue: str,
    client: App,
    prober: App,
    worker: WorkerProcess,
):
    vhost = Settings(broker_url=test_vhost_url).virtual_host
    countdowns = spread_countdowns(n, seed=n)
    timed_round_trip(prober, queue, -1)  # warm: connections, children, queues
    rss_start = rss_kib(worker.pid)
    publishing: list[float] = []  # due-task round trips while the backlog is being sent
    latencies: list[float] = []  # and once it is in place
    # The tasks that come due while we watch report when they started; the rest are no-ops.
    base = dt.datetime.now(dt.UTC)
    etas = [base + dt.timedelta(seconds=c) for c in countdowns]
    observed: dict[int, AsyncResult] = {}
    cpu_start = cpu_s(worker.pid)
    started = time.monotonic()
    with Sampler(ctl, vhost, queue, worker.pid) as sampler:
        for i in range(0, n, 2000):
            batch = range(i, min(n, i + 2000))
            results = client.send_many(
                Signature(STARTED_AT, options={"queue": queue, "eta": etas[k]})
                if countdowns[k] < watch_s
                else Signature(NOOP, options={"queue": queue, "eta": etas[k], "ignore_result": True})
                for k in batch
            )
            observed.update((k, r) for k, r in zip(batch, results, strict=True) if countdowns[k] < watch_s)
            publishing.append(timed_round_trip(prober, queue, i))
        client.flush(timeout=120)
        published_s = time.monotonic() - started
        counts = queue_counts(ctl, vhost)
        elapsed = time.monotonic() - started
        watch(sampler, prober, queue, seconds=watch_s, latencies=latencies)
    worker_cpu = cpu_s(worker.pid) - cpu_start
    wall_s = time.monotonic() - started
    # Started minus ETA of every watched task: never negative. Only tasks due after the last of
    # the backlog reached the broker count for lateness; earlier ones waited in the client.
    lateness = [observed[k].get(timeout=10) - etas[k].timestamp() for k in sorted(observed)]
    in_time = [
        late for k, late in zip(sorted(observed), lateness, strict=True) if countdowns[k] > published_s
    ]
    not_due = sum(1 for c in countdowns if c > elapsed + 2)
    report(
        f"client-side backlog n={n}",
        published_s=round(published_s, 1),
        wall_s=round(wall_s, 1),
        worker_cpu_pct=round(100 * worker_cpu / wall_s),
        delayed=counts.delayed(queue),
        task_queue_ready=counts.ready.get(queue),
        max_unacked=max(sampler.unacked),
        rss_start_mib=round(rss_start / 1024, 1),
        rss_max_mib=round(max(sampler.rss_kib) / 1024, 1),
        samples=(len(sampler.rss_kib), len(sampler.unacked)),
        due_while_publishing_max_ms=round(max(publishing) * 1000, 1),
        due_tasks=len(latencies),
        due_p50_ms=round(sorted(latencies)[len(latencies) // 2] * 1000, 1),
        due_max_ms=round(max(latencies) * 1000, 1),
        eta_tasks_run=len(lateness),
        early_min_ms=round(min(lateness) * 1000),
        late_p50_ms=round(percentile(in_time, 50) * 1000),
        late_p90_ms=round(percentile(in_time, 90) * 1000),
        late_max_ms=round(max(in_time, default=0) * 1000),
    )
    # The backlog is in the delay queues, not in the task queue or the worker.
    assert counts.delayed(queue) + counts.ready.get(queue, 0) + counts.unacked.get(queue, 0) >= not_due
    assert counts.ready.get(queue, 0) <= n // 100
    assert max(sampler.unacked) <= PREFETCH
    assert max(sampler.rss_kib) - rss_start < 20 * 1024, sampler.rss_kib
    # Due tasks run at once beside the backlog. While it is being sent they share the broker
    # with the bulk publish and with the ETA tasks that come due during it.
    assert max(latencies) < 1.0, latencies
    assert max(publishing) < 3.0, publishing
    # ETA tasks that came due meanwhile ran, none early, few more than a shortest delay late.
    assert lateness and min(lateness) >= 0, lateness
    assert in_time, (
        f"no watched task came due after the backlog was sent ({published_s:.1f} s); raise watch_s"
    )
    assert percentile(in_time, 90) < 0.25 and max(in_time) < 2.5, in_time


def test_a_celery_style_backlog_is_parked_by_the_worker_with_bounded_memory_and_unacked(
    test_vhost_url: str, ctl: Rabbitmqctl, queue: str, client: App, worker: WorkerProcess
):
    n = 2000
    vhost = Settings(broker_url=test_vhost_url).virtual_host
    timed_round_trip(client, queue, -1)  # warm
    rss_start = rss_kib(worker.pid)
    now = dt.datetime.now(dt.UTC)
    messages = [
        TaskMessage(id=TaskMessage.new_id(), task=NOOP, eta=now + dt.timedelta(seconds=c), ignore_result=True)
        for c in spread_countdowns(n, seed=7)
    ]
    with Sampler(ctl, vhost, queue, worker.pid) as sampler:
        started = time.monotonic()
        celery_style(test_vhost_url, queue, messages)
        published_s = time.monotonic() - started
        # A due task sent now queues behind the whole backlog: it waits for all of it to be parked.
        first = timed_round_trip(client, queue, 0)
        parked_s = time.monotonic() - started
        latencies = [timed_round_trip(client, queue, i) for i in range(20)]
        counts = queue_counts(ctl, vhost)
    report(
        f"worker-side backlog n={n}",
        published_s=round(published_s, 2),
        first_due_s=round(first, 2),
        parked_s=round(parked_s, 2),
        parking_rate_per_s=round(n / parked_s),
        delayed=counts.delayed(queue),
        max_unacked=max(sampler.unacked),
        rss_start_mib=round(rss_start / 1024, 1),
        rss_max_mib=round(max(sampler.rss_kib) / 1024, 1),
        due_max_ms=round(max(latencies) * 1000, 1),
    )
    # Every ETA task still waiting is in a delay queue, none in the task queue.
    not_due = sum(1 for m in messages if m.eta is not None and m.eta > dt.datetime.now(dt.UTC))
    assert counts.ready.get(queue, 0) == 0
    assert counts.delayed(queue) + counts.unacked.get(queue, 0) >= not_due - PREFETCH
    assert max(sampler.unacked) <= PREFETCH
    assert max(sampler.rss_kib) - rss_start < 20 * 1024, sampler.rss_kib
    # Parking runs at well over 200 tasks/s here, so 2,000 are out of the way within 10 s; once
    # they are, due tasks run at once again.
    assert first < 10.0
    assert max(latencies) < 1.0, latencies


# -- inspect scheduled ---------------------------------------------------------------------------


def _listing(url: str, node: str, count: int) -> list[dict] | None:
    """The node's scheduled list once it holds ``count`` entries (None before)."""
    got = _scheduled(url, node)
    return got if len(got) == count else None


def _scheduled(url: str, node: str) -> list[dict]:
    with ControlClient(Settings(broker_url=url)) as control:
        replies = control.broadcast("scheduled", {}, destination=[node], reply=True, timeout_s=5).replies
    [reply] = [r[node] for r in replies if node in r]
    assert isinstance(reply, list)
    return reply


@pytest.fixture
def quiet_vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    """A vhost of the test's own: the module's backlogs leave 12,000 park records in the shared
    vhost's scheduled stream, which a new worker reads from the start before it lists a new park
    (seconds on a busy machine: longer than a near task waits for its ETA)."""
    with session_broker.own_vhost("clockwork-scheduled") as url:
        yield url


def test_inspect_scheduled_lists_what_the_worker_parked_until_due_and_across_a_restart(
    quiet_vhost_url: str, queue: str
):
    test_vhost_url = quiet_vhost_url
    reply_queue = unique_queue("eta-reply")
    with channel(test_vhost_url) as ch:
        ch.queue_declare(reply_queue)
    etas = [eta_in(600 + i) for i in range(3)]
    far = [TaskMessage(id=TaskMessage.new_id(), task=ADD, args=[i, i], eta=eta) for i, eta in enumerate(etas)]
    near = TaskMessage(id=TaskMessage.new_id(), task=STARTED_AT, eta=eta_in(4), reply_to=reply_queue)
    node = f"scheduled-{queue}@test"
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=node) as worker:
        worker.wait_ready()
        celery_style(test_vhost_url, queue, [*far, near])
        listed = wait_for(
            lambda: _listing(test_vhost_url, node, 4), timeout_s=15, message="the four parked tasks listed"
        )
        assert listed is not None
        assert [entry["request"]["id"] for entry in listed] == [near.id, *(m.id for m in far)]  # soonest
        first = listed[1]
        assert first["request"]["name"] == ADD and first["request"]["args"] == [0, 0]
        assert dt.datetime.fromisoformat(first["eta"]).timestamp() == pytest.approx(
            etas[0].timestamp(), abs=0.01
        )
        assert first["request"]["hostname"] == node and first["request"]["acknowledged"] is False
        # The near one came due: it ran, and it is no longer listed.
        wait_result(test_vhost_url, reply_queue, timeout_s=20)
        assert [entry["request"]["id"] for entry in _scheduled(test_vhost_url, node)] == [m.id for m in far]
    # Read back from the stream by the same node after a restart: the same list.
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, name=node) as worker:
        worker.wait_ready()
        again = wait_for(
            lambda: _listing(test_vhost_url, node, 3),
            timeout_s=15,
            message="the parked tasks listed after a restart",
        )
        assert again is not None and [entry["request"]["id"] for entry in again] == [m.id for m in far]
        with ControlClient(Settings(broker_url=test_vhost_url)) as control:
            found = control.broadcast(
                "query_task", {"ids": [far[1].id]}, destination=[node], reply=True, timeout_s=5
            ).replies
        assert [r[node][far[1].id][0] for r in found if node in r] == ["scheduled"]
