"""The private redis-server: its own loopback port (never 6379), restartable, gone after the run."""

from __future__ import annotations

import redis

from tests.infra.redis_server import RedisServer, private_redis_server


def test_the_session_redis_is_private_and_flushed_between_tests(
    redis_server: RedisServer, redis_url: str
) -> None:
    assert redis_server.port != 6379 and redis_url.startswith("redis://127.0.0.1:")
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping()
        assert client.dbsize() == 0  # the previous test's keys were flushed
        client.set("fixture-check", "1")
    finally:
        client.close()


def test_a_private_server_restarts_on_its_port_and_is_removed_on_exit() -> None:
    with private_redis_server() as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", "v")
            server.stop()
            server.start()
            assert client.ping() and client.get("k") is None  # nothing is saved across a restart
        finally:
            client.close()
        base_dir = server.base_dir
    assert server.proc.poll() is not None and not base_dir.exists()
