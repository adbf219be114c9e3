"""What the worker publishes: results to ``reply_to``, dead letters, republished copies, follow-up tasks."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions
import structlog
from aiormq import spec

from broker_svc.clock import LamportClock
from broker_svc.errors import Unroutable
from broker_svc.topology import (
    DEAD_LETTER_ERROR_HEADER,
    DEAD_LETTER_QUEUE_HEADER,
    DEAD_LETTER_REASON_HEADER,
    QueueSpec,
    dead_letter_queue,
)
from broker_svc.wire import codec
from broker_svc.wire.result_message import Outcome, wire_exception
from broker_svc.wire.states import State
from broker_svc.wire.task_message import CLOCK_HEADER, WireMessage
from control.aio.declare import declare_queue

__all__ = ["ReplyPublisher", "copy_message", "task_properties"]

log = structlog.get_logger(__name__)

# How often to look at a closed channel that aio-pika has not yet seen close.
_REOPEN_POLL_S = 0.05


class ReplyPublisher:
    """Publishes on its own confirm-mode channel, so a refused publish never closes the consumers'.

    Every publish waits for the broker's confirm; callers ack a delivery only after that.
    """

    def __init__(
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        clock: LamportClock,
        persistent: bool,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self._channel = channel
        self._clock = clock
        # Called with each confirmed publish's kind and seconds to its confirm (the metrics).
        self._observe = observe
        self._delivery_mode = (
            aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
        ).value

    @property
    def is_open(self) -> bool:
        """Whether this publisher's channel is open now."""
        return not self._channel.is_closed

    async def until_open(self, *, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until this publisher's channel is open; whether it is.

        After a lost connection the robust channel reopens once its connection is back.
        """
        channel = self._channel
        try:
            async with asyncio.timeout(timeout_s):
                while channel.is_closed:
                    if isinstance(channel, aio_pika.abc.AbstractRobustChannel):
                        await channel.ready()
                    if channel.is_closed:
                        # aio-pika learns of a close from aiormq a moment later (its callbacks run
                        # as tasks): until then ``ready`` returns at once, so look again shortly.
                        await asyncio.sleep(_REOPEN_POLL_S)
        except TimeoutError:
            return False
        return True

    async def publish_result(
        self,
        outcome: Outcome,
        *,
        reply_to: str,
        correlation_id: str | None,
        content_type: str,
        expiration: str | None = None,
    ) -> None:
        """Send a result in the request's content type (Celery's rpc format); ``expiration``: its TTL
        in ms (``result_ttl``).

        A result nobody can receive (its client and queue are gone) is logged and dropped.
        """
        body = outcome.to_wire()
        try:
            payload, ctype, encoding = codec.encode(body, content_type)
        except (TypeError, ValueError, OverflowError) as exc:
            # The value survived msgpack in the child but not this codec (json): report that.
            error = wire_exception("EncodeError", f"result cannot be encoded as {content_type}: {exc}")
            fallback = Outcome(task_id=outcome.task_id, status=State.FAILURE, result=error)
            payload, ctype, encoding = codec.encode(fallback.to_wire(), content_type)
        # One result per task: its properties are built here rather than through an aio_pika.Message
        # (a dozen checked attribute sets, then the same Properties again), with the same values.
        properties = spec.Basic.Properties(
            content_type=ctype,
            content_encoding=encoding,
            correlation_id=correlation_id or outcome.task_id,
            delivery_mode=self._delivery_mode,
            priority=0,
            headers={CLOCK_HEADER: self._clock.forward()},
            expiration=expiration,
        )
        try:
            await self._send(payload, properties, reply_to, kind="result")
        except (aio_pika.exceptions.DeliveryError, Unroutable):
            # Its client and result queue are gone (a caller that sent and left, which is normal):
            # nobody can receive it any more.
            log.info("result_unroutable", reply_to=reply_to, task_id=outcome.task_id)

    async def dead_letter(
        self, message: aio_pika.abc.AbstractIncomingMessage, *, queue: str, reason: str, error: str
    ) -> None:
        """Keep a message that must not run in ``<queue>.dead``, with why; confirmed before return.

        Raises:
            aio_pika.exceptions.AMQPError: the broker did not take it (the caller must not ack).
            Unroutable: the dead-letter queue is gone (the caller must not ack).
        """
        headers: dict[str, Any] = dict(message.headers or {})
        headers[DEAD_LETTER_REASON_HEADER] = reason
        headers[DEAD_LETTER_ERROR_HEADER] = error[:1024]
        headers[DEAD_LETTER_QUEUE_HEADER] = queue
        headers["x-clockwork-dead-at"] = dt.datetime.now(dt.UTC).isoformat()
        spec = dead_letter_queue(queue)
        copy = copy_message(message, headers)
        try:
            await self._publish(copy, spec.name, kind="dead_letter")
        except Unroutable:
            # Someone deleted the dead-letter queue: make it again rather than loop on redelivery.
            await self._channel.declare_queue(spec.name, durable=spec.durable)
            await self._publish(copy, spec.name, kind="dead_letter")
        log.warning("task_dead_lettered", reason=reason, error=error[:200], queue=queue)

    async def republish(
        self,
        message: aio_pika.abc.AbstractIncomingMessage,
        *,
        queue: str,
        headers: dict[str, Any],
        drop: Iterable[str] = (),
        body: bytes | None = None,
    ) -> None:
        """Put a copy back on ``queue`` with changed headers; confirmed before return.

        Args:
            message: the delivery to copy.
            queue: where the copy goes (through the default exchange).
            headers: headers to set on the copy.
            drop: headers the copy must not carry (e.g. a broker's count that restarts with it).
            body: the copy's body, if not the delivery's.

        Raises:
            aio_pika.exceptions.AMQPError: the broker did not take it (the caller must not ack).
        """
        merged = dict(message.headers or {})
        for name in drop:
            merged.pop(name, None)
        merged.update(headers)
        await self._publish(copy_message(message, merged, body=body), queue, kind="republish")

    async def publish_task(self, wire: WireMessage, *, queue: QueueSpec) -> None:
        """Send a task a finished task asked for (a chain's next step, a callback); confirmed.

        A queue nobody declared yet is declared as Celery's client would, and the task sent again.

        Raises:
            aio_pika.exceptions.AMQPError: the broker did not take it (the caller must not ack).
        """
        properties = task_properties(wire, self._clock)
        try:
            await self._send(wire.body, properties, queue.name, kind="task")
        except Unroutable:
            await declare_queue(self._channel, queue)  # as the worker's settings declare it
            await self._send(wire.body, properties, queue.name, kind="task")

    async def publish_to(
        self,
        body: bytes,
        *,
        content_type: str,
        encoding: str,
        queue: QueueSpec,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Send a persistent message to one of Clockwork's own queues, declaring it if missing; confirmed.

        Raises:
            aio_pika.exceptions.AMQPError: the broker did not take it (the caller must not ack).
        """
        properties = spec.Basic.Properties(
            content_type=content_type,
            content_encoding=encoding,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT.value,
            headers={**(headers or {}), CLOCK_HEADER: self._clock.forward()},
        )
        try:
            await self._send(body, properties, queue.name, kind="internal")
        except Unroutable:
            await declare_queue(self._channel, queue)
            await self._send(body, properties, queue.name, kind="internal")

    async def _publish(self, message: aio_pika.Message, routing_key: str, *, kind: str) -> None:
        await self._send(message.body, message.properties, routing_key, kind=kind)

    async def _send(
        self, body: bytes, properties: spec.Basic.Properties, routing_key: str, *, kind: str
    ) -> None:
        # What ``default_exchange.publish`` does, less building a Message: aio-pika's channel
        # check, then the underlying aiormq channel's ``basic_publish``.
        if self._channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self._channel!r} closed")
        channel = await self._channel.get_underlay_channel()
        started = time.monotonic() if self._observe is not None else 0.0
        result = await channel.basic_publish(
            body, exchange="", routing_key=routing_key, properties=properties, mandatory=True
        )
        # aiormq hands a basic.return back as the publish's result instead of raising; a copy
        # no queue took must not count as kept, or the caller would ack the original away.
        if isinstance(result, aiormq.abc.DeliveredMessage):
            raise Unroutable(f"no queue {routing_key!r} took the message")
        if self._observe is not None:
            self._observe(kind, time.monotonic() - started)


def task_properties(wire: WireMessage, clock: LamportClock) -> spec.Basic.Properties:
    """The AMQP properties of an encoded task the worker sends, stamped with the worker's clock."""
    return spec.Basic.Properties(
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        headers={**wire.headers, CLOCK_HEADER: clock.forward()},
        delivery_mode=wire.delivery_mode,
        correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
        priority=wire.priority,
        expiration=wire.expiration,
    )


def copy_message(
    message: aio_pika.abc.AbstractIncomingMessage, headers: dict[str, Any], *, body: bytes | None = None
) -> aio_pika.Message:
    """A persistent copy of a delivery to publish elsewhere: same body (or ``body``) and properties.

    The copy has no ``expiration``: the ``expires`` header, which the worker checks, is what ends
    a task's life; a per-message TTL restarted on the copy would only be wrong.
    """
    return aio_pika.Message(
        message.body if body is None else body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        expiration=None,  # nor must it expire in the dead-letter queue
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )
