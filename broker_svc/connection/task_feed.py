"""Task queues consumed with manual acks on the blocking side's connection (a consuming pool child).

``TaskFeed`` lives on ``BrokerConnection``'s I/O thread: on each new channel it sets the prefetch and
consumes the queues; each delivery goes to a callback as a ``TaskDelivery`` stamped with the
channel's *generation*. Acks and nacks come from any thread through the connection. A settle of
an earlier generation is dropped, never sent: that channel is gone, the broker has requeued the
delivery, and its tag would close the new channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.channel
import pika.frame
import pika.spec

from broker_svc.library_log import get_logger

__all__ = ["TaskDelivery", "TaskFeed"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TaskDelivery:
    """One delivery from a task queue, with what settling and copying it needs."""

    body: bytes
    queue: str
    routing_key: str
    exchange: str
    redelivered: bool
    tag: int
    generation: int
    content_type: str | None
    content_encoding: str | None
    headers: dict[str, Any]
    correlation_id: str | None
    reply_to: str | None
    priority: int | None
    message_id: str | None = None
    timestamp: int | None = None
    type: str | None = None
    app_id: str | None = None


class TaskFeed:
    """The consuming side of one connection: prefetch, consumers, settles (I/O thread only).

    Args:
        queues: the task queues to consume.
        prefetch: unacked deliveries the broker may send this channel at once.
        on_delivery: called on the I/O thread with each delivery; it must hand it over and return.
    """

    def __init__(
        self, queues: Sequence[str], *, prefetch: int, on_delivery: Callable[[TaskDelivery], None]
    ) -> None:
        self.queues = tuple(queues)
        self.prefetch = prefetch
        self._on_delivery = on_delivery
        self.generation = 0
        self._channel: pika.channel.Channel | None = None
        self._tags: list[str] = []
        self.consuming = False
        self._stopped = False

    def start(self, channel: pika.channel.Channel) -> None:
        """A new channel is open: set the prefetch and consume every queue on it."""
        self.generation += 1
        self._channel = channel
        self._tags = []
        if self._stopped:
            return
        generation = self.generation

        def consume(_frame: pika.frame.Method) -> None:
            for queue in self.queues:
                self._tags.append(
                    channel.basic_consume(queue, self._handler(queue, generation), auto_ack=False)
                )
            self.consuming = True
            log.debug("task_feed_consuming", queues=list(self.queues), prefetch=self.prefetch)

        channel.basic_qos(prefetch_count=self.prefetch, callback=consume)

    def lost(self) -> None:
        """The channel closed: what it delivered is the broker's again."""
        self._channel = None
        self._tags = []
        self.consuming = False

    def settle(self, delivery: TaskDelivery, *, ack: bool, requeue: bool) -> bool:
        """Ack (or nack) ``delivery`` if its channel is still the open one; whether it was sent."""
        channel = self._channel
        if channel is None or not channel.is_open or delivery.generation != self.generation:
            log.info("task_settle_dropped_channel_gone", tag=delivery.tag, queue=delivery.queue)
            return False
        if ack:
            channel.basic_ack(delivery.tag)
        else:
            channel.basic_nack(delivery.tag, requeue=requeue)
        return True

    def stop(self, on_done: Callable[[], None]) -> None:
        """Cancel every consumer (no new deliveries, also after a reconnect); ``on_done`` once cancelled."""
        self._stopped = True
        channel, tags = self._channel, list(self._tags)
        self._tags = []
        self.consuming = False
        if channel is None or not channel.is_open or not tags:
            on_done()
            return
        left = len(tags)

        def cancelled(_frame: pika.frame.Method) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                on_done()

        for tag in tags:
            channel.basic_cancel(tag, callback=cancelled)

    def _handler(self, queue: str, generation: int) -> Callable[..., None]:
        on_delivery = self._on_delivery

        def on_message(
            _ch: pika.channel.Channel,
            method: pika.spec.Basic.Deliver,
            props: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:
            delivery = TaskDelivery(
                body=body,
                queue=queue,
                routing_key=method.routing_key,
                exchange=method.exchange,
                redelivered=bool(method.redelivered),
                tag=method.delivery_tag,
                generation=generation,
                content_type=props.content_type,
                content_encoding=props.content_encoding,
                headers=props.headers or {},
                correlation_id=props.correlation_id,
                reply_to=props.reply_to,
                priority=props.priority,
                message_id=props.message_id,
                timestamp=props.timestamp,
                type=props.type,
                app_id=props.app_id,
            )
            try:
                on_delivery(delivery)
            except Exception:
                # The delivery stays unacked on this channel; log loudly, the broker keeps it.
                log.exception("task_feed_callback_failed", queue=queue)

        return on_message
