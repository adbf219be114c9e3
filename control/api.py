"""``app.control``: Celery's remote-control API (``inspect().active()``, ``revoke()``, ``ping()``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.apps.control_plane import Destination
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerSvcError
from broker_svc.logging import get_logger
from broker_svc.schedules.client import ScheduleClient
from broker_svc.settings import Settings
from control.blocking.client import ControlClient
from control.blocking.dead_letters import DeadLetters
from control.protocol.replies import (
    BroadcastResult,
    ClockReply,
    InspectResult,
    OkReply,
    ScheduledTask,
    TaskInfo,
)
from control.protocol.request import Matcher, flatten_replies

if TYPE_CHECKING:
    from broker_svc.app import App

__all__ = ["Control", "Inspect"]

log = get_logger(__name__)


class Control:
    """Remote control of the workers, shaped like ``celery.app.control.Control``.

    Calls that change workers (``revoke``, ``shutdown``, ...) are casts unless ``reply=True``,
    and then return the list of one-entry reply maps, as in Celery. Each thread gets its own
    connection (a ``ControlClient``), opened on first use.

    Args:
        app: the app whose settings and clock to use; or pass ``settings`` (and ``clock``).
        settings: broker settings when there is no app.
        clock: the process's Lamport clock (the app's, when an app is given).
        namespace: the mailbox namespace (Celery's ``control_exchange``).

    Raises:
        TypeError: neither an app nor settings.
    """

    def __init__(
        self,
        app: App | None = None,
        *,
        settings: Settings | None = None,
        clock: LamportClock | None = None,
        namespace: str = "celery",
    ) -> None:
        if app is not None:
            settings, clock = app.settings, app.clock
        if settings is None:
            raise TypeError("Control needs an app or settings")
        self.settings = settings
        self.clock = clock or LamportClock()
        self.namespace = namespace
        self._local = threading.local()
        self._clients: list[ControlClient] = []
        self._lock = threading.Lock()

    def client(self) -> ControlClient:
        """This thread's control client (connected lazily on its first call)."""
        client: ControlClient | None = getattr(self._local, "client", None)
        if client is None:
            client = ControlClient(self.settings, namespace=self.namespace, clock=self.clock)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        """Close every thread's connection; call it when no thread is using this object."""
        with self._lock:
            clients, self._clients = self._clients, []
        self._local = threading.local()
        for client in clients:
            try:
                client.close()
            except BrokerSvcError as exc:  # closing must not fail an app's shutdown
                log.debug("control_close_failed", error=str(exc))

    def inspect(
        self,
        destination: Destination = None,
        timeout: float = 1.0,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        limit: int | None = None,
    ) -> Inspect:
        """Read-only queries to the workers (``inspect().active()`` and friends)."""
        return Inspect(
            self, destination=destination, timeout=timeout, pattern=pattern, matcher=matcher, limit=limit
        )

    def broadcast(
        self,
        command: str,
        arguments: dict[str, Any] | None = None,
        destination: Destination = None,
        reply: bool = False,
        timeout: float = 1.0,
        limit: int | None = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
    ) -> list[dict[str, Any]] | None:
        """Send a command; with ``reply``, the list of ``{nodename: value}`` replies.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        result = self.client().broadcast(
            command,
            arguments,
            destination=destination,
            pattern=pattern,
            matcher=matcher,
            reply=reply,
            timeout_s=timeout,
            limit=limit,
        )
        return _replies(result, reply)

    def ping(self, destination: Destination = None, timeout: float = 1.0) -> list[dict[str, Any]]:
        """Ping the workers: ``[{nodename: {"ok": "pong"}}, ...]``.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        return self.broadcast("ping", destination=destination, reply=True, timeout=timeout) or []

    def revoke(
        self,
        task_id: str | Sequence[str],
        destination: Destination = None,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        timeout: float = 1.0,
    ) -> list[dict[str, Any]] | None:
        """Revoke tasks, durably: the revoke also holds for workers that start later.

        Raises:
            ValueError: no ids or a malformed id.
            BrokerUnavailable: the broker cannot be reached.
        """
        result = self.client().revoke(
            task_id,
            terminate=terminate,
            signal=signal,
            reply=reply,
            destination=destination,
            timeout_s=timeout,
        )
        return _replies(result, reply)

    def revoke_by_stamped_headers(
        self,
        headers: Mapping[str, Any] | Sequence[str],
        destination: Destination = None,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        timeout: float = 1.0,
    ) -> list[dict[str, Any]] | None:
        """Revoke every task stamped with these values (``{"stamp": value or [values]}``), durably:
        the revoke also holds for workers that start later. With ``terminate``, running ones end.

        Raises:
            ValueError: ``headers`` is not a map of stamp names to values (or lists of them).
            BrokerUnavailable: the broker cannot be reached.
        """
        result = self.client().revoke_by_stamped_headers(
            headers,
            terminate=terminate,
            signal=signal,
            reply=reply,
            destination=destination,
            timeout_s=timeout,
        )
        return _replies(result, reply)

    def terminate(
        self,
        task_id: str | Sequence[str],
        destination: Destination = None,
        signal: str = "SIGTERM",
        **kwargs: Any,
    ) -> list[dict[str, Any]] | None:
        """Revoke and kill running tasks (Celery sends this as ``revoke`` with ``terminate``).

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        return self.revoke(task_id, destination=destination, terminate=True, signal=signal, **kwargs)

    def shutdown(self, destination: Destination = None, **kwargs: Any) -> list[dict[str, Any]] | None:
        """Ask workers to shut down (warm); they send no reply."""
        return self.broadcast("shutdown", destination=destination, **kwargs)

    def enable_events(self, destination: Destination = None, **kwargs: Any) -> list[dict[str, Any]] | None:
        """Turn on task events."""
        return self.broadcast("enable_events", destination=destination, **kwargs)

    def disable_events(self, destination: Destination = None, **kwargs: Any) -> list[dict[str, Any]] | None:
        """Turn off task events."""
        return self.broadcast("disable_events", destination=destination, **kwargs)

    def heartbeat(self, destination: Destination = None, **kwargs: Any) -> list[dict[str, Any]] | None:
        """Ask workers to send a heartbeat event now."""
        return self.broadcast("heartbeat", destination=destination, **kwargs)

    def time_limit(
        self,
        task_name: str,
        soft: float | None = None,
        hard: float | None = None,
        destination: Destination = None,
        **kwargs: Any,
    ) -> list[dict[str, Any]] | None:
        """Change a task's time limits on the workers."""
        arguments = {"task_name": task_name, "soft": soft, "hard": hard}
        return self.broadcast("time_limit", arguments, destination=destination, **kwargs)

    def add_consumer(
        self,
        queue: str,
        exchange: str | None = None,
        exchange_type: str = "direct",
        routing_key: str | None = None,
        options: dict[str, Any] | None = None,
        destination: Destination = None,
        **kwargs: Any,
    ) -> list[dict[str, Any]] | None:
        """Make workers consume from another queue."""
        arguments = {
            "queue": queue,
            "exchange": exchange,
            "exchange_type": exchange_type,
            "routing_key": routing_key,
            "options": options,
        }
        return self.broadcast("add_consumer", arguments, destination=destination, **kwargs)

    def cancel_consumer(
        self, queue: str, destination: Destination = None, **kwargs: Any
    ) -> list[dict[str, Any]] | None:
        """Make workers stop consuming from a queue."""
        return self.broadcast("cancel_consumer", {"queue": queue}, destination=destination, **kwargs)

    def pool_grow(
        self, n: int = 1, destination: Destination = None, **kwargs: Any
    ) -> list[dict[str, Any]] | None:
        """Add ``n`` children to the pools (refused under autoscale)."""
        return self.broadcast("pool_grow", {"n": n}, destination=destination, **kwargs)

    def pool_shrink(
        self, n: int = 1, destination: Destination = None, **kwargs: Any
    ) -> list[dict[str, Any]] | None:
        """Retire ``n`` children from the pools, busy ones after their task (refused under autoscale)."""
        return self.broadcast("pool_shrink", {"n": n}, destination=destination, **kwargs)

    def autoscale(
        self, max: int | None, min: int | None, destination: Destination = None, **kwargs: Any
    ) -> list[dict[str, Any]] | None:
        """Change the autoscale range of workers started with ``--autoscale`` (None keeps a bound)."""
        return self.broadcast("autoscale", {"max": max, "min": min}, destination=destination, **kwargs)

    def dead_letters(self) -> DeadLetters:
        """The dead letters of the vhost's task queues: ``list()``, ``show(id)``, ``requeue(*ids)``,
        ``requeue_all()`` and ``purge()`` (docs/guide.md, "Handling dead letters"). Without a queue
        they cover the dead queues of the app's queues and of those the live workers consume."""
        return DeadLetters(self.settings, discover=self._consumed_queues, clock=self.clock)

    def _consumed_queues(self) -> list[str]:
        # The queues the live workers consume (ask for a second at most).
        names: list[str] = []
        for queues in self.client().inspect("active_queues", timeout_s=1.0).values():
            for queue in queues if isinstance(queues, list) else ():
                name = queue.get("name") if isinstance(queue, dict) else None
                if isinstance(name, str) and name not in names:
                    names.append(name)
        return names

    def schedules(self, scheduler: str = "default") -> ScheduleClient:
        """The periodic schedule of ``scheduler``: ``list()``, and ``add``, ``remove``, ``pause``,
        ``resume``, ``run_now`` at runtime (durable; applied by the leading scheduler instance)."""
        return ScheduleClient(self.settings, scheduler)


class Inspect:
    """Read-only queries, shaped like ``celery.app.control.Inspect``.

    Each method returns ``{nodename: value}``, or None when no node answered. As in Celery, when
    the destination is a single name (a string), only that node's value is returned. The types
    (``control.protocol.replies.InspectResult``) name the value each command's reply has on a
    worker, or the ``{"error": ...}`` it sends when the command failed there; replies are not
    checked against them on receipt.
    """

    def __init__(
        self,
        control: Control,
        *,
        destination: Destination = None,
        timeout: float = 1.0,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        limit: int | None = None,
    ) -> None:
        self.control = control
        self.destination = destination
        self.timeout = timeout
        self.pattern = pattern
        self.matcher = matcher
        self.limit = limit

    def _request(self, method: str, **arguments: Any) -> InspectResult[Any]:
        # The values are decoded JSON or msgpack; each method below names the shape workers send.
        replies = self.control.broadcast(
            method,
            arguments,
            destination=self.destination,
            reply=True,
            timeout=self.timeout,
            limit=self.limit,
            pattern=self.pattern,
            matcher=self.matcher,
        )
        if not replies:
            return None
        by_node = flatten_replies(replies)
        if isinstance(self.destination, str):
            return by_node.get(self.destination)
        return by_node

    def ping(self) -> InspectResult[OkReply]:
        """``{node: {"ok": "pong"}}``."""
        return self._request("ping")

    def clock(self) -> InspectResult[ClockReply]:
        """``{node: {"clock": n}}``."""
        return self._request("clock")

    def active(self, safe: bool = False) -> InspectResult[list[TaskInfo]]:
        """``{node: [task info, ...]}`` of the running tasks."""
        return self._request("active", safe=safe)

    def reserved(self) -> InspectResult[list[TaskInfo]]:
        """``{node: [task info, ...]}`` of tasks received but not started."""
        return self._request("reserved")

    def scheduled(self) -> InspectResult[list[ScheduledTask]]:
        """``{node: [{eta, priority, request}, ...]}`` of tasks waiting for their ETA."""
        return self._request("scheduled")

    def revoked(self) -> InspectResult[list[str]]:
        """``{node: [task id, ...]}``."""
        return self._request("revoked")

    def registered(self, *taskinfoitems: str) -> InspectResult[list[str]]:
        """``{node: [task name, ...]}``; a task with one of ``taskinfoitems`` (by default
        ``exchange``, ``routing_key``, ``rate_limit``) reads ``name [rate_limit=10/s ...]``."""
        return self._request("registered", taskinfoitems=list(taskinfoitems))

    registered_tasks = registered

    def stats(self) -> InspectResult[dict[str, Any]]:
        """``{node: {total, pid, clock, uptime, pool, broker, ...}}``."""
        return self._request("stats")

    def query_task(self, *ids: str | Sequence[str]) -> InspectResult[dict[str, list[Any]]]:
        """``{node: {task id: [state, task info]}}``; ids as arguments or one list."""
        flat: list[str] = []
        for item in ids:
            flat.extend([item] if isinstance(item, str) else item)
        return self._request("query_task", ids=flat)

    def active_queues(self) -> InspectResult[list[dict[str, Any]]]:
        """``{node: [queue map, ...]}``."""
        return self._request("active_queues")

    def conf(self, with_defaults: bool = False) -> InspectResult[dict[str, Any]]:
        """``{node: {setting: value}}``."""
        return self._request("conf", with_defaults=with_defaults)

    def report(self) -> InspectResult[dict[str, str]]:
        """``{node: {"ok": text}}``: software versions, platform and settings (Celery's ``report``)."""
        return self._request("report")

    def dedup(self) -> InspectResult[dict[str, Any]]:
        """``{node: {...}}``: the dedup gate shards a worker keeps, its keys and its decisions."""
        return self._request("dedup")


def _replies(result: BroadcastResult, reply: bool) -> list[dict[str, Any]] | None:
    return result.replies if reply else None
