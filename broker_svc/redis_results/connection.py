"""The one module that opens redis-py clients; its errors become ``ResultBackendUnavailable``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

import redis

from broker_svc.errors import ResultBackendUnavailable
from broker_svc.logging import get_logger

__all__ = ["REDIS_ERRORS", "open_client", "with_retries"]

log = get_logger(__name__)

T = TypeVar("T")

# What a Redis call raises when the server is unreachable, busy or refuses the command.
REDIS_ERRORS: Final = (redis.RedisError, OSError)
# Pauses between attempts: a write waits about 3 s for Redis before its task is handed back.
_BACKOFF_S: Final = (0.1, 0.3, 0.6, 1.0, 1.0)
_SOCKET_TIMEOUT_S: Final = 5.0


def open_client(url: str) -> redis.Redis:
    """A client for ``url`` (``redis://[:password@]host[:port][/db]`` or ``rediss://``), as Celery
    parses it; it connects on first use."""
    return redis.Redis.from_url(
        url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )  # fmt: skip


def with_retries(call: Callable[[], T], *, what: str) -> T:
    """``call()``, again after a pause while Redis fails (about 3 s in all).

    Raises:
        ResultBackendUnavailable: every attempt failed (with the last error as its cause).
    """
    for pause_s in (*_BACKOFF_S, None):
        try:
            return call()
        except REDIS_ERRORS as exc:
            if pause_s is None:
                raise ResultBackendUnavailable(f"Redis result backend: {what} failed: {exc}") from exc
            log.warning("result_backend_retry", what=what, error=str(exc), retry_in_s=pause_s)
            time.sleep(pause_s)
    raise AssertionError("unreachable")  # pragma: no cover
