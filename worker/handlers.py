"""Control command handlers bound to one worker's state."""

from __future__ import annotations

import os
import resource
import time
from typing import Any
from urllib.parse import urlsplit

from broker_svc.app import App
from broker_svc.clock import LamportClock
from control.commands import CommandRegistry
from control.protocol import ok
from worker.config import WorkerConfig
from worker.consumer import TaskConsumer
from worker.pool import ProcessPool
from worker.revoked import RevokedSet

__all__ = ["build_registry"]

# Mingle replies carry at most this many revoked ids, so 100,000 revokes never make a 7 MB reply.
HELLO_REVOKED_LIMIT = 10_000


def build_registry(
    *,
    app: App,
    clock: LamportClock,
    nodename: str,
    revoked: RevokedSet,
    consumer: TaskConsumer,
    pool: ProcessPool,
    config: WorkerConfig,
) -> CommandRegistry:
    """The registry of the commands this worker answers today."""
    registry = CommandRegistry()
    started = time.monotonic()

    async def active(safe: bool) -> list[dict[str, Any]]:
        return consumer.active(safe=safe)

    async def stats() -> dict[str, Any]:
        url = urlsplit(config.settings.broker_url)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "total": consumer.totals,
            "pid": os.getpid(),
            "clock": str(clock.value),  # a string, as Celery sends it
            "uptime": int(time.monotonic() - started),
            "pool": {
                "implementation": "clockwork.worker.pool:ProcessPool",
                "max-concurrency": config.concurrency,
                "processes": pool.pids(),
                "max-tasks-per-child": None,
                "put-guarded-by-semaphore": False,
                "timeouts": [config.soft_time_limit_s, config.time_limit_s],
                "writes": {},
            },
            "broker": {
                "hostname": url.hostname,
                "userid": url.username,
                "virtual_host": config.settings.virtual_host,
                "port": url.port or (5671 if url.scheme == "amqps" else 5672),
                "insist": False,
                "ssl": url.scheme == "amqps",
                "transport": "amqp",
                "connect_timeout": config.settings.connect_timeout_s,
                "transport_options": {},
                "login_method": "PLAIN",
                "uri_prefix": None,
                "heartbeat": config.settings.heartbeat_s,
                "failover_strategy": "round-robin",
                "alternates": [],
            },  # fmt: skip
            "prefetch_count": config.prefetch_count,
            "rusage": {"utime": usage.ru_utime, "stime": usage.ru_stime, "maxrss": usage.ru_maxrss},
        }

    async def ping() -> dict[str, Any]:
        return ok("pong")

    async def clock_value() -> dict[str, Any]:
        return {"clock": clock.value}

    async def registered(taskinfoitems: list[Any] | None, builtins: bool) -> list[str]:
        return sorted(name for name in app.tasks if builtins or not name.startswith("celery."))

    async def revoked_ids() -> list[str]:
        return list(revoked)

    async def hello(from_node: str, revoked: dict[str, Any]) -> dict[str, Any] | None:
        if from_node == nodename:
            return None
        known.merge_wire(revoked)
        return {"revoked": known.to_wire(limit=HELLO_REVOKED_LIMIT), "clock": clock.forward()}

    known = revoked
    registry.register("active", active)
    registry.register("stats", stats)
    registry.register("ping", ping)
    registry.register("clock", clock_value)
    registry.register("registered", registered)
    registry.register("revoked", revoked_ids)
    registry.register("hello", hello)
    return registry
