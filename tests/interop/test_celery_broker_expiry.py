"""A Celery client's task that expires in its queue (RabbitMQ drops it at its AMQP TTL) is answered.

Celery sets the AMQP ``expiration`` of a task sent with ``expires``: RabbitMQ drops it if it is
still queued then, unseen by any worker, and the caller's ``get()`` would wait for nothing. With
the policy of docs/guide.md ("Expiry") the broker dead-letters it into ``clockwork.expired``, which
every worker consumes: the caller gets REVOKED "expired", as Celery reports an expired task.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from celery import Celery
from celery import exceptions as celery_exceptions

from tests.infra.session_broker import SessionBroker
from tests.interop.conftest import close_celery_client
from tests.support.amqp import drain
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

POLICY = {"dead-letter-exchange": "", "dead-letter-routing-key": "clockwork.expired"}


@pytest.fixture(scope="module")
def vhost(session_broker: SessionBroker) -> Iterator[str]:
    ctl = session_broker.rabbitmqctl
    if ctl is None:
        pytest.fail("these tests set a policy, which needs rabbitmqctl for the broker")
    with session_broker.own_vhost("clockwork-expiry") as url:
        name = url.rsplit("/", 1)[1]
        ctl(
            "set_policy",
            "-p",
            name,
            "clockwork-expired",
            "^expiry-",
            json.dumps(POLICY),
            "--apply-to",
            "queues",
        )
        ctl(
            "set_policy", "-p", name, "clockwork-short", "^short-",
            json.dumps({**POLICY, "max-length": 1}), "--apply-to", "queues",
        )  # fmt: skip
        # A worker that consumes none of the task queues below: only clockwork.expired reaches it.
        with WorkerProcess(url, queues=[unique_queue("idle")], concurrency=1) as worker:
            worker.wait_ready()
            yield url


@pytest.fixture
def client(vhost: str) -> Iterator[Celery]:
    app = Celery("interop-expiry", broker=vhost, backend="rpc://")
    app.conf.update(accept_content=["json"], result_accept_content=["json"])
    yield app
    close_celery_client(app)


def test_a_task_that_expires_in_its_queue_is_answered_revoked(client: Celery):
    queue = unique_queue("expiry")
    result = client.send_task("tests.integration.e2e_tasks.add", (1, 2), queue=queue, expires=1)
    with pytest.raises(celery_exceptions.TaskRevokedError, match="expired"):
        result.get(timeout=30)


def test_a_task_the_broker_drops_for_another_reason_fails_and_is_kept(client: Celery, vhost: str):
    queue = unique_queue("short")  # max-length 1: the older of two queued tasks is dropped
    first = client.send_task("tests.integration.e2e_tasks.add", (1, 1), queue=queue)
    client.send_task("tests.integration.e2e_tasks.add", (2, 2), queue=queue)
    with pytest.raises(RuntimeError, match="maxlen"):
        first.get(timeout=30)
    kept = wait_for(lambda: drain(vhost, "clockwork.expired.dead"), timeout_s=10, message="not kept")
    assert [m.headers["x-clockwork-reason"] for m in kept] == ["broker_maxlen"]
