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

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec, dead_letter_queue
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
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        settings: Settings,
        consumer: TaskConsumer,
        connection: aio_pika.abc.AbstractRobustConnection | None = None,
    ) -> None:
        self._channel = channel
        self._connection = connection  # where an ordered queue gets a channel of its own
        self._settings = settings
        self._consumer = consumer
        # Task queues consumed now: name → (queue, consumer tag).
        self._consuming: dict[str, tuple[aio_pika.abc.AbstractQueue, str]] = {}
        # Consumed but not shown in active_queues (Clockwork's own queues).
        self._unlisted: set[str] = set()
        self._fed: list[str] = []  # declared here, consumed by the pool's children (--children-consume)
        # Held while consumers are added, cancelled or re-subscribed (a new prefetch).
        self._consumers_lock = asyncio.Lock()
        # Ordered queues consumed now, each on its own channel with prefetch 1 (``add``).
        self._ordered: dict[str, aio_pika.abc.AbstractChannel] = {}

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
        await self._declare_task_queue(self._channel, queue)
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
        declared = await self._declare_task_queue(channel, queue)  # as the clients declare it
        async with self._consumers_lock:
            if queue in self._settings.ordered_queues:
                # Its own channel with prefetch 1: one of its tasks at a time in this worker
                # (the broker picks one consumer of all workers), whatever the pool's prefetch.
                ordered = await self._ordered_channel()
                declared = await ordered.get_queue(queue, ensure=False)
                self._ordered[queue] = ordered
            tag = await declared.consume(consumer.for_queue(queue))
            self._consuming[queue] = (declared, tag)
        log.info("consumer_added", queue=queue)
        return f"add consumer {queue}"

    async def _declare_task_queue(
        self, channel: aio_pika.abc.AbstractChannel, queue: str
    ) -> aio_pika.abc.AbstractQueue:
        spec = self._settings.task_queue(queue)
        try:
            return await declare_queue(channel, spec)
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            # Never consume it as declared before: an ordered queue that is not would run its
            # tasks on every worker at once.
            raise ConfigurationError(declare_mismatch(queue, spec, str(exc))) from None

    async def _ordered_channel(self) -> aio_pika.abc.AbstractChannel:
        if self._connection is None:
            raise ConfigurationError("an ordered queue needs the worker's connection for its own channel")
        channel = await self._connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=1)
        return channel

    def ordered(self) -> list[str]:
        """The ordered queues consumed now (each on its own channel)."""
        return list(self._ordered)

    async def close_ordered(self) -> None:
        """Close the ordered queues' channels: the broker requeues what they hold, at the head,
        and makes the next consumer active in the same step (a cancel would let it start on the
        task behind first). Call once their running tasks are settled."""
        async with self._consumers_lock:
            for queue, channel in list(self._ordered.items()):
                self._consuming.pop(queue, None)
                del self._ordered[queue]
                try:
                    await channel.close()
                except aio_pika.exceptions.AMQPError as exc:
                    log.warning("ordered_channel_close_failed", queue=queue, error=str(exc))
                log.info("consumer_cancelled", queue=queue, ordered=True)

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

    async def set_prefetch(self, count: int) -> None:  # ordered queues keep their prefetch of 1
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
                    if queue in self._ordered:
                        continue
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


def declare_mismatch(queue: str, spec: QueueSpec, error: str) -> str:
    """What to say when the broker refused ``spec`` because ``queue`` exists with other arguments."""
    wanted = spec.arguments or "none"
    return (
        f"task queue {queue!r} exists with other arguments than this worker declares ({wanted}); "
        f"the broker said: {error}. An ordered queue (--ordered-queues, task_ordered_queues) or a "
        "quorum queue must be declared so by every client and worker from its creation: delete "
        f"the queue (rabbitmqctl delete_queue {queue}) once drained, or make the settings agree"
    )
