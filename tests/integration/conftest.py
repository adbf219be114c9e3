from __future__ import annotations

import secrets
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import App, Settings
from tests.amqp import delete_queues
from tests.infra.broker_probe import url_with_vhost
from tests.infra.session_broker import SessionBroker
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


@pytest.fixture
def vhost_url(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[str]:
    """A vhost of this test's own: the members stream keeps a minute of heartbeats, so workers of
    earlier tests (a killed one looks alive for 4 s) must not be seen here."""
    ctl = session_broker.rabbitmqctl
    if ctl is None:  # a remote broker we cannot administer: share the session's vhost
        yield test_vhost_url
        return
    vhost = f"clockwork-ctl-{secrets.token_hex(5)}"
    user = unquote(urlsplit(session_broker.url).username or "guest")
    ctl("add_vhost", vhost)
    try:
        ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        yield url_with_vhost(session_broker.url, vhost)
    finally:
        ctl("delete_vhost", vhost)
