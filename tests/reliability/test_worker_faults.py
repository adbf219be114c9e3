"""RELIABILITY.md §2 A: worker faults (R1, R3-R7) and the worker's side of broker alarms (R12, R13).

Each test runs real workers on the journal tasks, injects one fault, and reports its figures with
``report``. Faults that reconfigure or break a broker (consumer timeout, forced closes, alarms) use a
private node; the others use the session's vhost on the shared broker.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import re
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from broker_svc import App, Settings, Signature
from broker_svc.errors import PublishError
from tests.infra.private_node import PrivateNode
from tests.reliability.journal import SIZES, Journal, Verdict, check, report
from tests.support.amqp import delete_queues
from tests.support.waiting import poll, wait_for
from tests.support.workers import DESIGN_THREADS, WorkerProcess, unique_queue
from worker.config import WorkerConfig, time_limits_over_consumer_timeout

JOURNAL_APP = "tests.reliability.journal_tasks:app"
# What a worker logs when it acks a tag its channel does not know (the error R4/R5 must not show).
UNKNOWN_TAG = "unknown delivery tag"


# -- helpers -------------------------------------------------------------------------------------


def publish(
    url: str, journal: Journal, queue: str, task: str, calls: Sequence[tuple[Any, ...]], **options: Any
) -> list[str]:
    """Send one ``task`` per args tuple (results ignored), wait for confirms, journal each publish."""
    app = App("reliability-producer", settings=Settings(broker_url=url))
    try:
        results = app.send_many(
            Signature(task, args, {}, {"queue": queue, "ignore_result": True, **options}) for args in calls
        )
        try:
            app.flush(timeout=120)
        except PublishError:
            pass  # each result below says whether it was confirmed
        for result in results:
            journal.published(result.id, confirmed=result.publish_error is None)
        return [r.id for r in results]
    finally:
        app.close(timeout=10)


def consumer_count(url: str, queue: str) -> int:
    """The broker's consumer count for ``queue`` (0 if it does not exist, or on a failed probe)."""
    try:
        connection = pika.BlockingConnection(pika.URLParameters(url))
    except pika.exceptions.AMQPError:
        return 0
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.consumer_count)
    except pika.exceptions.AMQPError:
        return 0
    finally:
        if connection.is_open:
            connection.close()


def consumes_again_event(proc: WorkerProcess) -> str:
    """What a worker logs once it consumes again after losing its connection.

    Each consumer of each child, connected again (so ``proc.consumers_per_queue`` of them after a
    fault that hit all).
    """
    return "feed_child_consuming"


def channel_lost_event(proc: WorkerProcess) -> str:
    """What a worker logs when the broker closes the channel its task deliveries came on.

    It carries ``consumer_timeout``; a consuming child drops its whole connection (one channel).
    """
    return "feed_connection_lost"


def logged_at(event: dict[str, Any]) -> float:
    """The wall-clock time of a worker log line (structlog's ISO timestamp)."""
    return dt.datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def worker(
    url: str, journal: Journal, queue: str, *, concurrency: int, args: Sequence[str] = ()
) -> WorkerProcess:
    return WorkerProcess(
        url, app=JOURNAL_APP, queues=[queue], concurrency=concurrency, extra_args=list(args), env=journal.env
    )


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "journal")


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("faults")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module")
def node() -> Iterator[PrivateNode]:
    """One private node for the faults that reconfigure or break the broker (started on first use)."""
    with PrivateNode.started() as private:
        yield private


# -- R1: SIGKILL mid-stream ------------------------------------------------------------------------

CONCURRENCY, MULTIPLIER = 8, 2
# What a killed worker can hold: each child's prefetch (its threads' under --threads), and the
# tasks it runs at once.
PREFETCH = CONCURRENCY * MULTIPLIER * DESIGN_THREADS
HELD = PREFETCH + CONCURRENCY * DESIGN_THREADS


def _kill_and_restart(
    url: str, journal: Journal, queue: str, task: str, calls: list[tuple[Any, ...]]
) -> Verdict:
    args = ["--prefetch-multiplier", str(MULTIPLIER)]
    first = worker(url, journal, queue, concurrency=CONCURRENCY, args=args).wait_ready()
    try:
        ids = publish(url, journal, queue, task, calls)
        wait_for(
            lambda: len(journal.executed_ids()) >= len(ids) // 5,
            timeout_s=90,
            interval_s=0.01,
            message="a fifth of the tasks ran",
        )
        os.kill(first.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        done_before = len(journal.executed_ids())
        first.proc.wait(timeout=30)
    finally:
        first.close()
    with worker(url, journal, queue, concurrency=CONCURRENCY, args=args) as second:
        second.wait_ready()
        journal.wait_executed(ids, timeout_s=120)
        recovery_s = round(time.monotonic() - killed_at, 2)
    verdict = check(journal)
    report(
        "R1",
        verdict,
        task=task,
        done_before_kill=done_before,
        allowed_duplicates=HELD,
        seconds_until_all_done=recovery_s,
    )
    assert verdict.lost == 0 and verdict.unexpected == 0, verdict
    assert verdict.duplicated <= HELD, verdict
    assert verdict.unmarked_duplicates == 0, verdict
    return verdict


@pytest.mark.timeout(600)  # the nightly size
@pytest.mark.parametrize("n", SIZES)
def test_r1_a_sigkilled_worker_loses_no_task_and_marks_each_duplicate(
    test_vhost_url: str, queue: str, journal: Journal, n: int
) -> None:
    _kill_and_restart(test_vhost_url, journal, queue, "journal.noop", [()] * n)


def test_r1_a_kill_between_side_effect_and_ack_duplicates_within_bounds(
    test_vhost_url: str, queue: str, journal: Journal
) -> None:
    # Each task journals, then sleeps before its ack: the kill lands inside that window for the
    # ones running, so they run again, and must come back marked redelivered.
    verdict = _kill_and_restart(test_vhost_url, journal, queue, "journal.record_then_sleep", [(0.3,)] * 120)
    assert verdict.duplicated >= 1, "the kill should have caught tasks between side effect and ack"


# -- R3: SIGTERM with ~100 in flight ---------------------------------------------------------------


def test_r3_sigterm_finishes_running_tasks_and_hands_back_the_prefetched_ones(
    test_vhost_url: str, queue: str, journal: Journal
) -> None:
    grace_s = 20.0
    # 4 children and a prefetch of 100: 4 running, ~96 reserved when the signal comes.
    args = ["--prefetch-multiplier", "25", "--shutdown-timeout", str(grace_s)]
    first = worker(test_vhost_url, journal, queue, concurrency=4, args=args).wait_ready()
    try:
        ids = publish(test_vhost_url, journal, queue, "journal.sleep", [(0.25,)] * 150)
        wait_for(lambda: len(journal.executed_ids()) >= 4, timeout_s=60, message="every child busy")
        started = time.monotonic()
        assert first.terminate(timeout_s=grace_s + 30) == 0
        shutdown_s = round(time.monotonic() - started, 2)
    finally:
        first.close()
    done_by_first = len(journal.executed_ids())
    runs_by_first = len(journal.executions())
    with worker(test_vhost_url, journal, queue, concurrency=6) as second:
        second.wait_ready()
        journal.wait_executed(ids, timeout_s=90)
    # Handed back unstarted: the second worker gets them flagged redelivered by the broker (the
    # rest it takes were never delivered). The broker's view: each child hands back its own
    # prefetch.
    requeued = sum(1 for e in journal.executions()[runs_by_first:] if e.redelivered)
    verdict = check(journal)
    report(
        "R3",
        verdict,
        shutdown_s=shutdown_s,
        grace_s=grace_s,
        requeued=requeued,
        done_by_first=done_by_first,
    )
    assert requeued >= 50, "the test needs many prefetched deliveries to hand back"
    assert shutdown_s < grace_s
    assert verdict.lost == 0 and verdict.duplicated == 0 and verdict.unexpected == 0, verdict


# -- R5: the worker frozen for longer than twice its heartbeat ---------------------------------------


def test_r5_a_frozen_worker_reconnects_without_stale_tag_errors(
    test_vhost_url: str, queue: str, journal: Journal
) -> None:
    heartbeat_s = 5
    args = ["--broker-heartbeat", str(heartbeat_s), "--prefetch-multiplier", "4"]
    with worker(test_vhost_url, journal, queue, concurrency=4, args=args) as proc:
        proc.wait_ready()
        ids = publish(test_vhost_url, journal, queue, "journal.sleep", [(0.1,)] * 200)
        wait_for(lambda: len(journal.executed_ids()) >= 20, timeout_s=60, message="tasks running")
        consuming_before = proc.count(consumes_again_event(proc))
        # A frozen machine freezes every process of the worker: the children hold connections
        # of their own, which freezing the main process alone would leave running.
        proc.signal_tree(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # The freeze lasts until the broker gave up on us (no consumer left on the queue), and
            # at least the 15 s of the matrix.
            wait_for(
                lambda: consumer_count(test_vhost_url, queue) == 0 and time.monotonic() - stopped_at >= 15,
                timeout_s=60,
                interval_s=0.5,
                message="the broker dropped the frozen worker's connection",
            )
        finally:
            proc.signal_tree(signal.SIGCONT)
        frozen_s = round(time.monotonic() - stopped_at, 1)
        resumed_at = time.monotonic()
        [probe] = publish(test_vhost_url, journal, queue, "journal.noop", [()])
        journal.wait_executed([probe], timeout_s=60)
        consuming_again_s = round(time.monotonic() - resumed_at, 2)
        journal.wait_executed(ids, timeout_s=90)
        errors_406 = proc.log_text().count(UNKNOWN_TAG)
        reconnected = proc.count(consumes_again_event(proc)) - consuming_before
        assert proc.proc.poll() is None, "the worker died"
    verdict = check(journal)
    report(
        "R5",
        verdict,
        heartbeat_s=heartbeat_s,
        frozen_s=frozen_s,
        seconds_until_consuming_again=consuming_again_s,
        unknown_delivery_tag_406=errors_406,
        reconnected=reconnected,
    )
    assert reconnected >= proc.consumers_per_queue  # every consumer the broker dropped is back
    assert errors_406 == 0
    assert verdict.lost == 0 and verdict.unmarked_duplicates == 0, verdict
    assert verdict.duplicated <= 16 + 4, verdict


# -- R7: the queue deleted under the consumer --------------------------------------------------------


def test_r7_a_deleted_queue_is_declared_and_consumed_again(
    test_vhost_url: str, queue: str, journal: Journal
) -> None:
    with worker(test_vhost_url, journal, queue, concurrency=2) as proc:
        proc.wait_ready()
        ids = publish(test_vhost_url, journal, queue, "journal.noop", [()] * 10)
        journal.wait_executed(ids, timeout_s=30)
        delete_queues(test_vhost_url, queue)
        deleted_at = time.monotonic()
        # Only the worker can bring the queue back here: a probe publish would declare it itself.
        wait_for(
            lambda: consumer_count(test_vhost_url, queue) == proc.consumers_per_queue,
            timeout_s=60,
            interval_s=0.1,
            message=f"the worker consumes {queue} again",
        )
        consumer_back_s = round(time.monotonic() - deleted_at, 2)
        [probe] = publish(test_vhost_url, journal, queue, "journal.noop", [()])
        journal.wait_executed([probe], timeout_s=30)
        consuming_again_s = round(time.monotonic() - deleted_at, 2)
        cancel_logged = proc.count("consumer_cancelled_by_broker")
    report(
        "R7",
        check(journal),
        consumer_back_s=consumer_back_s,
        seconds_until_consuming_again=consuming_again_s,
        cancel_logged=cancel_logged,
    )
    assert cancel_logged >= 1


# -- R4: a task outliving the broker's consumer_timeout ----------------------------------------------

CONSUMER_TIMEOUT_S = 5


def _broker_env(node: PrivateNode, *, consumer_timeout_ms: int, tick_ms: int) -> None:
    # Both apply to channels opened afterwards. channel_tick_interval is how often a channel checks
    # its deliveries' age (60 s by default): CI shortens it so the test takes seconds, not minutes.
    node.rabbitmqctl(
        "eval",
        f"application:set_env(rabbit, consumer_timeout, {consumer_timeout_ms}),"
        f" application:set_env(rabbit, channel_tick_interval, {tick_ms}).",
    )


@pytest.mark.parametrize(
    "tick_s",
    [
        pytest.param(1, id="tick1s"),
        pytest.param(60, id="tick60s", marks=[pytest.mark.chaos, pytest.mark.timeout(300)]),
    ],
)
def test_r4_a_task_past_consumer_timeout_neither_stalls_nor_duplicates(
    node: PrivateNode, journal: Journal, tick_s: int
) -> None:
    queue = unique_queue("r4")
    _broker_env(node, consumer_timeout_ms=CONSUMER_TIMEOUT_S * 1000, tick_ms=tick_s * 1000)
    # A limit of 600 s against a 5 s timeout: the start-up check must warn about every task.
    args = [
        "--prefetch-multiplier",
        "11",
        "--consumer-timeout",
        str(CONSUMER_TIMEOUT_S),
        "--time-limit",
        "600",
    ]
    proc = worker(node.url, journal, queue, concurrency=2, args=args)
    try:
        proc.wait_ready()
        warnings = proc.count("time_limit_over_consumer_timeout")
        long_s = CONSUMER_TIMEOUT_S + tick_s + 4  # past the timeout and the tick that notices it
        [long_id] = publish(node.url, journal, queue, "journal.sleep", [(long_s,)])
        others = publish(node.url, journal, queue, "journal.sleep", [(0.1,)] * 20)
        journal.wait_executed([long_id], timeout_s=30)
        started_at = next(e.at for e in journal.executions() if e.task_id == long_id)
        closed = proc.first(channel_lost_event(proc), timeout_s=CONSUMER_TIMEOUT_S + tick_s + 30)
        detection_s = round(logged_at(closed) - started_at, 2)
        # Still consuming: a task sent after the close runs while the long one still does.
        [probe] = publish(node.url, journal, queue, "journal.noop", [()])
        journal.wait_executed([probe, *others], timeout_s=30)
        probe_at = next(e.at for e in journal.executions() if e.task_id == probe)
        still_consuming = probe_at < started_at + long_s
        wait_for(
            lambda: _queue_totals(node, queue) == (0, 0),
            timeout_s=30,
            interval_s=0.5,
            message="nothing left ready or unacked",
        )
        stale_406 = proc.log_text().count(UNKNOWN_TAG)
        joined = proc.count("task_redelivery_joined_run")
        assert proc.proc.poll() is None, "the worker died"
    finally:
        proc.close()
        _broker_env(node, consumer_timeout_ms=1_800_000, tick_ms=60_000)
    verdict = check(journal)
    report(
        "R4",
        verdict,
        consumer_timeout_s=CONSUMER_TIMEOUT_S,
        tick_s=tick_s,
        detection_latency_s=detection_s,
        still_consuming=still_consuming,
        warnings=warnings,
        unknown_delivery_tag_406=stale_406,
        redeliveries_joined=joined,
    )
    assert closed["consumer_timeout"] is True, closed
    assert detection_s <= CONSUMER_TIMEOUT_S + tick_s + 5
    assert still_consuming
    assert warnings >= 1
    assert stale_406 == 0
    assert verdict.lost == 0 and verdict.unmarked_duplicates == 0, verdict
    assert verdict.duplicated == 0, verdict


def _queue_totals(node: PrivateNode, queue: str) -> tuple[int, int] | None:
    """(ready, unacked) of ``queue`` on the private node, or None if it is not listed."""
    out = node.rabbitmqctl(
        "list_queues", "-q", "--no-table-headers", "name", "messages_ready", "messages_unacknowledged"
    )
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == queue:
            return int(fields[1]), int(fields[2])
    return None


# -- R6: the worker's connections force-closed, again and again --------------------------------------


@pytest.mark.timeout(600)  # the nightly size
@pytest.mark.parametrize("n", SIZES)
def test_r6_forced_closes_leave_the_consumer_in_place_and_lose_nothing(
    node: PrivateNode, journal: Journal, n: int
) -> None:
    queue = unique_queue("r6")
    with worker(node.url, journal, queue, concurrency=4, args=["--prefetch-multiplier", "2"]) as proc:
        proc.wait_ready()
        # About 30 s of work for 4 children (and their threads) whatever n, so that the five
        # closes land mid-run even when each reconnect takes 3 s on a loaded machine.
        task_s = max(0.005, 120.0 * DESIGN_THREADS / n)
        ids = publish(node.url, journal, queue, "journal.sleep", [(task_s,)] * n)
        reconnect_s: list[float] = []
        consumer_counts: list[int] = []
        expected = proc.consumers_per_queue
        for _ in range(5):
            reopened = proc.count(consumes_again_event(proc))
            closed_at = time.time()
            node.rabbitmqctl("close_all_connections", "R6 forced close")
            event = wait_for(
                functools.partial(_reopened_after, proc, reopened, expected),
                timeout_s=30,
                interval_s=0.05,
                message="every consumer came back",
            )
            assert event is not None
            reconnect_s.append(round(logged_at(event) - closed_at, 3))
            # The broker's own view: the worker's consumers on the task queue again, exactly one
            # per child (a child's threads share its consumer).
            consumer_counts.append(
                wait_for(
                    lambda: _consumers(node, queue) == expected and expected,
                    timeout_s=30,
                    interval_s=0.5,
                    message=f"{expected} consumer(s) on the task queue",
                )
            )
            # Two seconds between closes, the matrix's rhythm, counted from this close.
            poll(lambda: False, timeout_s=max(0.0, closed_at + 2.0 - time.time()))  # the matrix's 2 s rhythm
        done_during_closes = len(journal.executed_ids())
        journal.wait_executed(ids, timeout_s=180)
    verdict = check(journal)
    ordered = sorted(reconnect_s)
    report(
        "R6",
        verdict,
        closes=len(reconnect_s),
        reconnect_p50_s=ordered[len(ordered) // 2],
        reconnect_max_s=ordered[-1],
        consumers_after_each_close=consumer_counts,
        consumers_expected=expected,
        done_during_closes=done_during_closes,
    )
    assert done_during_closes < n, "the run ended before the closes: make the tasks longer"
    assert verdict.lost == 0 and verdict.unexpected == 0 and verdict.unmarked_duplicates == 0, verdict


def _reopened_after(proc: WorkerProcess, seen: int, needed: int) -> dict[str, Any] | None:
    """The ``needed``-th consuming-again event after the first ``seen`` ones, if logged by now."""
    events = [e for e in proc.events() if e.get("event") == consumes_again_event(proc)]
    return events[seen + needed - 1] if len(events) >= seen + needed else None


def _consumers(node: PrivateNode, queue: str) -> int:
    out = node.rabbitmqctl("list_consumers", "-q", "--no-table-headers", "queue_name", "consumer_tag")
    return sum(1 for line in out.splitlines() if line.split()[:1] == [queue])


# -- R12 / R13: memory and disk alarms, the worker's side ------------------------------------------

ALARMS = [
    pytest.param(
        "R12",
        ("set_vm_memory_high_watermark", "0.00001"),
        ("set_vm_memory_high_watermark", "0.4"),
        id="memory",
    ),
    pytest.param("R13", ("set_disk_free_limit", "100000GB"), ("set_disk_free_limit", "50MB"), id="disk"),
]
ALARM_S = 5.0


def _connection_states(node: PrivateNode, worker_name: str) -> dict[str, str]:
    """The broker's state (running, blocking, blocked) of each of a worker's connections, by role."""
    out = node.rabbitmqctl("list_connections", "-q", "--no-table-headers", "state", "client_properties")
    pattern = re.compile(rf"clockwork-worker {re.escape(worker_name)} (\w+)")
    states = {}
    for line in out.splitlines():
        state, _, properties = line.partition("\t")
        match = pattern.search(properties)
        if match:
            states[match[1]] = state.strip()
    return states


def _alarmed(node: PrivateNode) -> bool:
    return "resource_limit" in node.rabbitmqctl("eval", "rabbit_alarm:get_alarms().")


@pytest.mark.parametrize(("row", "raise_alarm", "clear_alarm"), ALARMS)
def test_r12_r13_a_worker_keeps_consuming_through_an_alarm_and_resumes_after(
    node: PrivateNode, journal: Journal, row: str, raise_alarm: tuple[str, str], clear_alarm: tuple[str, str]
) -> None:
    queue = unique_queue("alarm")
    concurrency = 4  # prefetch 4 (per thread): with acks stalled, at most that many could run
    prefetch = concurrency * DESIGN_THREADS
    with worker(node.url, journal, queue, concurrency=concurrency) as proc:
        proc.wait_ready()
        # Frozen while the backlog is published and the alarm is raised, so that every task it
        # runs from its release on runs under the alarm.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # About 5 s of work (for its threads too): the worker publishes heartbeats meanwhile,
            # so its publishing connection is blocked for most of the window (what would stall
            # acks on a shared one).
            ids = publish(node.url, journal, queue, "journal.sleep", [(0.05 * DESIGN_THREADS,)] * 400)
            node.rabbitmqctl(*raise_alarm)
            try:
                wait_for(lambda: _alarmed(node), timeout_s=30, interval_s=0.5, message="the alarm is on")
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            released_at = time.time()
            # Hold the alarm ALARM_S (or until the backlog is done) and count what ran under it.
            wait_for(
                lambda: time.time() - released_at >= ALARM_S or set(ids) <= journal.executed_ids(),
                timeout_s=ALARM_S + 5,
                message="alarm window",
            )
            during = sum(1 for e in journal.executions() if e.at >= released_at)
            window_s = time.time() - released_at
            states = _connection_states(node, proc.name)
        finally:
            node.rabbitmqctl(*clear_alarm)
        wait_for(lambda: not _alarmed(node), timeout_s=30, interval_s=0.5, message="the alarm cleared")
        cleared_at = time.monotonic()
        journal.wait_executed(ids, timeout_s=60)
        # Publishing works again: a task whose result comes back (the worker's publishing side).
        app = App("alarm-probe", settings=Settings(broker_url=node.url))
        try:
            result = app.send_task("journal.noop", queue=queue)
            app.flush(timeout=30)
            journal.published(result.id, confirmed=True)
            result.get(timeout=30)
        finally:
            app.close(timeout=10)
        resumed_s = round(time.monotonic() - cleared_at, 2)
        assert proc.proc.poll() is None, "the worker died"
    verdict = check(journal)
    report(
        row,
        verdict,
        alarm_s=round(window_s, 2),
        tasks_during_alarm=during,
        throughput_during_alarm_per_s=round(during / window_s, 1),
        prefetch=prefetch,
        seconds_until_results_again=resumed_s,
        connection_states_during_alarm=states,
    )
    # "blocking": would be blocked if it published; it never does, so the broker keeps reading it.
    assert states.get("consume") in ("running", "blocking") and states.get("publish") == "blocked", states
    assert during > prefetch, "acks stalled under the alarm: no more than the prefetch ran"
    assert verdict.lost == 0 and verdict.unexpected == 0, verdict


# -- the start-up check behind R4's warning (pure) ---------------------------------------------------


def test_time_limits_within_a_minute_of_the_consumer_timeout_are_reported() -> None:
    limits = {"short": 60.0, "edge": 1740.0, "long": 7200.0, "unbounded": None}
    over = time_limits_over_consumer_timeout(limits, consumer_timeout_s=1800.0)
    assert over == {"edge": 1740.0, "long": 7200.0}
    assert time_limits_over_consumer_timeout(limits, consumer_timeout_s=None) == {}


def test_worker_config_refuses_a_negative_heartbeat_or_a_zero_consumer_timeout() -> None:
    settings = Settings()
    with pytest.raises(ValueError, match="broker_heartbeat_s"):
        WorkerConfig(app_spec=JOURNAL_APP, settings=settings, broker_heartbeat_s=-1)
    with pytest.raises(ValueError, match="consumer_timeout_s"):
        WorkerConfig(app_spec=JOURNAL_APP, settings=settings, consumer_timeout_s=0)
