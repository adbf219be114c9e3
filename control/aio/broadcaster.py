"""Broadcasting from inside an asyncio process (aio-pika): a worker's own requests, such as Mingle's hello.

The same pidbox format and the same reply collection as the blocking client (``control.blocking.client``),
on the worker's connection: a reply queue of its own, and membership read from the members stream
so a call returns once every live peer has answered.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Mapping
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.topology import (
    DEFAULT_NAMESPACE,
    control_reply_queue,
    members_stream,
    pidbox_exchange,
)
from broker_svc.wire import codec
from control.aio.declare import declare_queue
from control.protocol.collector import ReplyCollector
from control.protocol.membership import Membership
from control.protocol.request import (
    CLOCK_HEADER,
    EXPIRES_HEADER,
    MARKER_HEADER,
    ControlRequest,
    Matcher,
    ReplyAddress,
)
from control.protocol.signing import ControlSecurity

__all__ = ["AsyncBroadcaster", "declare_members_stream", "read_members"]

log = structlog.get_logger(__name__)

# Hello replies carry revoked sets: allow big ones (bounded all the same).
MAX_REPLY_BYTES: Final = 16 * 1024 * 1024
_LOOKBACK_S: Final = 60.0
_ACCEPT: Final = codec.accept_set(("json", "msgpack"))


async def read_members(
    channel: aio_pika.abc.AbstractChannel, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 2.0
) -> set[str] | None:
    """The workers alive now, from the members stream; None when that is unknown (no stream, not
    read in time, or no worker event in the last minute).

    Reads the last minute of worker events, up to a marker of our own, so what it returns is
    everything the stream knew when it was called.
    """
    spec = members_stream(namespace)
    membership = Membership()
    marker = str(uuid.uuid4())
    seen = asyncio.get_running_loop().create_future()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if (message.headers or {}).get(MARKER_HEADER) == marker:
            if not seen.done():
                seen.set_result(None)
        elif MARKER_HEADER not in (message.headers or {}):
            try:
                body = message.body
                membership.feed_body(
                    codec.decode(body, message.content_type, accept=_ACCEPT, max_bytes=MAX_REPLY_BYTES)
                )
            except MessageError:
                membership.ignored += 1
        await message.ack()

    try:
        await channel.set_qos(prefetch_count=1000)
        queue = await declare_queue(channel, spec)
        since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=_LOOKBACK_S)
        tag = await queue.consume(on_message, arguments={"x-stream-offset": since})
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"", headers={MARKER_HEADER: marker}), routing_key=spec.name
            )
            await asyncio.wait_for(seen, timeout_s)
        finally:
            await queue.cancel(tag)
    except (TimeoutError, aio_pika.exceptions.AMQPError) as exc:
        log.warning("members_unavailable", error=str(exc) or type(exc).__name__)
        return None
    if not len(membership):
        return None  # a stream with no worker events yet (just created): we know nothing
    return membership.alive(time.time())


async def declare_members_stream(
    channel: aio_pika.abc.AbstractChannel, namespace: str = DEFAULT_NAMESPACE
) -> None:
    """Make sure the members stream exists and is bound, so the events we send next are kept."""
    await declare_queue(channel, members_stream(namespace))


class AsyncBroadcaster:
    """Sends pidbox requests and collects the replies, on one channel.

    Args:
        channel: a channel of its own (the reply queue's consumer lives on it).
        clock: the process clock (forwarded on send, adjusted by every reply).
        namespace: the control namespace.
        serializer: how requests are encoded (json: every Celery node accepts it).
        security: signs requests and, with a key, refuses replies that fail the check.
    """

    def __init__(
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        clock: LamportClock,
        namespace: str = DEFAULT_NAMESPACE,
        serializer: str = "json",
        security: ControlSecurity | None = None,
    ) -> None:
        self._channel = channel
        self._clock = clock
        self._namespace = namespace
        self._serializer = serializer
        self._collectors: dict[str, tuple[ReplyCollector, asyncio.Event]] = {}
        self._reply_spec = control_reply_queue(namespace)
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._security = security or ControlSecurity()

    async def start(self) -> None:
        """Declare the exchanges (as Celery does) and our reply queue, and consume it."""
        spec = pidbox_exchange(self._namespace)
        self._exchange = await self._channel.declare_exchange(
            spec.name, type=aio_pika.ExchangeType(spec.type), **spec.declare_options()
        )
        queue = await declare_queue(self._channel, self._reply_spec)
        await queue.consume(self._on_reply, no_ack=True)

    async def call(
        self,
        method: str,
        arguments: Mapping[str, Any],
        *,
        expected: frozenset[str] | None,
        timeout_s: float,
        destination: tuple[str, ...] | None = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        limit: int | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> ReplyCollector:
        """Broadcast ``method`` and wait for ``expected`` nodes (None: for ``timeout_s``).

        ``destination``/``pattern``/``matcher`` choose the nodes as for the blocking client;
        ``limit`` stops after that many answered; ``headers`` are extra message headers.
        """
        reply = self._reply_spec
        assert reply.exchange is not None
        request = ControlRequest(
            method=method,
            arguments=dict(arguments),
            destination=destination,
            pattern=pattern if destination is None else None,
            matcher=matcher if destination is None and pattern is not None else None,
            ticket=ControlRequest.new_ticket(),
            reply_to=ReplyAddress(reply.exchange.name, reply.routing_key),
        )
        assert request.ticket is not None
        loop = asyncio.get_running_loop()
        collector = ReplyCollector(
            request.ticket, expected=None, limit=limit, timeout_s=timeout_s, now=loop.time()
        )
        if expected is not None:
            collector.expect(expected)
        arrived = asyncio.Event()
        self._collectors[request.ticket] = (collector, arrived)
        try:
            await self._publish(request, timeout_s=timeout_s, headers=headers)
            while not collector.done(loop.time()):
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), max(0.0, collector.deadline - loop.time()))
                except TimeoutError:
                    break
        finally:
            self._collectors.pop(request.ticket, None)
        return collector

    async def cast(
        self,
        method: str,
        arguments: Mapping[str, Any],
        *,
        destination: tuple[str, ...] | None = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Send ``method`` to the nodes it is for, asking for no reply."""
        request = ControlRequest(
            method=method,
            arguments=dict(arguments),
            destination=destination,
            pattern=pattern if destination is None else None,
            matcher=matcher if destination is None and pattern is not None else None,
        )
        await self._publish(request, timeout_s=1.0, headers=headers)

    async def _publish(
        self, request: ControlRequest, *, timeout_s: float, headers: Mapping[str, Any] | None
    ) -> None:
        assert self._exchange is not None, "start() first"
        payload, ctype, encoding = codec.encode(request.to_wire(), self._serializer)
        # Header values are ints, never floats (DESIGN §2); kombu only reads ``expires`` as a number.
        signed = self._security.sign(
            "request",
            exchange=self._exchange.name,
            body=payload,
            content_type=ctype,
            content_encoding=encoding,
            headers={
                CLOCK_HEADER: self._clock.forward(),
                EXPIRES_HEADER: int(time.time() + timeout_s) + 1,
                **(headers or {}),
            },
        )
        message = aio_pika.Message(
            payload,
            content_type=ctype,
            content_encoding=encoding,
            headers=signed,
            user_id=self._security.user_id,
        )
        await self._exchange.publish(message, routing_key="")

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        if self._security.signing:  # a keyed worker trusts only keyed peers' hello replies
            refusal = self._security.check_received("reply", message)
            if refusal is not None:
                log.warning("control_reply_refused", reason=str(refusal), size=len(message.body))
                return
        self._clock.adjust(headers.get(CLOCK_HEADER))
        try:
            body = codec.decode(message.body, message.content_type, accept=_ACCEPT, max_bytes=MAX_REPLY_BYTES)
        except MessageError as exc:
            log.warning("control_reply_refused", error=str(exc), size=len(message.body))
            return
        for collector, arrived in list(self._collectors.values()):
            if collector.offer(headers, body):
                arrived.set()
                return
