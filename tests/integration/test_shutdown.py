"""SIGTERM: running tasks finish, reserved ones go back to the broker, nothing is lost."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from broker_svc import App, Settings
from control import ControlClient
from tests.infra.session_broker import SessionBroker
from tests.integration import dedup_tasks
from tests.support.amqp import queue_depth, queue_exists
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

SLEEP = "tests.integration.e2e_tasks.sleep_s"
COUNTED = dedup_tasks.refresh_counted.name


def test_sigterm_with_tasks_running_loses_none(test_vhost_url: str, queue: str, client: App):
    # Multiplier 2, so the worker holds reserved tasks (the default 1 holds none) to hand back;
    # consuming children hand back theirs as R3 shows (tests/reliability).
    first = WorkerProcess(
        test_vhost_url, queues=[queue], concurrency=2,
        extra_args=["--prefetch-multiplier", "2"],
    ).wait_ready()  # fmt: skip
    try:
        results = [client.send_task(SLEEP, (0.5, str(i)), queue=queue) for i in range(20)]
        client.flush(timeout=10)
        wait_for(lambda: sum(r.ready() for r in results) >= 2, timeout_s=30, message="nothing ran")
        started = time.monotonic()
        assert first.terminate(timeout_s=40) == 0
        assert time.monotonic() - started < 10  # running tasks (0.5 s) finish; nothing waits for the rest
        # Whatever the first worker did not finish is back in the queue, held by nobody.
        wait_for(
            lambda: sum(r.ready() for r in results) + queue_depth(test_vhost_url, queue) == 20,
            timeout_s=15,
            message="tasks are neither done nor back in the queue",
        )
        assert sum(r.ready() for r in results) < 20
        assert first.count("task_requeued_on_shutdown") >= 1
    finally:
        first.close()
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as second:
        second.wait_ready()
        assert sorted(r.get(timeout=60) for r in results) == sorted(str(i) for i in range(20))


def test_ctrl_c_with_two_tasks_running_says_how_many_and_that_a_second_ctrl_c_stops_now(
    test_vhost_url: str, queue: str, client: App
):
    worker = WorkerProcess(test_vhost_url, queues=[queue], concurrency=2).wait_ready()
    try:
        results = [client.send_task(SLEEP, (3.0, str(i)), queue=queue) for i in range(2)]
        client.flush(timeout=10)
        with ControlClient(Settings(broker_url=test_vhost_url)) as control:

            def both_running() -> bool:
                replies = control.inspect("active", destination=[worker.name], timeout_s=5)
                return len(replies.get(worker.name) or []) == 2

            wait_for(both_running, timeout_s=30, message="the two tasks did not start")
        worker.signal_tree(signal.SIGINT)  # Ctrl-C on a terminal reaches the whole process group
        stopping = worker.first("worker_stopping")
        assert stopping["in_flight"] == 2
        assert "Ctrl-C again" in stopping["hint"]
        assert worker.proc.wait(timeout=30) == 0
        assert [r.get(timeout=10) for r in results] == ["0", "1"]  # the warm stop let them finish
    finally:
        worker.close()


def _runs_started(journal: Path) -> int:
    if not journal.exists():
        return 0
    return sum(json.loads(line)["event"] == "start" for line in journal.read_text().splitlines())


@pytest.mark.parametrize(("queue_type", "threads"), [("classic", 1), ("quorum", 1), ("classic", 2)])
def test_tasks_handed_back_at_shutdown_never_count_against_the_delivery_limit(
    test_vhost_url: str, queue: str, tmp_path: Path, queue_type: str, threads: int
):
    # A rolling deploy: three workers in a row each start one task and stop, handing back the
    # rest of what they hold. At a delivery limit of 1, a hand-back that counted (a nack: the
    # redelivered flag, a quorum queue's x-delivery-count) would dead-letter the tasks it held
    # twice before they ever ran.
    quorum = (queue,) if queue_type == "quorum" else ()
    options = ["--delivery-limit", "1", *(["--quorum-queues", queue] if quorum else [])]
    client = App("deploys", settings=Settings(broker_url=test_vhost_url, quorum_queues=quorum))
    journal = tmp_path / "runs.jsonl"

    def dead_letters() -> int:
        dead = f"{queue}.dead"
        return queue_depth(test_vhost_url, dead) if queue_exists(test_vhost_url, dead) else 0

    try:
        count = 8 * threads  # each stop runs one a thread: the third still holds some
        args = (str(journal), "k", 0.3)
        results = [client.send_task(COUNTED, args, queue=queue) for _ in range(count)]
        client.flush(timeout=10)
        for stop in range(3):
            started = _runs_started(journal)
            worker = WorkerProcess(
                test_vhost_url, app="tests.integration.dedup_tasks:app", queues=[queue], concurrency=1,
                extra_args=["--prefetch-multiplier", "4", "--threads", str(threads), *options],
            ).wait_ready()  # fmt: skip
            try:
                wait_for(
                    lambda: _runs_started(journal) > started or dead_letters() > 0,  # noqa: B023
                    timeout_s=30,
                    message="no task started",
                )
                assert dead_letters() == 0, f"stop {stop}: dead-lettered, their hand-backs counted"
                assert worker.terminate(timeout_s=30) == 0
                assert worker.count("task_requeued_on_shutdown") >= 1, f"stop {stop}: it held nothing"
                assert worker.count("task_hand_back_failed") == 0
            finally:
                worker.close()
        with WorkerProcess(
            test_vhost_url, app="tests.integration.dedup_tasks:app", queues=[queue], concurrency=1,
            extra_args=options,
        ) as last:  # fmt: skip
            last.wait_ready()
            outcomes = [result.get(timeout=60) for result in results]
        assert sorted(outcome["id"] for outcome in outcomes) == sorted(result.id for result in results)
        assert [outcome["delivery_count"] for outcome in outcomes] == [0] * count
        assert dead_letters() == 0
    finally:
        client.close(timeout=10)


def test_copies_the_full_queue_refuses_go_back_as_they_came(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App
):
    # A queue at its length limit refuses what is published to it (overflow reject-publish), the
    # copies of a hand-back too: the originals then go back as a nack would send them (counted),
    # never left unacked on a live connection, out of every consumer's reach.
    ctl = session_broker.rabbitmqctl
    if ctl is None:
        pytest.fail("this test sets a policy, which needs rabbitmqctl for the broker")
    vhost = test_vhost_url.rsplit("/", 1)[1]
    policy = {"max-length": 2, "overflow": "reject-publish"}
    ctl("set_policy", "-p", vhost, queue, f"^{queue}$", json.dumps(policy), "--apply-to", "queues")
    limited = True
    try:
        first = WorkerProcess(
            test_vhost_url, queues=[queue], concurrency=1, extra_args=["--prefetch-multiplier", "8"]
        ).wait_ready()
        try:
            # One at a time, each taken by the child before the next: the queue stays short. The
            # first runs until the stop; the child holds the other seven behind it.
            held = []
            for i in range(8):
                held.append(client.send_task(SLEEP, (5.0 if i == 0 else 0.0, f"held{i}"), queue=queue))
                client.flush(timeout=10)
                wait_for(lambda: queue_depth(test_vhost_url, queue) == 0, timeout_s=10, message="not taken")
            full = [client.send_task(SLEEP, (0.0, f"ready{i}"), queue=queue) for i in range(2)]
            client.flush(timeout=10)  # the child holds 8: these two wait, and the queue is full
            assert queue_depth(test_vhost_url, queue) == 2
            assert first.terminate(timeout_s=30) == 0
            assert first.count("task_hand_back_failed") >= 1
            assert first.count("task_requeued_on_shutdown") >= 1
        finally:
            first.close()
        # Everything the first worker did not run is in the queue, though the copies were refused
        # (a copy confirmed before the refusal of another leaves its original there too).
        assert queue_depth(test_vhost_url, queue) >= 9
        ctl("clear_policy", "-p", vhost, queue)
        limited = False
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as second:
            second.wait_ready()
            done = sorted(result.get(timeout=60) for result in [*held, *full])
        assert done == sorted([*(f"held{i}" for i in range(8)), "ready0", "ready1"])
    finally:
        if limited:
            ctl("clear_policy", "-p", vhost, queue)
