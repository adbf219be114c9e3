"""Fixtures of the reliability matrix: the 3-node cluster and a private single node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.infra.cluster import RabbitCluster, shared_cluster
from tests.infra.private_node import PrivateNode
from tests.infra.rabbitmq_tools import RabbitNodeError, ensure_rabbitmq_installed


@pytest.fixture(scope="session")
def cluster() -> Iterator[RabbitCluster]:
    """A 3-node RabbitMQ cluster of our own (never the shared broker), stopped at session end.

    Started once per session (shared with tests/infra_tests). Fails loudly, never skips, when it
    cannot start. Tests that inject faults use :func:`fault_cluster`, which repairs it afterwards.
    """
    try:
        with shared_cluster() as started:
            yield started
    except RabbitNodeError as exc:
        pytest.fail(f"the 3-node test cluster could not start: {exc}", pytrace=False)


@pytest.fixture
def fault_cluster(cluster: RabbitCluster) -> Iterator[RabbitCluster]:
    """The session cluster for one fault test; afterwards every fault is undone (3 running nodes)."""
    cluster.wait_healthy(timeout_s=120)
    yield cluster
    cluster.restore()


@pytest.fixture(scope="session")
def private_node() -> Iterator[PrivateNode]:
    """One plain private RabbitMQ node for the session (for tests that break or reconfigure a broker)."""
    ensure_rabbitmq_installed()
    try:
        with PrivateNode.started() as node:
            yield node
    except RabbitNodeError as exc:
        pytest.fail(f"the private RabbitMQ node could not start: {exc}", pytrace=False)
