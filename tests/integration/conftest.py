from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_svc import App, Settings
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue


@pytest.fixture
def queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue()
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture
def client(test_vhost_url: str) -> Iterator[App]:
    app = App("client", settings=Settings(broker_url=test_vhost_url))
    yield app
    app.close(timeout=10)


@pytest.fixture
def worker(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as proc:
        yield proc.wait_ready()


@pytest.fixture
def vhost_url(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[str]:
    """A vhost of this test's own: the members stream keeps a minute of heartbeats, so workers of
    earlier tests (a killed one looks alive for 4 s) must not be seen here."""
    with session_broker.own_vhost("clockwork-ctl", fallback=test_vhost_url) as url:
        yield url
