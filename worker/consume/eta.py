"""The ETA scheduler: holds tasks due within a short window, parks later ones in delay queues."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
import structlog

from broker_svc.errors import Unroutable
from broker_svc.topology import DELAY_HOLD_WINDOW_S, MIN_DELAY_BUCKET_MS, delay_bucket_ms, delay_queue
from worker.consume.publish import copy_message

__all__ = ["EtaScheduler", "seconds_until"]

log = structlog.get_logger(__name__)


class EtaScheduler:
    """Keeps ETA tasks in the broker until they are nearly due: a backlog costs no worker memory.

    A task due within ``hold_window_s`` (by default the shortest delay, 128 ms) waits in memory,
    its delivery unacked for at most that long, as long as fewer than ``max_held`` wait so. Any
    other task not yet due is *parked*: a copy goes to the delay queue of
    ``delay_bucket_ms(remaining)`` (TTL = the bucket, dead-lettered back to the task queue), and
    the original is acked once the broker confirmed the copy. Each return at least halves the time
    left, so a task due in an hour comes back at most 15 times (docs/design.md, "ETA and
    countdown").

    Args:
        channel: a channel in publisher-confirm mode (the worker's publish channel).
        hold_window_s: tasks due within this many seconds are held in memory.
        max_held: at most this many deliveries are held at once. Held deliveries count against
            the consumer's prefetch: keep it at most prefetch minus concurrency, or due tasks wait
            behind held ones.

    Raises:
        ValueError: a negative ``hold_window_s`` or ``max_held``.
    """

    def __init__(
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        hold_window_s: float = DELAY_HOLD_WINDOW_S,
        max_held: int = 1000,
    ) -> None:
        if hold_window_s < 0 or max_held < 0:
            raise ValueError(
                f"hold_window_s and max_held must not be negative, got {hold_window_s}, {max_held}"
            )
        self._channel = channel
        self._hold_window_s = hold_window_s
        self._max_held = max_held
        self._held = 0
        # Delay queues are durable and declared once per worker; a queue deleted behind our back
        # shows up as a returned publish, which drops it from here so the next park redeclares it.
        self._declared: set[str] = set()

    async def defer(self, eta: dt.datetime) -> int | None:
        """Wait for a task's ETA in memory, or choose the delay queue to park it in.

        Call before running a task that has an ``eta``.

        Returns:
            None when the task is due now (the caller runs it; it may have waited in memory for
            up to the hold window first). Else the delay bucket (ms) to park a copy in: the caller
            publishes it (:meth:`park`) and acks the original.
        """
        while True:
            # Decided afresh after every wait: the loop's timers are monotonic, the ETA is wall
            # time, and a timer may fire a little early. A task must never start before its ETA.
            remaining_s = seconds_until(eta)
            if remaining_s <= 0:
                return None
            bucket_ms = delay_bucket_ms(remaining_s, hold_window_s=self._hold_window_s)
            if bucket_ms is not None:
                break
            if self._held < self._max_held:
                await self._hold(remaining_s)
                continue
            # Too many held: park it too, in the bucket that does not overshoot, or the shortest
            # one (it then starts up to 128 ms late, never early).
            bucket_ms = delay_bucket_ms(remaining_s, hold_window_s=0) or MIN_DELAY_BUCKET_MS
            break
        log.debug("task_parked", bucket_ms=bucket_ms, remaining_s=round(remaining_s, 3))
        return bucket_ms

    def bucket_for(self, eta: dt.datetime) -> int | None:
        """The delay bucket (ms) for a copy to run at ``eta``; None: due within the hold window."""
        return delay_bucket_ms(seconds_until(eta), hold_window_s=self._hold_window_s)

    async def park(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        *,
        queue: str,
        bucket_ms: int,
        headers: Mapping[str, Any],
        drop: tuple[str, ...] = (),
        body: bytes | None = None,
    ) -> None:
        """Publish a copy of ``message`` with ``headers`` merged in to ``queue``'s delay queue.

        ``drop`` names headers the copy must not carry; ``body`` replaces the delivery's.

        The copy is dead-lettered back to ``queue`` after ``bucket_ms``. Confirmed before return;
        ``message`` is not acked (the caller does that).

        Raises:
            aio_pika.exceptions.AMQPError: the copy was not confirmed (the caller must not ack).
            Unroutable: the delay queue was deleted under us (the caller must not ack).
        """
        merged = dict(message.headers or {})
        for name in drop:
            merged.pop(name, None)
        merged.update(headers)
        spec = delay_queue(queue, bucket_ms)
        routing_key = spec.name
        if routing_key not in self._declared:
            await self._channel.declare_queue(routing_key, durable=spec.durable, arguments=spec.arguments)
            self._declared.add(routing_key)
        copy = copy_message(message, merged, body=body)
        result = await self._channel.default_exchange.publish(copy, routing_key=routing_key, mandatory=True)
        if isinstance(result, aiormq.abc.DeliveredMessage):  # basic.return: no such queue
            self._declared.discard(routing_key)
            raise Unroutable(f"no queue {routing_key!r} took the task")

    async def _hold(self, seconds: float) -> None:
        self._held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._held -= 1


def seconds_until(eta: dt.datetime) -> float:
    """Seconds from now until ``eta`` (negative once past); a naive ``eta`` is taken as UTC."""
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=dt.UTC)
    return (eta - dt.datetime.now(dt.UTC)).total_seconds()
