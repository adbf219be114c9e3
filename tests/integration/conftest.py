from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_svc import App, Settings
from tests.amqp import delete_queues
from tests.workers import WorkerProcess, unique_queue


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
