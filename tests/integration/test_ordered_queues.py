"""Ordered queues (x-single-active-consumer) on real workers: one task at a time, in publish order,
with failover to the next worker; each task journals its start and end (tests/support/order_journal.py).

One set of workers for the module's failover story (SIGKILL, then SIGTERM), each step checked by
``check_order``, which fails on a misordered journal (tests/unit/test_order_journal.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings
from broker_svc.tasks.task import Signature
from tests.support.amqp import channel, delete_queues, queue_depth
from tests.support.order_journal import OrderVerdict, check_order, read_journal
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.integration.ordered_tasks:app"
STEP = "ordered.step"


@pytest.fixture
def ordered(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("ordered")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


def _worker(url: str, queue: str, *extra: str, quorum: bool = False) -> WorkerProcess:
    if quorum:
        extra = (*extra, "--quorum-queues", queue)
    return WorkerProcess(
        url, app=APP, queues=[queue], concurrency=2, extra_args=["--ordered-queues", queue, *extra]
    )


def _publish(
    url: str, queue: str, journal: Path, count: int, *, seconds: float, quorum: bool = False
) -> None:
    # The client declares the queue ordered too (a plain declaration would be a 406).
    settings = Settings(broker_url=url, ordered_queues=(queue,), quorum_queues=(queue,) if quorum else ())
    with App("ordered-client", settings=settings) as app:
        app.send_many(
            Signature(
                STEP, args=(seq, str(journal), seconds), options={"queue": queue, "ignore_result": True}
            )
            for seq in range(count)
        )
        app.flush(timeout=60)


def _ends(journal: Path) -> int:
    return len({line["seq"] for line in read_journal(journal) if line["phase"] == "end"})


def _wait_done(journal: Path, count: int, timeout_s: float) -> None:
    wait_for(
        lambda: _ends(journal) >= count,
        timeout_s=timeout_s,
        message=f"{count} tasks not done: {_ends(journal)}",
    )


def _say(what: str, verdict: OrderVerdict) -> None:
    print(f"{what}: {verdict}")


def test_workers_share_an_ordered_queue_one_task_at_a_time_with_failover(
    test_vhost_url: str, ordered: str, tmp_path: Path
):
    # A quorum queue (as recommended): there a cancelled consumer's unacked task does not hold back
    # the next consumer, which is what the SIGTERM hand-over must avoid (classic queues wait).
    url = test_vhost_url
    with _worker(url, ordered, quorum=True) as first, _worker(url, ordered, quorum=True) as second:
        first.wait_ready()
        second.wait_ready()
        workers = {first.name: first, second.name: second}

        # 300 tasks, 4 consumers (2 children in each of 2 workers): one runs them all, in order.
        journal = tmp_path / "steady.jsonl"
        _publish(url, ordered, journal, 300, seconds=0.0, quorum=True)
        _wait_done(journal, 300, timeout_s=60)
        verdict = check_order(read_journal(journal), expected=300)
        _say("steady", verdict)
        assert verdict.ok, verdict
        assert verdict.repeats_marked == 0 and len(verdict.nodes) == 1, verdict

        # SIGKILL the active worker (its whole process tree) mid-run: the other takes over.
        journal = tmp_path / "killed.jsonl"
        _publish(url, ordered, journal, 300, seconds=0.01, quorum=True)
        wait_for(lambda: _ends(journal) >= 100, timeout_s=60, message="100 tasks not done before the kill")
        active = read_journal(journal)[-1]["node"]
        standby = next(name for name in workers if name != active)
        workers[active].signal_tree(signal.SIGKILL)
        killed_at = time.time()
        workers[active].proc.wait(timeout=30)
        _wait_done(journal, 300, timeout_s=60)
        lines = read_journal(journal)
        verdict = check_order(lines, expected=300, killed=[active])
        takeover_s = next(line["at"] for line in lines if line["node"] == standby) - killed_at
        _say(f"sigkill (failover {takeover_s:.2f} s)", verdict)
        assert verdict.ok, verdict
        assert verdict.nodes == [active, standby], verdict
        assert verdict.repeats_marked <= 1, verdict  # the one task the killed worker held, marked
        assert workers[standby].count("ordered_redelivery") == 1

        # SIGTERM hand-over from the survivor to a fresh worker: no duplicate, order kept.
        with _worker(url, ordered, quorum=True) as third:
            third.wait_ready()
            journal = tmp_path / "handover.jsonl"
            _publish(url, ordered, journal, 200, seconds=0.01, quorum=True)
            wait_for(lambda: _ends(journal) >= 60, timeout_s=60, message="60 tasks not done before SIGTERM")
            assert workers[standby].terminate(timeout_s=60) == 0
            _wait_done(journal, 200, timeout_s=60)
            verdict = check_order(read_journal(journal), expected=200)
            _say("sigterm", verdict)
            assert verdict.ok, verdict
            assert verdict.nodes == [standby, third.name], verdict
            assert verdict.repeats_marked == 0 and verdict.repeats_unmarked == 0, verdict


def test_threads_and_a_prefetch_multiplier_still_hold_one_ordered_task(
    test_vhost_url: str, ordered: str, tmp_path: Path
):
    # With a prefetch of 4 the killed consumer would hold 4 tasks, all redelivered (and marked):
    # one marked redelivery after the kill shows the ordered consumer's prefetch is 1.
    url, extra = test_vhost_url, ("--threads", "2", "--prefetch-multiplier", "4")
    with _worker(url, ordered, *extra) as first, _worker(url, ordered, *extra) as second:
        first.wait_ready()
        second.wait_ready()
        workers = {first.name: first, second.name: second}
        journal = tmp_path / "threads.jsonl"
        _publish(url, ordered, journal, 200, seconds=0.01)
        wait_for(lambda: _ends(journal) >= 50, timeout_s=60, message="50 tasks not done before the kill")
        active = read_journal(journal)[-1]["node"]
        standby = next(name for name in workers if name != active)
        workers[active].signal_tree(signal.SIGKILL)
        workers[active].proc.wait(timeout=30)
        _wait_done(journal, 200, timeout_s=60)
        redelivered = workers[standby].count("ordered_redelivery")
    verdict = check_order(read_journal(journal), expected=200, killed=[active])
    _say("threads sigkill", verdict)
    assert verdict.ok and verdict.nodes == [active, standby], verdict
    assert redelivered == 1


def test_declaring_an_existing_plain_queue_ordered_is_a_clear_error_and_nothing_is_consumed(
    test_vhost_url: str, ordered: str, tmp_path: Path
):
    with channel(test_vhost_url) as ch:  # as a client that does not know the queue is ordered
        ch.queue_declare(ordered, durable=True)
        ch.basic_publish("", ordered, b"not for an unordered consumer")
    worker = _worker(test_vhost_url, ordered)
    with worker:
        status = wait_for(worker.proc.poll, timeout_s=60, message="the worker did not exit")
        text = worker.log_text()
    assert status == 2, text
    assert "exists with other arguments" in text and "x-single-active-consumer" in text, text
    assert queue_depth(test_vhost_url, ordered) == 1
