"""What docs/deployment.md ("Workers") says a stop does to a task that is still running.

SIGTERM gives a running task ``--shutdown-timeout`` seconds; past it its child is killed and the
task, never acked, goes back to its queue and runs again. A second SIGTERM exits at once (status
1), and the running task goes back the same way. Either way nothing is lost.
"""

from __future__ import annotations

import signal
import time

import pytest

from broker_svc import App
from tests.support.amqp import queue_depth
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.timeout(120)

SLEEP = "tests.integration.e2e_tasks.sleep_s"


def _running(url: str, worker: WorkerProcess) -> bool:
    replies = call(url, "active", destination=[worker.name], expect=1)
    return bool(replies) and len(replies[0][1][worker.name]) == 1


def _stop_while_running(
    url: str, queue: str, client: App, *, args: list[str], signals: int
) -> tuple[int, float]:
    """Start a worker, run a 30 s task on it, send SIGTERM ``signals`` times: (exit status, seconds)."""
    worker = WorkerProcess(url, queues=[queue], concurrency=1, extra_args=args).wait_ready()
    try:
        client.send_task(SLEEP, (30.0, "long"), queue=queue)
        wait_for(lambda: _running(url, worker), timeout_s=30, message="the task did not start")
        started = time.monotonic()
        for _ in range(signals):
            worker.proc.send_signal(signal.SIGTERM)
            if signals > 1:
                worker.first("worker_stopping")  # the second signal comes during the warm stop
        status = worker.proc.wait(timeout=60)
        return status, time.monotonic() - started
    finally:
        worker.close()


def test_a_task_still_running_at_the_shutdown_timeout_is_killed_and_goes_back_to_its_queue(
    test_vhost_url: str, queue: str, client: App
):
    status, took_s = _stop_while_running(
        test_vhost_url, queue, client, args=["--shutdown-timeout", "1"], signals=1
    )
    assert status == 0
    assert took_s < 20  # the deadline, not the task's 30 s
    wait_for(lambda: queue_depth(test_vhost_url, queue) == 1, timeout_s=15, message="the task is back")


def test_a_second_sigterm_exits_at_once_with_status_1_and_the_task_goes_back(
    test_vhost_url: str, queue: str, client: App
):
    status, took_s = _stop_while_running(test_vhost_url, queue, client, args=[], signals=2)
    assert status == 1
    assert took_s < 20  # not the 30 s shutdown timeout, nor the task's 30 s
    wait_for(lambda: queue_depth(test_vhost_url, queue) == 1, timeout_s=15, message="the task is back")
