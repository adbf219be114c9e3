"""Control command handlers bound to one worker's state."""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.topology import task_queue
from control.aio.node import request_headers
from control.protocol.commands import CommandRegistry
from control.protocol.request import nok, ok
from control.protocol.revoke_log import LOGGED_HEADER
from worker.config import WorkerConfig
from worker.consume.consumer import TaskConsumer
from worker.consume.rate_limits import RateLimits, parse_rate
from worker.events import EventDispatcher
from worker.pool.autoscale import Autoscaler, PoolSizer
from worker.pool.pool import ProcessPool
from worker.remote.mingle import HELLO_REVOKED_LIMIT
from worker.remote.revoker import Revoker

__all__ = ["ServiceControls", "build_registry", "queue_info", "register_pool_commands", "register_rate_limit"]

log = structlog.get_logger(__name__)


class ServiceControls(Protocol):
    """What the commands that change the worker itself need from the service."""

    async def add_consumer(self, queue: str) -> str:
        """Start consuming ``queue``; a message for the reply."""

    async def cancel_consumer(self, queue: str) -> str:
        """Stop consuming ``queue``; a message for the reply."""

    def consuming(self) -> list[str]:
        """The queues consumed now."""

    async def heartbeat(self) -> None:
        """Send a worker-heartbeat event now."""

    def request_stop(self) -> None:
        """Begin a graceful shutdown."""


def build_registry(
    *,
    app: App,
    clock: LamportClock,
    nodename: str,
    revoker: Revoker,
    consumer: TaskConsumer,
    pool: ProcessPool,
    config: WorkerConfig,
    events: EventDispatcher,
    controls: ServiceControls,
) -> CommandRegistry:
    """The registry of every command this worker answers, bound to its state."""
    registry = CommandRegistry()
    started = time.monotonic()

    async def active(safe: bool) -> list[dict[str, Any]]:
        return consumer.state.active(safe=safe)

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
                "max-concurrency": pool.target,  # follows pool_grow/pool_shrink and the autoscaler
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
        return list(revoker.revoked)

    async def hello(from_node: str, revoked: dict[str, Any] | list[Any]) -> dict[str, Any] | None:
        if from_node == nodename:
            return None
        revoker.merge_peer(revoked)
        return {"revoked": revoker.revoked.to_wire(limit=HELLO_REVOKED_LIMIT), "clock": clock.forward()}

    async def reserved() -> list[dict[str, Any]]:
        return consumer.state.reserved()

    async def scheduled() -> list[dict[str, Any]]:
        return consumer.state.scheduled()

    async def query_task(ids: str | list[str]) -> dict[str, Any]:
        return consumer.state.query([ids] if isinstance(ids, str) else [str(i) for i in ids])

    async def active_queues() -> list[dict[str, Any]]:
        return [queue_info(name) for name in controls.consuming()]

    async def conf(with_defaults: bool) -> dict[str, Any]:
        settings = config.settings
        return {
            "broker_url": settings.safe_broker_url,
            "task_serializer": settings.serializer,
            "accept_content": list(settings.accept_content),
            "task_default_queue": settings.default_queue,
            "worker_concurrency": config.concurrency,
            "worker_prefetch_multiplier": config.prefetch_multiplier,
            "task_time_limit": config.time_limit_s,
            "task_soft_time_limit": config.soft_time_limit_s,
            "worker_send_task_events": events.task_events,
            "result_persistent": settings.result_persistent,
        }

    async def revoke(task_id: str | list[str], terminate: bool, signal: str | int | None) -> dict[str, Any]:
        ids = [task_id] if isinstance(task_id, str) else [str(t) for t in task_id]
        log.info("revoke_received", task_ids=len(ids), first=ids[0] if ids else None, terminate=terminate)
        if not (request_headers.get() or {}).get(LOGGED_HEADER):
            # A revoke that did not come through our client (celery control revoke, Flower) is
            # journaled too, so workers that are down now still learn it.
            await revoker.journal(ids, terminate=terminate, signal_name=str(signal) if signal else None)
        return await revoker.revoke(ids, terminate=terminate, signal_name=signal)

    async def terminate(task_id: str | list[str], signal: str | int | None) -> dict[str, Any]:
        return await revoke(task_id, True, signal)

    async def time_limit(task_name: str, soft: float | None, hard: float | None) -> dict[str, Any]:
        if task_name not in app.tasks:
            return nok("unknown task")
        consumer.time_limits[task_name] = (hard, soft)
        return ok("time limits set successfully")

    async def add_consumer(
        queue: str, exchange: str | None, exchange_type: str, routing_key: str | None, options: Any
    ) -> dict[str, Any]:
        return ok(await controls.add_consumer(queue))

    async def cancel_consumer(queue: str) -> dict[str, Any]:
        return ok(await controls.cancel_consumer(queue))

    async def enable_events() -> dict[str, Any]:
        if events.task_events:
            return ok("task events already enabled")
        events.task_events = True
        return ok("task events enabled")

    async def disable_events() -> dict[str, Any]:
        if not events.task_events:
            return ok("task events already disabled")
        events.task_events = False
        return ok("task events disabled")

    async def heartbeat() -> None:
        await controls.heartbeat()

    async def shutdown(msg: str | None) -> None:
        log.warning("shutdown_requested", message=msg)
        controls.request_stop()

    registry.register("active", active)
    registry.register("stats", stats)
    registry.register("ping", ping)
    registry.register("clock", clock_value)
    registry.register("registered", registered)
    registry.register("revoked", revoked_ids)
    registry.register("hello", hello)
    registry.register("reserved", reserved)
    registry.register("scheduled", scheduled)
    registry.register("query_task", query_task)
    registry.register("active_queues", active_queues)
    registry.register("conf", conf)
    registry.register("revoke", revoke)
    registry.register("terminate", terminate)
    registry.register("time_limit", time_limit)
    registry.register("add_consumer", add_consumer)
    registry.register("cancel_consumer", cancel_consumer)
    registry.register("enable_events", enable_events)
    registry.register("disable_events", disable_events)
    registry.register("heartbeat", heartbeat)
    registry.register("shutdown", shutdown)
    return registry


def queue_info(name: str) -> dict[str, Any]:
    """A task queue as kombu's ``Queue.as_dict`` shows it (inspect ``active_queues``)."""
    spec = task_queue(name)
    exchange = spec.exchange
    assert exchange is not None
    return {
        "name": spec.name,
        "exchange": {
            "name": exchange.name, "type": exchange.type, "arguments": None, "durable": exchange.durable,
            "passive": False, "auto_delete": exchange.auto_delete, "delivery_mode": None,
            "no_declare": False,
        },
        "routing_key": spec.routing_key,
        "queue_arguments": spec.arguments or None,
        "binding_arguments": None,
        "consumer_arguments": None,
        "durable": spec.durable,
        "exclusive": spec.exclusive,
        "auto_delete": spec.auto_delete,
        "no_ack": False,
        "alias": None,
        "bindings": [],
        "no_declare": None,
        "expires": None,
        "message_ttl": None,
        "max_length": None,
        "max_length_bytes": None,
        "max_priority": None,
    }  # fmt: skip


def register_rate_limit(registry: CommandRegistry, *, app: App, limits: RateLimits) -> None:
    """Answer ``rate_limit`` (Celery's replies, WIRE.md §6.2) by changing ``limits``.

    As in Celery, a malformed rate is refused before the task name is looked up. The reply says
    "disabled" when the new rate means no limit (None, ``""``, 0, ``"0/m"``).
    """

    async def set_rate_limit(task_name: str, rate_limit: str | int | float | None) -> dict[str, Any]:
        try:
            per_second = parse_rate(rate_limit)
        except ValueError as exc:
            return nok(f"Invalid rate limit string: {exc!r}")
        if task_name not in app.tasks:
            log.warning("rate_limit_unknown_task", task_name=task_name)
            return nok("unknown task")
        # As Celery, rewrite the task's option too: it stays what this worker enforces.
        type(app.tasks[task_name]).rate_limit = rate_limit
        limits.set(task_name, per_second)
        if per_second is None:
            log.info("rate_limit_disabled", task_name=task_name)
            return ok("rate limit disabled successfully")
        log.info("rate_limit_set", task_name=task_name, rate_limit=rate_limit, per_second=per_second)
        return ok("new rate limit set successfully")

    registry.register("rate_limit", set_rate_limit)


# Celery's exact refusals (celery/worker/control.py).
_NOT_WITH_AUTOSCALE = "{} is not supported with autoscale. Adjust autoscale range instead."


def register_pool_commands(
    registry: CommandRegistry, *, pool: ProcessPool, sizer: PoolSizer, autoscaler: Autoscaler | None
) -> None:
    """Answer ``pool_grow``, ``pool_shrink`` and ``autoscale`` with Celery's replies (WIRE.md §6.2).

    Also wraps ``stats``: ``prefetch_count`` becomes the prefetch applied now, and with autoscale
    it gains Celery's ``autoscaler`` map (``max``, ``min``, ``current``, ``qty``). Errors read as
    Celery's (kombu replies ``repr(exc)`` for a handler's exception), e.g. ``autoscale`` on a worker
    without it gives ``{"error": "ValueError('Autoscale not enabled')"}``.
    """
    base_stats = registry.handler("stats")

    async def stats() -> dict[str, Any]:
        reply: dict[str, Any] = await base_stats()
        reply["prefetch_count"] = sizer.prefetch_count
        if autoscaler is not None:
            reply["autoscaler"] = autoscaler.info()
        return reply

    async def pool_grow(n: int) -> dict[str, Any]:
        if autoscaler is not None:
            return nok(_NOT_WITH_AUTOSCALE.format("pool_grow"))
        if n < 0:
            return nok(repr(ValueError(f"n must not be negative, got {n}")))
        size = await sizer.resize(sizer.size + n)
        log.info("pool_grow", n=n, size=size, prefetch=sizer.prefetch_count)
        return ok("pool will grow")

    async def pool_shrink(n: int) -> dict[str, Any]:
        if autoscaler is not None:
            return nok(_NOT_WITH_AUTOSCALE.format("pool_shrink"))
        if n < 0:
            return nok(repr(ValueError(f"n must not be negative, got {n}")))
        if n > 0 and sizer.size <= 1:
            return nok(repr(ValueError("Can't shrink the pool below one process")))
        size = await sizer.resize(max(sizer.size - n, 1))
        log.info("pool_shrink", n=n, size=size, prefetch=sizer.prefetch_count, busy=pool.busy_count)
        return ok("pool will shrink")

    async def autoscale(max: int | None, min: int | None) -> dict[str, Any]:  # Celery's argument names
        if autoscaler is None:
            return nok(repr(ValueError("Autoscale not enabled")))
        try:
            new_max, new_min = await autoscaler.update(max, min)
        except ValueError as exc:
            return nok(repr(exc))
        return ok(f"autoscale now max={new_max} min={new_min}")

    registry.register("stats", stats)
    registry.register("pool_grow", pool_grow)
    registry.register("pool_shrink", pool_shrink)
    registry.register("autoscale", autoscale)
