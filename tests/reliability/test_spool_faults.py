"""The producer's spool under broker faults (issue 19), on a private node: rows SP1-SP5.

SP1: the broker stopped (``stop_app``) in the middle of a run of ``delay()`` calls: every accepted
task runs, duplicates are counted and marked, and a call stays fast while the broker is down.
SP2: the producer SIGKILLed during the outage; a successor on the same spool directory sends all.
SP3, SP4: a full disk and a full spool raise ``SpoolFull``; nothing accepted is lost. SP5: a memory
alarm: calls stay fast and everything goes out once it clears.
"""

from __future__ import annotations

import collections
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings, SpoolFull, Task
from broker_svc.errors import BrokerSvcError
from broker_svc.wire.task.task_message import RESENT_HEADER
from tests.infra.private_node import PrivateNode
from tests.reliability.journal import Journal, check, report
from tests.support.amqp import drain
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

JOURNAL_APP = "tests.reliability.journal_tasks:app"

# (tasks, outage seconds): the CI size on every run, the size in `make chaos`.
OUTAGES = [
    pytest.param(2_000, 8.0, id="n2000-8s"),
    pytest.param(20_000, 30.0, id="n20000-30s", marks=pytest.mark.chaos),
]
# A call that reaches the count trigger writes (and fsyncs) the buffer itself; nothing waits longer.
CALL_BOUND_S = 1.0


@pytest.fixture(scope="module")
def node() -> Iterator[PrivateNode]:
    with PrivateNode.started() as broker:
        yield broker


@pytest.fixture
def broker_down(node: PrivateNode) -> Iterator[PrivateNode]:
    """The node with its broker stopped (``stop_app``); started again afterwards whatever happens."""
    node.rabbitmqctl("stop_app")
    try:
        yield node
    finally:
        node.rabbitmqctl("start_app")


def _hold_fault(since: float, duration_s: float) -> None:
    # The fault's length, which the test sets; not a wait for a condition.
    left = since + duration_s - time.monotonic()
    if left > 0:
        threading.Event().wait(left)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else 0.0


def _spooled_app(url: str, spool_dir: Path, queue: str, **options: object) -> tuple[App, Task]:
    """An app with a spool whose ``journal.noop`` (run by the journal workers) goes to ``queue``."""
    settings = Settings(broker_url=url, spool_dir=str(spool_dir), **options)  # type: ignore[arg-type]
    app = App("spool-producer", settings=settings, task_routes={"journal.noop": {"queue": queue}})

    @app.task(name="journal.noop")
    def noop(*_args: object) -> None:  # the worker runs tests/reliability/journal_tasks.py's
        raise AssertionError("runs in the worker only")

    return app, noop


def _alarms(node: PrivateNode) -> str:
    return node.rabbitmqctl("eval", "rabbit_alarm:get_alarms().")


def _published(app: App) -> int:
    stats = app.spool_stats()
    return -1 if stats is None else stats.published


def _depth(app: App) -> int:
    stats = app.spool_stats()
    return -1 if stats is None else stats.depth


# -- SP1: the broker stopped in the middle of the run ----------------------------------------------


@pytest.mark.parametrize(("count", "outage_s"), OUTAGES)
def test_a_broker_outage_mid_run_loses_no_accepted_task_and_delay_stays_fast(
    node: PrivateNode, tmp_path: Path, count: int, outage_s: float
):
    journal = Journal(tmp_path / "journal")
    queue = unique_queue("outage")
    app, noop = _spooled_app(node.url, tmp_path / "spool", queue)
    calls: list[tuple[float, bool]] = []  # (seconds, broker down)
    errors: list[str] = []
    down, stop = threading.Event(), threading.Event()

    def produce() -> None:
        started = time.monotonic()
        window_s = 3 * outage_s  # the outage starts a third of the way in
        for k in range(count):
            pause = started + k * window_s / count - time.monotonic()
            if pause > 0 and stop.wait(pause):
                return
            was_down = down.is_set()
            t0 = time.perf_counter()
            try:
                result = noop.delay()
            except BrokerSvcError as exc:  # counted: no call may raise during the outage
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            calls.append((time.perf_counter() - t0, was_down))
            journal.published(result.id, confirmed=True)  # accepted: in the spool

    producer = threading.Thread(target=produce, name="producer")
    try:
        with WorkerProcess(
            node.url, app=JOURNAL_APP, queues=[queue], concurrency=2, env=journal.env
        ) as worker:
            worker.wait_ready(timeout_s=60)
            producer.start()
            wait_for(
                lambda: len(calls) >= count // 3, timeout_s=2 * outage_s, message="the run did not start"
            )
            down.set()
            node.rabbitmqctl("stop_app")
            down_at = time.monotonic()
            _hold_fault(down_at, outage_s)
            node.rabbitmqctl("start_app")
            up_at = time.monotonic()
            down.clear()
            at_restart = app.spool_stats()
            assert at_restart is not None
            depth_at_restart = at_restart.depth
            wait_for(lambda: app.spool_stats().can_publish, timeout_s=60, message="no reconnect")  # type: ignore[union-attr]
            reconnect_s = time.monotonic() - up_at
            # The backlog is drained once the broker confirmed as many as were accepted at the restart.
            wait_for(lambda: _published(app) >= at_restart.accepted, timeout_s=120, message="no drain")
            drained_s = time.monotonic() - up_at
            producer.join(timeout=4 * outage_s)
            wait_for(lambda: _depth(app) == 0, timeout_s=120, message="the spool did not drain")
            stats = app.spool_stats()
            journal.wait_executed(journal.publishes(), timeout_s=180)
    finally:
        stop.set()
        producer.join(timeout=30)
        app.close(timeout=10)
    verdict = check(journal)
    down_calls = [s for s, was_down in calls if was_down]
    report(
        "SP1", verdict, tasks=count, outage_s=outage_s, accepted=len(calls), call_errors=len(errors),
        calls_while_down=len(down_calls), delay_p50_ms=round(1000 * statistics.median(down_calls), 3),
        delay_p99_ms=round(1000 * _percentile(down_calls, 0.99), 3),
        delay_max_ms=round(1000 * max(down_calls), 1),
        spool_depth_at_restart=depth_at_restart, reconnect_s=round(reconnect_s, 2),
        drained_s_after_restart=round(drained_s, 2), resent=stats.resent if stats else None,
    )  # fmt: skip
    assert errors == [] and len(calls) == count
    assert verdict.lost == 0 and verdict.unexpected == 0 and verdict.unmarked_duplicates == 0, verdict
    assert depth_at_restart > 0 and len(down_calls) > count // 10  # the outage did land mid-run
    assert max(down_calls) < CALL_BOUND_S


# -- SP2: the producer killed during the outage ----------------------------------------------------


def _producer(
    node: PrivateNode, spool_dir: Path, queue: str, journal: Journal, *args: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.spool_producer", "--url", node.url, "--spool-dir",
         str(spool_dir), "--queue", queue, "--record", str(journal.directory / "published.jsonl"), *args],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["write-through", "buffered"])
def test_a_producer_killed_during_the_outage_leaves_every_spooled_task_to_its_successor(
    node: PrivateNode, tmp_path: Path, mode: str
):
    journal = Journal(tmp_path / "journal")
    queue = unique_queue("killed")
    spool_dir = tmp_path / "spool"
    count = 3_000
    node.rabbitmqctl("stop_app")
    producer: subprocess.Popen[str] | None = None
    try:
        if mode == "write-through":
            # Each call returns once its task is written (no fsync: a killed process's writes stay
            # in the page cache); killed mid-stream, every call that returned must run.
            producer = _producer(node, spool_dir, queue, journal, "--count", str(count), "--flush-count", "1",
                                 "--no-fsync")  # fmt: skip
            wait_for(
                lambda: sum(journal.publishes().values()) >= count // 2, timeout_s=60, message="too slow"
            )
        else:
            # Buffered: killed once the time trigger has written what the calls put in memory.
            producer = _producer(node, spool_dir, queue, journal, "--count", str(count), "--then", "written")
            assert producer.stdout is not None and producer.stdout.readline().strip() == "written"
    finally:
        if producer is not None:
            producer.send_signal(signal.SIGKILL)
            producer.wait(30)
            if producer.stdout is not None:
                producer.stdout.close()
        node.rabbitmqctl("start_app")
    accepted = sum(journal.publishes().values())
    successor, _ = _spooled_app(node.url, spool_dir, queue)
    try:
        with WorkerProcess(
            node.url, app=JOURNAL_APP, queues=[queue], concurrency=2, env=journal.env
        ) as worker:
            worker.wait_ready(timeout_s=60)
            started = time.monotonic()
            successor.connect()
            successor.flush(timeout=120)  # every task the spool held when it opened is confirmed
            drained_s = time.monotonic() - started
            stats = successor.spool_stats()
            assert stats is not None
            journal.wait_executed({i for i, ok in journal.publishes().items() if ok}, timeout_s=120)
    finally:
        successor.close(timeout=10)
    verdict = check(journal)
    report("SP2", verdict, mode=mode, accepted=accepted, replayed=stats.replayed,
           drained_s=round(drained_s, 2))  # fmt: skip
    assert verdict.lost == 0 and verdict.unexpected == 0 and verdict.duplicated == 0, verdict
    assert stats.replayed >= accepted > 0
    if mode == "buffered":
        assert accepted == count


# -- SP3, SP4: a full disk, a full spool ----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk that fills up for real (ENOSPC)."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.fail(
            f"this test fills a 1 MiB tmpfs and needs root (CAP_SYS_ADMIN) to mount it: {mounted.stderr}",
            pytrace=False,
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(noop: Task, limit: int) -> tuple[list[str], list[SpoolFull]]:
    """Call ``delay()`` until the spool refuses; then a few more, which must be refused too."""
    accepted: list[str] = []
    refusals: list[SpoolFull] = []
    for _ in range(limit):
        try:
            accepted.append(noop.delay("x" * 2000).id)
        except SpoolFull as exc:
            refusals.append(exc)
            if len(refusals) == 5:
                break
    return accepted, refusals


def _room_for(noop: object) -> str | None:
    try:
        return str(noop.delay("after").id)  # type: ignore[attr-defined]
    except SpoolFull:
        return None


def _fill_then_drain(node: PrivateNode, spool_dir: Path, row: str, **options: object) -> None:
    """With the broker down, call until the spool refuses; then the broker takes everything accepted."""
    queue = unique_queue(row.lower())
    app, noop = _spooled_app(node.url, spool_dir, queue, **options)
    try:
        accepted, refusals = _fill(noop, 10_000)
        with pytest.raises(SpoolFull), app.batch() as batch:  # a batch is refused whole, at its end
            for _ in range(3):
                noop.delay("x" * 2000)
        refused_batch = [r.id for r in batch.results]
        assert all(isinstance(r.publish_error, SpoolFull) for r in batch.results)
        stats = app.spool_stats()
        node.rabbitmqctl("start_app")
        wait_for(lambda: _depth(app) == 0, timeout_s=120, message="the spool did not drain")
        # Room again once the broker took the rest and the spool reclaimed its files (not at once).
        after = wait_for(
            lambda: _room_for(noop), timeout_s=60, message="no room in the spool after the drain"
        )
        app.flush(timeout=60)
    finally:
        app.close(timeout=10)
    got = drain(node.url, queue)
    copies = collections.Counter(str(m.headers["id"]) for m in got)
    report(row, None, case="disk full (1 MiB tmpfs)" if row == "SP3" else "spool_max_bytes 500 kB",
           accepted=len(accepted), refused=len(refusals), error=str(refusals[0])[:90] if refusals else None,
           lost=len(set(accepted) - copies.keys()), duplicates=sum(n - 1 for n in copies.values()),
           write_error=stats.write_error if stats else None)  # fmt: skip
    assert len(refusals) == 5 and accepted
    assert all(("disk is full" if row == "SP3" else "spool_max_bytes") in str(e) for e in refusals)
    assert set(accepted) | {after} == copies.keys()  # nothing accepted lost, nothing refused sent
    assert not set(refused_batch) & copies.keys()
    assert all(n == 1 for n in copies.values())


def test_a_full_disk_raises_spool_full_and_keeps_everything_it_accepted(
    broker_down: PrivateNode, small_disk: Path
):
    _fill_then_drain(broker_down, small_disk / "spool", "SP3")


def test_a_full_spool_raises_spool_full_and_keeps_everything_it_accepted(
    broker_down: PrivateNode, tmp_path: Path
):
    _fill_then_drain(broker_down, tmp_path / "spool", "SP4", spool_max_bytes=500_000)


# -- SP5: a memory alarm --------------------------------------------------------------------------


def test_a_memory_alarm_blocks_the_drain_not_the_callers_and_everything_goes_out_after_it(
    node: PrivateNode, tmp_path: Path
):
    queue = unique_queue("alarm")
    app, noop = _spooled_app(node.url, tmp_path / "spool", queue, confirm_timeout_s=2.0)
    seconds: list[float] = []
    try:
        first = [noop.delay().id for _ in range(200)]
        app.flush(timeout=30)
        node.rabbitmqctl("set_vm_memory_high_watermark", "0.00001")
        wait_for(lambda: "memory" in _alarms(node), timeout_s=30, message="no memory alarm")
        during = []
        for _ in range(1_000):
            t0 = time.perf_counter()
            during.append(noop.delay().id)
            seconds.append(time.perf_counter() - t0)
        depth_in_alarm = _depth(app)
        node.rabbitmqctl("set_vm_memory_high_watermark", "0.4")
        wait_for(lambda: _depth(app) == 0, timeout_s=120, message="the spool did not drain after the alarm")
    finally:
        node.rabbitmqctl("set_vm_memory_high_watermark", "0.4")
        app.close(timeout=10)
    got = drain(node.url, queue)
    copies = collections.Counter(str(m.headers["id"]) for m in got)
    unmarked = collections.Counter(str(m.headers["id"]) for m in got if not m.headers.get(RESENT_HEADER))
    report(
        "SP5", None, accepted_in_alarm=len(during), spool_depth_in_alarm=depth_in_alarm,
        delay_p99_ms=round(1000 * _percentile(seconds, 0.99), 3), delay_max_ms=round(1000 * max(seconds), 1),
        lost=len(set(first + during) - copies.keys()), duplicates=sum(n - 1 for n in copies.values()),
    )  # fmt: skip
    assert set(first + during) == copies.keys()
    assert all(n <= 1 for n in unmarked.values())
    assert depth_in_alarm > 0 and max(seconds) < CALL_BOUND_S
