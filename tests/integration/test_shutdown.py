"""SIGTERM: running tasks finish, reserved ones go back to the broker, nothing is lost."""

from __future__ import annotations

import time

from broker_svc import App
from tests.support.amqp import queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

SLEEP = "tests.integration.e2e_tasks.sleep_s"


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
