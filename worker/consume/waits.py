"""The waits before a run: a delivery's ETA, its turn under a rate limit, then a free child."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import aio_pika.abc
import structlog

from broker_svc.topology import DELAY_HOLD_WINDOW_S
from broker_svc.wire.task_message import TaskMessage
from worker.consume.eta import EtaScheduler
from worker.consume.rate_limits import RATE_RESERVED_HEADER, RateLimits
from worker.consume.redelivery import channel_gone
from worker.consume.settle import HAND_BACK, LEFT_TO_BROKER, Disposition
from worker.consume.slots import FairSlots
from worker.state import Tracked, WorkerState

__all__ = ["Waits"]


log = structlog.get_logger(__name__)


class Waits:
    """Where a delivery of the worker's consumer waits before it runs, shown to inspect meanwhile.

    Each wait may decide the delivery's fate instead: parked in a delay queue (its ETA or its
    rate-limit turn is further off), or handed back (cancelled while reserved for a child).
    """

    def __init__(
        self, *, state: WorkerState, eta: EtaScheduler, limits: RateLimits, slots: FairSlots
    ) -> None:
        self._state = state
        self._eta = eta
        self._limits = limits
        self._slots = slots
        # Deliveries waiting for a child: the handler task → its delivery.
        self._reserved: dict[asyncio.Task[Any], aio_pika.abc.AbstractIncomingMessage] = {}

    async def until_due(self, tracked: Tracked, eta: dt.datetime) -> Disposition | None:
        """Scheduled while it waits in memory for its ETA; parked (its fate) when that is further off."""
        task_id = tracked.request.id
        self._state.scheduled_tasks[task_id] = tracked
        try:
            bucket_ms = await self._eta.defer(eta)
        finally:
            self._state.scheduled_tasks.pop(task_id, None)
        return None if bucket_ms is None else Disposition.republish({}, delay_ms=bucket_ms)

    async def rate_limited(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage
    ) -> Disposition | None:
        """Held until its turn under the task's rate limit, or parked (its fate) when that is later."""
        # A token is taken once per task: a copy parked for its turn comes back marked, due.
        if (message.headers or {}).get(RATE_RESERVED_HEADER) is True:
            return None
        delay_s = self._limits.reserve(request.task)
        if delay_s <= 0:
            return None
        if delay_s <= DELAY_HOLD_WINDOW_S:
            await asyncio.sleep(delay_s)  # holds the delivery, never a child
            return None
        # Its turn is later: wait in the broker, not in our prefetch, so other tasks go on.
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay_s)
        log.debug("task_rate_limited", delay_s=round(delay_s, 3))
        return Disposition.republish(
            {"eta": due.isoformat(), RATE_RESERVED_HEADER: True}, delay_ms=self._eta.bucket_for(due)
        )

    async def for_child(
        self, tracked: Tracked, message: aio_pika.abc.AbstractIncomingMessage, queue: str
    ) -> Disposition | None:
        """Reserved until a slot is free: None once acquired (the caller releases it), else its fate."""
        task = asyncio.current_task()
        assert task is not None
        self._reserved[task] = message
        self._state.reserved_tasks[tracked.request.id] = tracked
        try:
            await self._slots.acquire(queue)
        except asyncio.CancelledError:
            # Reserved but never started: the broker gets it back for another worker.
            if channel_gone(message):
                log.info("task_dropped_channel_gone")  # requeued by the broker already
                return LEFT_TO_BROKER
            log.info("task_requeued_on_shutdown")
            return HAND_BACK
        finally:
            self._reserved.pop(task, None)
            self._state.reserved_tasks.pop(tracked.request.id, None)
        return None

    def hand_back_reserved(self) -> None:
        """Cancel every wait for a child: each delivery goes back to the broker unstarted."""
        for task in list(self._reserved):
            task.cancel()

    def drop_stale_reserved(self) -> int:
        """Give up the deliveries waiting for a child whose channel is gone; returns how many."""
        stale = [task for task, message in self._reserved.items() if channel_gone(message)]
        for task in stale:
            task.cancel()
        return len(stale)
