"""The one module that opens redis-py clients; its errors become ``ResultBackendUnavailable``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, TypeVar

import redis

from broker_svc.errors import ResultBackendUnavailable
from broker_svc.logging import get_logger

__all__ = ["REDIS_ERRORS", "WRITE_BUDGET_S", "open_client", "with_retries"]

log = get_logger(__name__)

T = TypeVar("T")

# What a Redis call raises when the server is unreachable, busy or refuses the command.
REDIS_ERRORS: Final = (redis.RedisError, OSError)
# Pauses between attempts grow to this; a call is retried until its budget is spent.
_MAX_PAUSE_S: Final = 1.0
# Celery's Redis backend retries a write 20 times a second apart (its retry_policy): the same here.
WRITE_BUDGET_S: Final = 20.0
_SOCKET_TIMEOUT_S: Final = 5.0


def open_client(url: str) -> redis.Redis:
    """A client for ``url`` (``redis://[:password@]host[:port][/db]`` or ``rediss://``), as Celery
    parses it; it connects on first use."""
    return redis.Redis.from_url(
        url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )  # fmt: skip


def with_retries(call: Callable[[], T], *, what: str, within_s: float = WRITE_BUDGET_S) -> T:
    """``call()``, again after a growing pause while Redis fails, for about ``within_s`` seconds.

    Raises:
        ResultBackendUnavailable: every attempt failed (with the last error as its cause).
    """
    deadline = time.monotonic() + within_s
    pause_s = 0.1
    while True:
        try:
            return call()
        except REDIS_ERRORS as exc:
            if time.monotonic() + pause_s > deadline:
                raise ResultBackendUnavailable(f"Redis result backend: {what} failed: {exc}") from exc
            log.warning("result_backend_retry", what=what, error=str(exc), retry_in_s=pause_s)
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, _MAX_PAUSE_S)
