"""kombu's JSON types from a real Celery client through our worker and back, as through a Celery worker."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

import pytest

from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

VALUES = [
    dt.datetime(2026, 11, 24, 20, 1, 2, 345678, tzinfo=dt.UTC),
    dt.date(2026, 11, 24),
    dt.time(20, 1, 2),
    decimal.Decimal("12345.678901234567890"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    b"plain bytes",
]


def test_json_types_round_trip_through_our_worker(test_vhost_url: str, celery_client):
    queue = unique_queue("json-types")
    try:
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready()
            result = celery_client.send_task("e2e.echo", (VALUES,), queue=queue, serializer="json")
            assert result.get(timeout=30) == VALUES
            as_kwargs = celery_client.send_task(
                "e2e.echo",
                kwargs={"value": {"when": VALUES[0], "id": VALUES[4]}},
                queue=queue,
                serializer="json",
            )
            assert as_kwargs.get(timeout=30) == {"when": VALUES[0], "id": VALUES[4]}
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
