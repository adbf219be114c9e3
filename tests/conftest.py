"""Session fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.infra.redis_server import RedisServer, private_redis_server
from tests.infra.session_broker import NoBrokerError, SessionBroker, open_session_broker

# ==== Broker (tests/infra does the work; keep this block small) ===========================

_BROKER_STATE_DIR = Path(__file__).resolve().parent.parent / ".broker"  # where `make` records a node


@pytest.fixture(scope="session")
def session_broker() -> Iterator[SessionBroker]:
    """The session's broker: ``$AMQP_URL``, else 127.0.0.1:5672, else Docker, else a private node.

    Fails the whole run with instructions (never skips) when none of them works.
    """
    with ExitStack() as stack:
        try:
            broker = open_session_broker(stack, state_dir=_BROKER_STATE_DIR)
        except NoBrokerError as exc:
            pytest.exit(str(exc), returncode=pytest.ExitCode.INTERRUPTED)
        yield broker


@pytest.fixture(scope="session")
def amqp_url(session_broker: SessionBroker) -> str:
    """AMQP URL of the session's broker, default vhost."""
    return session_broker.url


@pytest.fixture(scope="session")
def test_vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    """AMQP URL of a vhost created for this session and deleted at its end.

    Interop tests run real Celery, whose names are fixed (the ``celery`` queue, the
    ``celery.pidbox`` and ``celeryev`` exchanges), so unique names cannot isolate them; a vhost
    per session keeps parallel sessions and leftovers of a killed run apart, and ``delete_vhost``
    removes everything the session declared. Without a ``rabbitmqctl`` for the broker (a remote
    ``AMQP_URL``), this is ``amqp_url`` unchanged.
    """
    with session_broker.own_vhost("clockwork-test") as url:
        yield url


# ==== End of broker block ==================================================================


# ==== Redis (a private redis-server per run, started on first use) ========================


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private ``redis-server`` on a free loopback port for this run, stopped at its end.

    Never the machine's own Redis: tests of the Redis result backend write and flush freely.
    """
    with private_redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The private Redis's URL, its database flushed after the test."""
    import redis

    yield redis_server.url
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
