"""The task-queue consumers: which task queues the worker consumes on its consume channel, and how.

The worker consumes each of its task queues with one consumer on the consume channel; control
commands add and cancel them (``add_consumer``, ``cancel_consumer``) and the pool sizer changes their
prefetch, which means subscribing each queue anew. ``QueueConsumers`` holds the queue → consumer-tag
map and the lock those changes take, so a change never races another or the consumer watchdog
(worker.amqp.channel_watch), which reads the map. It is apart from the service because it is the one
piece of state about the consume channel's subscriptions, with its own invariant (one consumer per
queue, every one at the current prefetch); the service wires it up and the control commands call it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.settings import Settings
from broker_svc.topology import dead_letter_queue, task_queue
from control.aio.declare import declare_queue

if TYPE_CHECKING:
    from worker.consume.consumer import TaskConsumer

__all__ = ["QueueConsumers"]

log = structlog.get_logger(__name__)


class QueueConsumers:
    """The consumers of the worker's task queues on its consume channel.

    Args:
        channel: the consume channel, its per-consumer QoS already set.
        settings: the client settings (each queue is declared with its configured type).
        consumer: the task consumer, which handles each queue's deliveries.
    """

    def __init__(
        self, channel: aio_pika.abc.AbstractChannel, *, settings: Settings, consumer: TaskConsumer
    ) -> None:
        self._channel = channel
        self._settings = settings
        self._consumer = consumer
        # Task queues consumed now: name → (queue, consumer tag).
        self._consuming: dict[str, tuple[aio_pika.abc.AbstractQueue, str]] = {}
        # Consumed but not shown in active_queues (Clockwork's own queues).
        self._unlisted: set[str] = set()
        self._fed: list[str] = []  # declared here, consumed by the pool's children (--children-consume)
        # Held while consumers are added, cancelled or re-subscribed (a new prefetch).
        self._consumers_lock = asyncio.Lock()

    def tags(self) -> dict[str, str]:
        """The consumer tag of each task queue consumed now."""
        return {queue: tag for queue, (_, tag) in self._consuming.items()}

    def changing(self) -> bool:
        """Whether consumers are being added, cancelled or re-subscribed right now."""
        return self._consumers_lock.locked()

    async def declare(self, queue: str) -> None:
        """Declare ``queue`` and its dead-letter queue (as Celery does) without consuming it.

        With ``--children-consume`` the pool children consume; the worker only declares.
        """
        await declare_queue(self._channel, dead_letter_queue(queue))
        queue_type = self._settings.queue_type(queue)
        await declare_queue(self._channel, task_queue(queue, queue_type=queue_type))
        if queue not in self._fed:
            self._fed.append(queue)

    def unfeed(self, queue: str) -> bool:
        """The pool's children stop consuming ``queue`` (``--children-consume``); whether they did."""
        if queue not in self._fed:
            return False
        self._fed.remove(queue)
        return True

    async def add(self, queue: str, *, listed: bool = True) -> str:
        """Declare ``queue`` (as Celery does) and consume it.

        ``listed=False``: one of Clockwork's own queues (``clockwork.expired``), consumed as a task
        queue but left out of ``active_queues``, which shows the queues a user asked for.
        """
        channel, consumer = self._channel, self._consumer
        if queue in self._consuming:
            return f"already consuming from {queue!r}"
        if not listed:
            self._unlisted.add(queue)
        await declare_queue(channel, dead_letter_queue(queue))
        queue_type = self._settings.queue_type(queue)  # as the clients declare it
        declared = await declare_queue(channel, task_queue(queue, queue_type=queue_type))
        async with self._consumers_lock:
            tag = await declared.consume(consumer.for_queue(queue))
            self._consuming[queue] = (declared, tag)
        log.info("consumer_added", queue=queue)
        return f"add consumer {queue}"

    async def cancel(self, queue: str) -> str:
        """Stop consuming ``queue``; deliveries already taken still run."""
        async with self._consumers_lock:
            entry = self._consuming.pop(queue, None)
            if entry is None:
                return f"not consuming from {queue}"
            declared, tag = entry
            try:
                await declared.cancel(tag)
            except aio_pika.exceptions.AMQPError as exc:
                log.warning("consumer_cancel_failed", queue=queue, error=str(exc))
        log.info("consumer_cancelled", queue=queue)
        return f"no longer consuming from {queue}"

    async def set_prefetch(self, count: int) -> None:
        """Give every task-queue consumer a per-consumer prefetch of ``count`` (never a global QoS).

        basic.qos binds only consumers created after it, so each queue is consumed anew, then its
        old consumer cancelled. Deliveries the old one took stay ours and are acked on this channel
        as usual; the broker no longer counts them against the new consumer, so until they finish
        the worker may hold them on top of the new prefetch.
        """
        channel, consumer = self._channel, self._consumer
        async with self._consumers_lock:
            try:
                await channel.set_qos(prefetch_count=count)  # per consumer (global=False)
                for queue, (declared, old_tag) in list(self._consuming.items()):
                    tag = await declared.consume(consumer.for_queue(queue))
                    self._consuming[queue] = (declared, tag)
                    await declared.cancel(old_tag)
            except (aio_pika.exceptions.AMQPError, aio_pika.exceptions.ChannelInvalidStateError) as exc:
                # The robust channel restores the new QoS, then the consumers, once it reconnects.
                log.warning("prefetch_change_failed", prefetch=count, error=str(exc))
                return
        log.info("prefetch_changed", prefetch=count, queues=list(self._consuming))

    def consuming(self) -> list[str]:
        """The task queues consumed now."""
        return list(self._consuming)

    def listed(self) -> list[str]:
        """The task queues consumed now that a user asked for (``active_queues``), by us or our children."""
        return [*self._fed, *(queue for queue in self._consuming if queue not in self._unlisted)]
