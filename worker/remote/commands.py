"""Control command handlers bound to one worker's state: one ``WorkerCommands`` method per command."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import structlog

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.topology import task_queue
from broker_svc.wire.task.stamps import revoke_headers
from control.aio.node import request_headers
from control.protocol.commands import CommandRegistry
from control.protocol.request import nok, ok
from control.protocol.revoke_log import LOGGED_HEADER
from worker.amqp.task_queues import TaskQueues
from worker.config import WorkerConfig
from worker.events import EventDispatcher, Heart
from worker.pool.autoscale import Autoscaler, PoolSizer
from worker.pool.pool import ProcessPool
from worker.pool.state import WorkerState
from worker.remote.bug_report import bug_report
from worker.remote.conf_table import conf_table
from worker.remote.mingle import HELLO_REVOKED_LIMIT
from worker.remote.revocation_log import RevocationLog
from worker.remote.revoker import Revoker
from worker.rules.rate_limits import parse_rate

if TYPE_CHECKING:
    from worker.single_active.gatekeeper import Gatekeeper

__all__ = ["COMMAND_NAMES", "DEFAULT_TASK_INFO_ITEMS", "WorkerCommands", "queue_info", "task_info"]

log = structlog.get_logger(__name__)

# Every command a worker answers; each is the name of a WorkerCommands method.
COMMAND_NAMES: Final = (
    "active", "stats", "ping", "clock", "registered", "revoked", "hello", "reserved", "scheduled",
    "query_task", "active_queues", "conf", "revoke", "revoke_by_stamped_headers", "terminate", "time_limit",
    "rate_limit",
    "add_consumer", "cancel_consumer", "enable_events", "disable_events", "heartbeat", "shutdown",
    "pool_grow", "pool_shrink", "autoscale", "dedup", "report",
)  # fmt: skip

# Celery's task-info items when ``registered`` is given none (celery/worker/control.py).
DEFAULT_TASK_INFO_ITEMS: Final = ("exchange", "routing_key", "rate_limit")

# Celery's exact refusals (celery/worker/control.py).
_NOT_WITH_AUTOSCALE = "{} is not supported with autoscale. Adjust autoscale range instead."


class WorkerCommands:
    """One worker's control commands, each a method named as its command (Celery's replies, WIRE.md §6.2).

    Args:
        app: the application (its tasks and their options).
        config: the worker's options.
        clock: the process's Lamport clock.
        state: what the children run and hold (``active``, ``reserved``, ``query_task``).
        queues: the task queues the children consume (``add_consumer``, ``cancel_consumer``,
            ``active_queues``).
        pool: the process pool (its children's counts, time limits and rate limits).
        sizer: resizes the pool (``pool_grow``, ``pool_shrink``) and knows the prefetch applied.
        autoscaler: the autoscaler, or None without ``--autoscale``.
        revoker: the revoked set (``revoke``, ``revoked``, ``hello``).
        revocation_log: journals a revoke that did not come through our client.
        events: the event dispatcher (``enable_events``, ``disable_events``).
        heart: sends ``worker-heartbeat`` (``heartbeat``).
        request_stop: begins a graceful shutdown (``shutdown``).
        gate: the dedup gatekeeper (``dedup``).
    """

    def __init__(
        self,
        *,
        app: App,
        config: WorkerConfig,
        clock: LamportClock,
        state: WorkerState,
        queues: TaskQueues,
        pool: ProcessPool,
        sizer: PoolSizer,
        autoscaler: Autoscaler | None,
        revoker: Revoker,
        revocation_log: RevocationLog,
        events: EventDispatcher,
        heart: Heart,
        request_stop: Callable[[], None],
        gate: Gatekeeper | None = None,
    ) -> None:
        self._gate = gate
        self._app, self._config, self._clock = app, config, clock
        self._state, self._queues = state, queues
        self._pool, self._sizer, self._autoscaler = pool, sizer, autoscaler
        self._revoker, self._revocation_log = revoker, revocation_log
        self._events, self._heart, self._request_stop = events, heart, request_stop
        self._started = time.monotonic()

    def register(self, registry: CommandRegistry) -> CommandRegistry:
        """Attach every command's handler to ``registry``; returns it."""
        for name in COMMAND_NAMES:
            registry.register(name, getattr(self, name))
        return registry

    # -- inspect: what the worker holds and runs ------------------------------------------------------

    def _set_task_events(self, on: bool) -> None:
        # The worker's own events, and its children's (they send theirs themselves).
        self._events.task_events = on
        self._pool.feeding.set_task_events(on)

    async def active(self, safe: bool) -> list[dict[str, Any]]:
        return self._state.active(safe=safe)

    async def reserved(self) -> list[dict[str, Any]]:
        return self._state.reserved(await self._pool.feeding.held())

    async def scheduled(self) -> list[dict[str, Any]]:
        return self._state.scheduled()

    async def query_task(self, ids: str | list[str]) -> dict[str, Any]:
        wanted = [ids] if isinstance(ids, str) else [str(i) for i in ids]
        return self._state.query(wanted, await self._pool.feeding.held())

    async def registered(self, taskinfoitems: list[Any] | None, builtins: bool) -> list[str]:
        """Celery's ``registered``: each name, with ``[item=value ...]`` for the items it has."""
        items = [
            item
            for item in (taskinfoitems or DEFAULT_TASK_INFO_ITEMS)
            if isinstance(item, str) and not item.startswith("_")
        ]
        tasks = self._app.tasks
        return [
            task_info(tasks[name], items)
            for name in sorted(tasks)
            if builtins or not name.startswith("celery.")
        ]

    async def active_queues(self) -> list[dict[str, Any]]:
        return [queue_info(name) for name in self._queues.listed()]

    async def stats(self) -> dict[str, Any]:
        """Celery's ``stats``; with autoscale it gains Celery's ``autoscaler`` map."""
        feeding = self._pool.feeding
        await feeding.reported()  # the children's counts up to now: ``total`` is exact
        config = self._config
        url = urlsplit(config.settings.broker_url)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        reply: dict[str, Any] = {
            "total": dict(feeding.totals),
            "pid": os.getpid(),
            "clock": str(self._clock.value),  # a string, as Celery sends it
            "uptime": int(time.monotonic() - self._started),
            "pool": {
                "implementation": "clockwork.worker.pool:ProcessPool",
                "max-concurrency": self._pool.target,  # follows pool_grow/pool_shrink and the autoscaler
                "processes": self._pool.pids(),
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
            "prefetch_count": self._sizer.prefetch_count,  # the prefetch applied now
            "rusage": {"utime": usage.ru_utime, "stime": usage.ru_stime, "maxrss": usage.ru_maxrss},
            # Ours: the key of the app's shared state, which peers compare (remote/shared_queues.py).
            "app_namespace": config.settings.namespace,
            # Ours: tasks of names this app does not register (another app on the same queue?).
            "unknown_tasks": dict(feeding.unknown),
        }
        if self._autoscaler is not None:
            reply["autoscaler"] = self._autoscaler.info()
        return reply

    async def conf(self, with_defaults: bool) -> dict[str, Any]:
        """Celery's ``conf``: settings by Celery's names, what this worker does (``conf_table``)."""
        return conf_table(
            self._app, self._config, task_events=self._events.task_events, with_defaults=with_defaults
        )

    async def report(self) -> dict[str, Any]:
        """Celery's ``report``: versions, platform and settings, as text."""
        settings = conf_table(
            self._app, self._config, task_events=self._events.task_events, with_defaults=False
        )
        return ok(
            bug_report(app_spec=self._config.app_spec, results=settings["result_backend"], settings=settings)
        )

    # -- the node: liveness, clock, peers -------------------------------------------------------------

    async def dedup(self) -> dict[str, Any]:
        return self._gate.stats() if self._gate is not None else {}

    async def ping(self) -> dict[str, Any]:
        return ok("pong")

    async def clock(self) -> dict[str, Any]:
        return {"clock": self._clock.value}

    async def heartbeat(self) -> None:
        await self._heart.beat()

    async def hello(self, from_node: str, revoked: dict[str, Any] | list[Any]) -> dict[str, Any] | None:
        if from_node == self._config.hostname:
            return None
        self._revoker.merge_peer(revoked)
        return {
            "revoked": self._revoker.revoked.to_wire(limit=HELLO_REVOKED_LIMIT),
            "clock": self._clock.forward(),
        }

    async def shutdown(self, msg: str | None) -> None:
        log.warning("shutdown_requested", message=msg)
        self._request_stop()

    # -- revokes ------------------------------------------------------------------------------------------

    async def revoked(self) -> list[str]:
        return list(self._revoker.revoked)

    async def revoke(
        self, task_id: str | list[str], terminate: bool, signal: str | int | None
    ) -> dict[str, Any]:
        ids = [task_id] if isinstance(task_id, str) else [str(t) for t in task_id]
        log.info("revoke_received", task_ids=len(ids), first=ids[0] if ids else None, terminate=terminate)
        if not (request_headers.get() or {}).get(LOGGED_HEADER):
            # A revoke that did not come through our client (celery control revoke, Flower) is
            # journaled too, so workers that are down now still learn it.
            await self._revocation_log.journal(
                ids, terminate=terminate, signal_name=str(signal) if signal else None
            )
        return await self._revoker.revoke(ids, terminate=terminate, signal_name=signal)

    async def revoke_by_stamped_headers(
        self, headers: dict[str, Any] | list[Any], terminate: bool, signal: str | int | None
    ) -> dict[str, Any]:
        try:
            stamps = revoke_headers(headers)
        except ValueError as exc:
            return nok(str(exc))
        log.info("revoke_by_stamps_received", stamps=sorted(stamps), terminate=terminate)
        if stamps and not (request_headers.get() or {}).get(LOGGED_HEADER):
            # As a revoke by ids: one that did not come through our client is journaled here.
            await self._revocation_log.journal_stamps(
                stamps, terminate=terminate, signal_name=str(signal) if signal else None
            )
        # Celery's reply shows the headers as a map, a list of name=value made one first.
        shown = dict(str(item).split("=", 1) for item in headers) if isinstance(headers, list) else headers
        return await self._revoker.revoke_stamps(stamps, terminate=terminate, signal_name=signal, shown=shown)

    async def terminate(self, task_id: str | list[str], signal: str | int | None) -> dict[str, Any]:
        return await self.revoke(task_id, True, signal)

    # -- runtime changes: limits, queues, events ------------------------------------------------------

    async def time_limit(self, task_name: str, soft: float | None, hard: float | None) -> dict[str, Any]:
        if task_name not in self._app.tasks:
            return nok("unknown task")
        self._pool.feeding.set_time_limit(task_name, hard=hard, soft=soft)
        return ok("time limits set successfully")

    async def rate_limit(self, task_name: str, rate_limit: str | int | float | None) -> dict[str, Any]:
        """Change ``limits``; as Celery, a malformed rate is refused before the task name is looked up.

        The reply says "disabled" when the new rate means no limit (None, ``""``, 0, ``"0/m"``).
        """
        try:
            per_second = parse_rate(rate_limit)
        except ValueError as exc:
            return nok(f"Invalid rate limit string: {exc!r}")
        if task_name not in self._app.tasks:
            log.warning("rate_limit_unknown_task", task_name=task_name)
            return nok("unknown task")
        # As Celery, rewrite the task's option too: it stays what this worker enforces (and what
        # ``registered`` shows), on the instance too when ``register_task`` set it there.
        task = self._app.tasks[task_name]
        type(task).rate_limit = rate_limit
        if "rate_limit" in vars(task):
            vars(task)["rate_limit"] = rate_limit
        self._pool.feeding.rates.set(task_name, per_second)  # every child takes from the same bucket
        if per_second is None:
            log.info("rate_limit_disabled", task_name=task_name)
            return ok("rate limit disabled successfully")
        log.info("rate_limit_set", task_name=task_name, rate_limit=rate_limit, per_second=per_second)
        return ok("new rate limit set successfully")

    async def add_consumer(
        self, queue: str, exchange: str | None, exchange_type: str, routing_key: str | None, options: Any
    ) -> dict[str, Any]:
        if queue in self._queues.listed():
            return ok(f"already consuming from {queue!r}")
        await self._queues.declare(queue)  # declared here, then the children are told
        self._pool.feeding.set_queues(self._queues.consumed())
        log.info("consumer_added", queue=queue)
        return ok(f"add consumer {queue}")

    async def cancel_consumer(self, queue: str) -> dict[str, Any]:
        if not self._queues.remove(queue):
            return ok(f"not consuming from {queue}")
        self._pool.feeding.set_queues(self._queues.consumed())
        log.info("consumer_cancelled", queue=queue)
        return ok(f"no longer consuming from {queue}")

    async def enable_events(self) -> dict[str, Any]:
        if self._events.task_events:
            return ok("task events already enabled")
        self._set_task_events(True)
        return ok("task events enabled")

    async def disable_events(self) -> dict[str, Any]:
        if not self._events.task_events:
            return ok("task events already disabled")
        self._set_task_events(False)
        return ok("task events disabled")

    # -- the pool: its size and the autoscaler --------------------------------------------------------
    # Children retire one by one, each finishing its task after handing back what it holds
    # (worker.pool.pool.ProcessPool.shrink).
    # Errors read as Celery's (kombu replies ``repr(exc)`` for a handler's exception), e.g.
    # ``autoscale`` on a worker without it gives ``{"error": "ValueError('Autoscale not enabled')"}``.

    async def pool_grow(self, n: int) -> dict[str, Any]:
        sizer = self._sizer
        if self._autoscaler is not None:
            return nok(_NOT_WITH_AUTOSCALE.format("pool_grow"))
        if n < 0:
            return nok(repr(ValueError(f"n must not be negative, got {n}")))
        size = await sizer.resize(sizer.size + n)
        log.info("pool_grow", n=n, size=size, prefetch=sizer.prefetch_count)
        return ok("pool will grow")

    async def pool_shrink(self, n: int) -> dict[str, Any]:
        sizer = self._sizer
        if self._autoscaler is not None:
            return nok(_NOT_WITH_AUTOSCALE.format("pool_shrink"))
        if n < 0:
            return nok(repr(ValueError(f"n must not be negative, got {n}")))
        if n > 0 and sizer.size <= 1:
            return nok(repr(ValueError("Can't shrink the pool below one process")))
        size = await sizer.resize(max(sizer.size - n, 1))
        log.info("pool_shrink", n=n, size=size, prefetch=sizer.prefetch_count, busy=self._pool.busy_count)
        return ok("pool will shrink")

    async def autoscale(self, max: int | None, min: int | None) -> dict[str, Any]:  # Celery's argument names
        if self._autoscaler is None:
            return nok(repr(ValueError("Autoscale not enabled")))
        try:
            new_max, new_min = await self._autoscaler.update(max, min)
        except ValueError as exc:
            return nok(repr(exc))
        return ok(f"autoscale now max={new_max} min={new_min}")


def task_info(task: object, items: Sequence[str]) -> str:
    """A task as Celery's ``registered`` lists it: ``name [rate_limit=10/s ...]``.

    Each item is the task's attribute of that name, as ``str()``; those it lacks or holds None for
    are left out, and a task with none of them is its bare name.
    """
    name = str(getattr(task, "name", ""))
    fields = [f"{item}={value}" for item in items if (value := getattr(task, item, None)) is not None]
    return f"{name} [{' '.join(fields)}]" if fields else name


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
