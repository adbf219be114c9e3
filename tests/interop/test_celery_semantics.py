"""Countdown, expires, retries and timelimit headers mean the same on both sides of a mixed fleet."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from broker_svc import App, Settings, TaskRevokedError, TimeLimitExceeded
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop
T = "tests.integration.semantics_tasks."


def test_our_worker_honours_a_celery_clients_headers(test_vhost_url: str, celery_client):
    from celery.exceptions import TaskRevokedError as CeleryRevoked
    from celery.exceptions import TimeLimitExceeded

    queue = unique_queue("interop")
    try:
        with WorkerProcess(test_vhost_url, app=T.rstrip(".") + ":app", queues=[queue]) as worker:
            worker.wait_ready()
            sent = time.time()
            assert (
                celery_client.send_task(T + "now", queue=queue, countdown=2).get(timeout=30)["at"]
                >= sent + 1.9
            )
            past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
            revoked = celery_client.send_task(T + "now", queue=queue, expires=past)
            with pytest.raises(CeleryRevoked):
                revoked.get(timeout=30)
            assert (
                celery_client.send_task(T + "report_request", queue=queue, retries=2).get(timeout=30)[
                    "retries"
                ]
                == 2
            )
            limited = celery_client.send_task(T + "sleeper", args=(5,), queue=queue, time_limit=1)
            with pytest.raises(TimeLimitExceeded) as info:
                limited.get(timeout=30)
            assert repr(info.value) in ("TimeLimitExceeded(1.0)", "TimeLimitExceeded(1)")  # as from Celery
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_a_celery_worker_honours_our_clients_headers(test_vhost_url: str, start_celery_worker):
    queue = unique_queue("interop")
    app = App("ours", settings=Settings(broker_url=test_vhost_url))
    try:
        start_celery_worker(queue, pool="prefork")  # prefork: solo has no time limits
        sent = time.time()
        assert app.send_task("interop.now", queue=queue, countdown=2).get(timeout=30)["at"] >= sent + 1.9
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)
        with pytest.raises(TaskRevokedError):
            app.send_task("interop.now", queue=queue, expires=past).get(timeout=30)
        assert app.send_task("interop.now", queue=queue, retries=2).get(timeout=30)["retries"] == 2
        with pytest.raises(TimeLimitExceeded) as info:
            app.send_task("interop.sleep", (5,), queue=queue, time_limit=1).get(timeout=30)
        assert info.value.exc_type == "TimeLimitExceeded"
        assert info.value.args == (1.0,) or info.value.args == (1,)  # Celery's: the limit
        assert "hard time limit of 1" in str(info.value)
    finally:
        app.close()
        delete_queues(test_vhost_url, queue)


def test_a_prefetched_task_that_expires_behind_a_busy_child_is_revoked_expired(
    test_vhost_url: str, celery_client
):
    # Celery's client and ours: a task the worker holds (prefetched) while its only child is busy
    # expires there; the caller's get() learns REVOKED "expired" once a child is free, not a run.
    # (One the broker drops at its AMQP expiration, never delivered, is not answered yet.)
    prefetch = 4
    from celery.exceptions import TaskRevokedError as CeleryRevoked

    queue = unique_queue("interop")
    ours = App("ours", settings=Settings(broker_url=test_vhost_url))
    try:
        with WorkerProcess(
            test_vhost_url, app=T.rstrip(".") + ":app", queues=[queue], concurrency=1,
            extra_args=["--prefetch-multiplier", str(prefetch)],
        ) as worker:  # fmt: skip
            worker.wait_ready()
            busy = celery_client.send_task(T + "sleeper", (4,), queue=queue)
            theirs = celery_client.send_task(T + "now", queue=queue, expires=1)
            mine = ours.send_task(T + "now", queue=queue, expires=1)
            started = time.monotonic()
            with pytest.raises(CeleryRevoked, match="expired"):
                theirs.get(timeout=30)
            with pytest.raises(TaskRevokedError, match="expired"):
                mine.get(timeout=30)
            assert time.monotonic() - started < 8
            busy.get(timeout=30)
    finally:
        ours.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
