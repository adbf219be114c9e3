"""The consume channel's watch: its closes and reopens, broker-side cancels, and missing consumers.

The channel that carries task deliveries can close under the worker (a 406 after consumer_timeout,
a lost connection), have a consumer cancelled by the broker (its queue deleted), or come back
without every consumer restored. ``ConsumeChannelWatch`` hooks the channel's callbacks — dropping
the reserved deliveries a close made stale and logging each fault — and runs the watchdog that makes
a worker which has stopped consuming a queue loud (RELIABILITY.md R4-R7). It is apart from the
service because it only observes: the service owns the channel, worker.amqp.subscriptions the
consumers, and this reads them.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, cast

import aio_pika
import aio_pika.abc
import aiormq
import structlog
from aiormq import spec
from aiormq.exceptions import ChannelPreconditionFailed

if TYPE_CHECKING:
    from worker.amqp.subscriptions import QueueConsumers
    from worker.consume.consumer import TaskConsumer

__all__ = ["ConsumeChannelWatch"]

log = structlog.get_logger(__name__)

# How often the worker checks that it consumes every queue it should, and how long one may be
# missing (aio-pika restores it meanwhile) before that is logged as an error.
_CONSUMER_WATCH_S = 1.0
_CONSUMER_MISSING_LOUD_S = 10.0


class ConsumeChannelWatch:
    """Watches the consume channel and the task-queue consumers on it.

    Args:
        channel: the consume channel.
        queues: the task-queue consumers that should be on the channel (read only).
        consumer: the task consumer (its reserved deliveries go stale when the channel closes).
    """

    def __init__(
        self, channel: aio_pika.abc.AbstractChannel, queues: QueueConsumers, *, consumer: TaskConsumer
    ) -> None:
        self._consume_channel = channel
        self._queues = queues
        self._consumer = consumer
        self._consume_closed_at: float | None = None

    async def install(self) -> None:
        """Hook the channel's close, reopen and consumer-cancel callbacks (before anything is consumed)."""
        channel = self._consume_channel
        channel.close_callbacks.add(self._on_consume_channel_closed)
        if isinstance(channel, aio_pika.abc.AbstractRobustChannel):
            channel.reopen_callbacks.add(self._on_consume_channel_reopened)
        (await channel.get_underlay_channel()).on_consumer_cancel_callbacks.add(self._on_consumer_cancelled)

    def _on_consume_channel_closed(self, _channel: Any, exc: BaseException | None) -> None:
        # The broker closed the channel (406 after consumer_timeout, say) or the connection went.
        # Either way it requeued every delivery we held: the ones still waiting for a child are
        # dropped here (another copy comes back), and no ack goes out with their stale tags.
        self._consume_closed_at = time.monotonic()
        timed_out = isinstance(exc, ChannelPreconditionFailed) and "timed out" in str(exc)
        consumer = self._consumer
        dropped = consumer.drop_stale_reserved()
        # Closed by us (shutdown): aio-pika reports that as a CancelledError, and it is no fault.
        ours = exc is None or isinstance(exc, asyncio.CancelledError)
        (log.error if timed_out else log.info if ours else log.warning)(
            "consume_channel_closed",
            reason=type(exc).__name__ if exc is not None else None,
            error=str(exc) if exc is not None else None,
            consumer_timeout=timed_out,
            running=consumer.running_count,
            dropped_reserved=dropped,
        )

    async def _on_consume_channel_reopened(self, channel: aio_pika.abc.AbstractRobustChannel | None) -> None:
        if channel is not None:  # a new underlying channel: it needs our cancel hook again
            underlay = await channel.get_underlay_channel()
            underlay.on_consumer_cancel_callbacks.add(self._on_consumer_cancelled)
        closed_at, self._consume_closed_at = self._consume_closed_at, None
        down_s = round(time.monotonic() - closed_at, 3) if closed_at is not None else None
        log.info("consume_channel_reopened", down_s=down_s, queues=self._queues.consuming())

    async def watch_consumers(self) -> None:
        """Log, until cancelled, a task queue that has gone unconsumed too long (and its return)."""
        # aio-pika restores consumers after a reconnect, a reopened channel or a broker-side cancel
        # (a deleted queue is declared again); this makes a worker that is not consuming loud.
        missing_since: float | None = None
        reported_at = 0.0
        while True:
            await asyncio.sleep(_CONSUMER_WATCH_S)
            missing = await self._missing_consumers()
            now = time.monotonic()
            if missing and missing_since is None:
                missing_since = now
            elif missing and missing_since is not None:
                if now - missing_since >= _CONSUMER_MISSING_LOUD_S and now - reported_at >= 60.0:
                    reported_at = now
                    log.error("consumer_missing", queues=missing, for_s=round(now - missing_since, 1))
            elif missing_since is not None:
                log.info("consumer_restored", down_s=round(now - missing_since, 3))
                missing_since, reported_at = None, 0.0

    async def _missing_consumers(self) -> list[str]:
        channel = self._consume_channel
        if self._queues.changing():
            return []
        if channel.is_closed:
            return self._queues.consuming()
        try:
            underlay = await asyncio.wait_for(channel.get_underlay_channel(), timeout=_CONSUMER_WATCH_S)
        except (TimeoutError, aio_pika.exceptions.AMQPError, RuntimeError):
            return self._queues.consuming()
        consumers = cast(aiormq.Channel, underlay).consumers
        return [queue for queue, tag in self._queues.tags().items() if tag not in consumers]

    def _on_consumer_cancelled(self, frame: spec.Basic.Cancel) -> None:
        queue = next((q for q, tag in self._queues.tags().items() if tag == frame.consumer_tag), None)
        log.warning("consumer_cancelled_by_broker", queue=queue, consumer_tag=frame.consumer_tag)
