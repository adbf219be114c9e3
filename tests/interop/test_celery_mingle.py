"""Mingle with real Celery workers, both ways: LimitedSet data and clocks cross in Celery's shapes."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable

from tests.interop.conftest import celery_node_name
from tests.support.pidbox import call
from tests.support.workers import WorkerProcess, unique_queue


def test_our_new_worker_learns_from_a_celery_worker(
    test_vhost_url: str, start_celery_worker: Callable[..., subprocess.Popen[bytes]]
):
    celery_queue, our_queue = unique_queue("cm"), unique_queue("om")
    start_celery_worker(celery_queue, social=True)
    celery_node = celery_node_name(celery_queue)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    replies = call(test_vhost_url, "revoke", arguments={"task_id": ids}, destination=[celery_node], expect=1)
    assert "flagged as revoked" in replies[0][1][celery_node]["ok"]
    call(test_vhost_url, "ping", destination=[celery_node], clock=600_000, expect=1)
    with WorkerProcess(test_vhost_url, queues=[our_queue], concurrency=1) as worker:
        worker.wait_ready()
        mingled = worker.first("mingle_done")
        assert celery_node in mingled["nodes"], mingled
        revoked = call(test_vhost_url, "revoked", destination=[worker.name], expect=1)[0][1][worker.name]
        assert set(ids) <= set(revoked)
        clock = call(test_vhost_url, "clock", destination=[worker.name], expect=1)[0][1][worker.name]["clock"]
        assert clock > 600_000


def test_a_new_celery_worker_learns_from_ours(
    test_vhost_url: str, start_celery_worker: Callable[..., subprocess.Popen[bytes]]
):
    celery_queue, our_queue = unique_queue("cm"), unique_queue("om")
    ids = [str(uuid.uuid4()) for _ in range(3)]
    with WorkerProcess(test_vhost_url, queues=[our_queue], concurrency=1) as worker:
        worker.wait_ready()
        call(test_vhost_url, "revoke", arguments={"task_id": ids}, destination=[worker.name], expect=1)
        start_celery_worker(celery_queue, social=True)
        celery_node = celery_node_name(celery_queue)
        revoked = call(test_vhost_url, "revoked", destination=[celery_node], expect=1)[0][1][celery_node]
        assert set(ids) <= set(revoked)
        # Celery's gossip read our worker events without complaint, and our hello reply synced.
        assert worker.proc.poll() is None
