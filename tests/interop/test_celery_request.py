"""A real Celery client against our worker: retry with new arguments, custom headers in the request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

TASKS = "tests.integration.proj.tasks"


@pytest.fixture(scope="module")
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("request")
    env = {"PROJ_BROKER_URL": test_vhost_url, "PROJ_QUEUE": name}
    with WorkerProcess(
        test_vhost_url, app="tests.integration.proj.celery:app", queues=[name], env=env
    ) as worker:
        worker.wait_ready()
        yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


def test_retry_with_new_arguments(celery_client, queue: str):
    assert celery_client.send_task(f"{TASKS}.grow", (3,), queue=queue).get(timeout=30) == [300, 2]


def test_custom_headers_reach_the_task(celery_client, queue: str):
    # The proj app accepts json only (its conf), as many Celery apps do.
    result = celery_client.send_task(f"{TASKS}.headers_seen", queue=queue, headers={"tenant": "acme"})
    assert result.get(timeout=30) == {"headers": {"tenant": "acme"}, "tenant": "acme"}
