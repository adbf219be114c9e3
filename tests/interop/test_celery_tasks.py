"""Real Celery 5 on both sides of our task path: Celery client → our worker, our client → Celery worker."""

from __future__ import annotations

import pytest

from broker_svc import App, Settings
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop
ADD = "tests.integration.e2e_tasks.add"


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_a_celery_client_runs_tasks_on_our_worker_and_gets_rpc_results(
    test_vhost_url: str, celery_client, serializer: str
):
    queue = unique_queue("interop")
    try:
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready()
            result = celery_client.send_task(ADD, args=(2, 3), queue=queue, serializer=serializer)
            assert result.get(timeout=30) == 5
            failing = celery_client.send_task("tests.integration.e2e_tasks.boom", args=("x",), queue=queue,
                                              serializer=serializer)  # fmt: skip
            with pytest.raises(ValueError, match="x"):
                failing.get(timeout=30)
            assert failing.state == "FAILURE"
            assert "PRECONDITION_FAILED" not in worker.log_text()
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_our_client_runs_tasks_on_a_real_celery_worker(
    test_vhost_url: str, start_celery_worker, serializer: str
):
    queue = unique_queue("interop")
    app = App("ours", settings=Settings(broker_url=test_vhost_url, serializer=serializer))
    try:
        start_celery_worker(queue)
        assert app.send_task("interop.mul", (6, 7), queue=queue).get(timeout=30) == 42
        failing = app.send_task("interop.fail", ("nope",), queue=queue)
        with pytest.raises(KeyError):
            failing.get(timeout=30)
        assert failing.state == "FAILURE"
    finally:
        app.close()
        delete_queues(test_vhost_url, queue)


def test_both_sides_declare_the_default_celery_queue_identically(
    test_vhost_url: str, celery_client, start_celery_worker
):
    # Our worker declares `celery`, then a Celery client and a Celery worker redeclare it: a
    # difference in any flag or argument would be a 406 PRECONDITION_FAILED on their side.
    with WorkerProcess(test_vhost_url, queues=["celery"], concurrency=1) as worker:
        worker.wait_ready()
        assert celery_client.send_task(ADD, args=(1, 1)).get(timeout=30) == 2
    start_celery_worker("celery")
    app = App("ours", settings=Settings(broker_url=test_vhost_url))
    try:
        assert app.send_task("interop.mul", (3, 3)).get(timeout=30) == 9
    finally:
        app.close()
        delete_queues(test_vhost_url, "celery", "celery.dead")
