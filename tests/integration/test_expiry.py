"""A task that expires while it waits in its queue is answered REVOKED "expired", never dropped unseen."""

from __future__ import annotations

import time

import pytest

from broker_svc import App, Settings, TaskRevokedError
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

SLEEP = "tests.integration.e2e_tasks.sleep_s"
ADD = "tests.integration.e2e_tasks.add"


def test_a_task_expiring_behind_a_busy_worker_gets_a_revoked_answer(test_vhost_url: str):
    queue = unique_queue("expiry")
    client = App("expiry", settings=Settings(broker_url=test_vhost_url))
    try:
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready()
            busy = client.send_task(SLEEP, (3,), queue=queue)
            # The only child is busy for 3 s, and the prefetch is one: this one waits in the queue.
            expiring = client.send_task(ADD, (1, 2), queue=queue, expires=1)
            sent = time.monotonic()
            with pytest.raises(TaskRevokedError, match="expired"):
                expiring.get(timeout=20)
            # Answered once the busy child was free (about 3 s), not after the caller's timeout.
            assert time.monotonic() - sent < 10
            assert expiring.state == "REVOKED"
            assert busy.get(timeout=20) == ""
    finally:
        client.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
