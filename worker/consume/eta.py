"""The ETA scheduler: holds tasks due within a short window, parks later ones in delay queues."""

from __future__ import annotations

import asyncio
import datetime as dt
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
        self.parked = 0

    @property
    def held(self) -> int:
        """Deliveries now waiting in memory for their ETA."""
        return self._held

    async def defer(
        self, message: aio_pika.abc.AbstractIncomingMessage, *, queue: str, eta: dt.datetime
    ) -> bool:
        """Wait for a task's ETA or park it; call before running a task that has an ``eta``.

        Args:
            message: the delivery, from ``queue``.
            queue: the task queue it came from (and goes back to).
            eta: when the task may start.

        Returns:
            False when the task is due now (the caller runs it; it may have waited in memory for
            up to the hold window first). True when it was parked and ``message`` acked: the caller
            is done with it.

        Raises:
            aio_pika.exceptions.AMQPError: the copy was not confirmed (``message`` is not acked).
            Unroutable: the delay queue was deleted under us (``message`` is not acked).
        """
        while True:
            # Decided afresh after every wait: the loop's timers are monotonic, the ETA is wall
            # time, and a timer may fire a little early. A task must never start before its ETA.
            remaining_s = seconds_until(eta)
            if remaining_s <= 0:
                return False
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
        await self._publish(copy_message(message, dict(message.headers or {})), queue, bucket_ms)
        self.parked += 1
        log.debug("task_parked", bucket_ms=bucket_ms, remaining_s=round(remaining_s, 3))
        try:
            await message.ack()
        except (aio_pika.exceptions.ChannelInvalidStateError, aio_pika.exceptions.AMQPError) as exc:
            # The channel went away: the broker redelivers the original and the parked copy comes
            # back too, so the task may run twice (at-least-once).
            log.warning("parked_ack_skipped_channel_gone", error=str(exc))
        return True

    async def publish_delayed(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        *,
        queue: str,
        eta: dt.datetime,
        headers: dict[str, Any],
    ) -> None:
        """Publish a copy of ``message`` with ``headers`` merged in, to run at ``eta`` (a retry).

        It goes to a delay queue when ``eta`` is beyond the hold window, else straight to
        ``queue``. Confirmed before return; ``message`` is not acked (the caller does that).

        Raises:
            aio_pika.exceptions.AMQPError: the copy was not confirmed (the caller must not ack).
            Unroutable: no queue took the copy (the caller must not ack).
        """
        merged = dict(message.headers or {})
        merged.update(headers)
        copy = copy_message(message, merged)
        bucket_ms = delay_bucket_ms(seconds_until(eta), hold_window_s=self._hold_window_s)
        await self._publish(copy, queue, bucket_ms)

    async def _hold(self, seconds: float) -> None:
        self._held += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._held -= 1

    async def _publish(self, copy: aio_pika.Message, queue: str, bucket_ms: int | None) -> None:
        if bucket_ms is None:
            routing_key = queue
        else:
            spec = delay_queue(queue, bucket_ms)
            routing_key = spec.name
            if routing_key not in self._declared:
                await self._channel.declare_queue(routing_key, durable=spec.durable, arguments=spec.arguments)
                self._declared.add(routing_key)
        result = await self._channel.default_exchange.publish(copy, routing_key=routing_key, mandatory=True)
        if isinstance(result, aiormq.abc.DeliveredMessage):  # basic.return: no such queue
            self._declared.discard(routing_key)
            raise Unroutable(f"no queue {routing_key!r} took the task")


def seconds_until(eta: dt.datetime) -> float:
    """Seconds from now until ``eta`` (negative once past); a naive ``eta`` is taken as UTC."""
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=dt.UTC)
    return (eta - dt.datetime.now(dt.UTC)).total_seconds()
