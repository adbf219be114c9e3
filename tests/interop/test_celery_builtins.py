"""A real Celery client's map, starmap and chunks on our worker give what a Celery worker gives."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery.canvas import chunks, xmap, xstarmap

from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def ours(test_vhost_url: str) -> Iterator[str]:
    queue = unique_queue("builtins")
    with WorkerProcess(test_vhost_url, app="tests.integration.canvas_tasks:app", queues=[queue]) as worker:
        worker.wait_ready()
        yield queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def _results(client, queue: str) -> dict[str, object]:
    add = client.signature("canvas.add", queue=queue)
    xsum = client.signature("canvas.xsum", queue=queue)
    return {
        "map": xmap(xsum, [[1, 2], [3, 4, 5]]).apply_async(queue=queue).get(timeout=30),
        "starmap": xstarmap(add, [(1, 2), (3, 4)]).apply_async(queue=queue).get(timeout=30),
        "chunks": chunks(add, [(i, i) for i in range(5)], 2).apply_async(queue=queue).get(timeout=30),
    }


EXPECTED = {"map": [3, 12], "starmap": [3, 7], "chunks": [[0, 2], [4, 6], [8]]}


def test_builtins_on_our_worker(celery_client, ours: str):
    assert _results(celery_client, ours) == EXPECTED


def test_an_unknown_task_in_a_builtin_fails_clearly(celery_client, ours: str):
    unknown = celery_client.signature("canvas.nope", queue=ours)
    with pytest.raises(Exception, match="canvas.nope") as raised:
        xmap(unknown, [1]).apply_async(queue=ours).get(timeout=30)
    assert type(raised.value).__name__ == "NotRegistered"


def test_the_same_on_a_celery_worker(celery_client, start_celery_worker, test_vhost_url: str):
    queue = unique_queue("celery-builtins")
    start_celery_worker(queue)
    try:
        assert _results(celery_client, queue) == EXPECTED
    finally:
        delete_queues(test_vhost_url, queue)
