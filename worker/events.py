"""Events on ``celeryev`` (Celery's format, WIRE.md §7): worker online/heartbeat/offline, task-*.

Events are JSON (a receiver that meets one msgpack event breaks), carry the sender's Lamport clock
in the body and its node name in the ``hostname`` header, and are best-effort: a lost event is
logged, never a reason to fail a task.
"""

from __future__ import annotations

import asyncio
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from broker_svc.topology import event_exchange
from broker_svc.version import version
from broker_svc.wire.event_fields import encode_event, event_body, routing_key, utcoffset
from worker.rules.listers import QUEUES_FIELD

__all__ = ["HEARTBEAT_FREQ_S", "EventDispatcher", "Heart", "utcoffset"]

log = structlog.get_logger(__name__)

HEARTBEAT_FREQ_S: Final = 2.0
SW_IDENT: Final = "py-clockwork"
# Task events are sent only while enabled (``-E`` or ``enable_events``), as in Celery; worker
# events always are.
_TASK_GROUP: Final = "task-"


class EventDispatcher:
    """Publishes events for one node.

    Args:
        channel: a channel without publisher confirms (events are fire-and-forget).
        hostname: the sender's node name.
        clock: the process's Lamport clock, forwarded on every event.
        task_events: send ``task-*`` events (``-E``); changed by ``enable_events``/``disable_events``.
    """

    def __init__(
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        hostname: str,
        clock: LamportClock,
        task_events: bool = False,
    ) -> None:
        self._channel = channel
        self._hostname = hostname
        self._clock = clock
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self.task_events = task_events

    async def start(self) -> None:
        """Declare ``celeryev`` (topic, durable; equal to Celery's declaration)."""
        spec = event_exchange()
        self._exchange = await self._channel.declare_exchange(
            spec.name, type=aio_pika.ExchangeType(spec.type), durable=spec.durable
        )

    def fields(self, event_type: str, **extra: Any) -> dict[str, Any]:
        """An event map with the standard fields (the clock is forwarded: this is a send)."""
        return event_body(event_type, hostname=self._hostname, clock=self._clock, **extra)

    def message(self, event_type: str, **extra: Any) -> tuple[str, aio_pika.Message]:
        """One event as published to ``celeryev``: its routing key and message (the clock is
        forwarded), for a sender that publishes it on a channel of its own (in a transaction)."""
        event = self.fields(event_type, **extra)
        message = aio_pika.Message(
            encode_event(event),
            content_type="application/json",
            content_encoding="utf-8",
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            headers={"hostname": self._hostname},
        )
        return routing_key(event_type), message

    async def send(self, event_type: str, **extra: Any) -> None:
        """Publish one event; task events only while enabled. Never raises on broker errors."""
        if event_type.startswith(_TASK_GROUP) and not self.task_events:
            return
        exchange = self._exchange
        if exchange is None:
            return
        key, message = self.message(event_type, **extra)
        try:
            # Not mandatory, as Celery's events are: with no one listening the broker drops them,
            # which is normal; mandatory, each would come back as a basic.return logged at ERROR.
            await exchange.publish(message, routing_key=key, mandatory=False)
        except Exception as exc:  # events are best-effort: a broken channel must not fail a task
            log.warning("event_not_sent", event_type=event_type, error=str(exc))


class Heart:
    """Sends ``worker-online``, then ``worker-heartbeat`` every ``freq_s`` (``run``), and ``worker-offline``.

    Args:
        events: the dispatcher.
        stats: returns ``(active, processed)``: tasks running now, tasks received since start.
        freq_s: the heartbeat interval, sent as ``freq`` so receivers know when we are late.
        app_namespace: the worker's app namespace, sent as ``app_namespace`` (a field Celery
            ignores) so peers know which app's shared state the worker keeps (the dedup gate).
        task_queues: the task queues the worker consumes now, sent as ``task_queues`` (a field
            Celery ignores) so peers know who lists a task a client parked
            (``worker/rules/listers.py``).
    """

    def __init__(
        self,
        events: EventDispatcher,
        stats: Callable[[], tuple[int, int]],
        *,
        freq_s: float = HEARTBEAT_FREQ_S,
        app_namespace: str | None = None,
        task_queues: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self._events = events
        self._stats = stats
        self._freq_s = freq_s
        self._app_namespace = app_namespace
        self._task_queues = task_queues

    def _fields(self) -> dict[str, Any]:
        active, processed = self._stats()
        try:
            loadavg = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            loadavg = [0.0, 0.0, 0.0]
        app: dict[str, Any] = {} if self._app_namespace is None else {"app_namespace": self._app_namespace}
        if self._task_queues is not None:
            app[QUEUES_FIELD] = list(self._task_queues())
        return {
            **app,
            "freq": self._freq_s,
            "sw_ident": SW_IDENT,
            "sw_ver": version(),
            "sw_sys": platform.system(),
            "active": active,
            "processed": processed,
            "loadavg": loadavg,
        }

    async def online(self) -> None:
        """Announce the node (at start, and again after a reconnect)."""
        await self._events.send("worker-online", **self._fields())

    async def beat(self) -> None:
        """One heartbeat now (the ``heartbeat`` control command)."""
        await self._events.send("worker-heartbeat", **self._fields())

    async def offline(self) -> None:
        """Say goodbye (at stop, once ``run`` has been cancelled)."""
        await self._events.send("worker-offline", **self._fields())

    async def run(self) -> None:
        """Beat every ``freq_s`` until cancelled."""
        # Scheduled on a fixed grid, so a slow send does not stretch the interval receivers expect.
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self._freq_s
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += self._freq_s
            await self.beat()
