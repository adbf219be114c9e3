"""``-b``: the worker's broker, for what it consumes and for what its tasks send.

The worker is given one vhost by ``-b`` and another by ``CLOCKWORK_BROKER_URL``, which its app
(which names no broker) would take otherwise: ``-b`` must win in the worker and in its children,
whose tasks send tasks of their own (docs/guide.md, "The worker": which broker a worker uses).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_svc import App, Settings
from broker_svc.settings import redact_url
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import delete_queues, queue_exists
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def other_vhost(session_broker: SessionBroker) -> Iterator[str]:
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to make a second vhost)")
    with session_broker.own_vhost("clockwork-not-b") as url:
        yield url


def test_dash_b_wins_over_the_environment_for_the_worker_and_for_what_its_tasks_send(
    test_vhost_url: str, other_vhost: str
):
    queue = unique_queue("dash-b")
    env = {"CLOCKWORK_BROKER_URL": other_vhost}  # what the app would take without -b
    try:
        with WorkerProcess(
            test_vhost_url, app="tests.integration.canvas_tasks:app", queues=[queue], concurrency=1, env=env
        ) as worker:
            assert worker.wait_ready().first("worker_ready")["broker"] == redact_url(test_vhost_url)
            client = App("dash-b-client", settings=Settings(broker_url=test_vhost_url))
            try:
                # canvas.spawn sends two adds from its body, through the child's app.
                spawned = client.send_task("canvas.spawn", (2, queue), queue=queue).get(timeout=30)
            finally:
                client.close(timeout=10)

            def ran() -> bool:
                done = {e.get("task_id") for e in worker.events() if e.get("event") == "task_succeeded"}
                return set(spawned) <= done

            wait_for(
                ran, timeout_s=30, message=f"the tasks the task sent ran here:\n{worker.log_text()[-3000:]}"
            )
        assert not queue_exists(other_vhost, queue)  # nothing went to the environment's broker
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
