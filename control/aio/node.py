"""The mailbox node a worker runs: takes pidbox requests meant for it and answers them."""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.topology import DEFAULT_NAMESPACE, node_queue, reply_exchange
from broker_svc.wire import codec
from control.aio.declare import declare_queue
from control.protocol.commands import CommandRegistry
from control.protocol.request import CLOCK_HEADER, TICKET_HEADER, ControlRequest
from control.protocol.signing import ControlSecurity

__all__ = ["MailboxNode", "request_headers"]

log = structlog.get_logger(__name__)

# The headers of the request a handler is running for (a handler that needs them reads this).
request_headers: ContextVar[Mapping[str, Any] | None] = ContextVar("request_headers", default=None)

# Control requests are small, but a Celery peer's hello carries its whole revoked set (50,000 ids
# is about 5 MB of JSON); anything larger is refused unread.
MAX_REQUEST_BYTES = 16 * 1024 * 1024


class MailboxNode:
    """Consumes ``<nodename>.<ns>.pidbox`` and dispatches each request to the registry.

    Garbage (undecodable, wrong content type, oversized, malformed) is logged, never fatal. With a
    signing key or an allow-list, a request that fails the check (unsigned, bad signature, stale,
    replayed, sender not allowed) is refused before its body is decoded, and logged once with the
    reason. Replies go to the request's reply exchange and routing key, in the request's content
    type, with its ticket and this process's clock (signed with the key).

    Args:
        channel: an aio-pika channel for the mailbox.
        nodename: ``name@host``.
        registry: the command handlers.
        clock: the process's Lamport clock.
        accept: serializer names accepted for requests.
        namespace: the control namespace (Celery's ``control_exchange``).
        security: signing key, allow-list and our login (None: no checks, as Celery).
    """

    def __init__(
        self,
        channel: aio_pika.abc.AbstractChannel,
        *,
        nodename: str,
        registry: CommandRegistry,
        clock: LamportClock,
        accept: tuple[str, ...] = ("json", "msgpack"),
        namespace: str = DEFAULT_NAMESPACE,
        security: ControlSecurity | None = None,
    ) -> None:
        self._channel = channel
        self._nodename = nodename
        self._registry = registry
        self._clock = clock
        self._accept = codec.accept_set(accept)
        self._namespace = namespace
        self._reply_exchanges: dict[str, aio_pika.abc.AbstractExchange] = {}
        self._security = security or ControlSecurity()

    async def start(self) -> None:
        """Declare the node queue (bound to the fanout exchange) and start consuming."""
        queue = await declare_queue(self._channel, node_queue(self._nodename, self._namespace))
        await queue.consume(self._on_message, no_ack=True)

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            await self._handle(message)
        except Exception:  # the mailbox must outlive any request
            log.exception("control_request_failed")

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        refusal = self._security.check_received("request", message)
        if refusal is not None:
            log.warning(
                "control_request_refused",
                reason=str(refusal),
                user_id=message.user_id,
                size=len(message.body),
            )
            return
        try:
            body = codec.decode(
                message.body, message.content_type, accept=self._accept, max_bytes=MAX_REQUEST_BYTES
            )
            request = ControlRequest.from_wire(body)
        except MessageError as exc:
            log.warning("control_request_refused", reason="malformed", error=str(exc), size=len(message.body))
            return
        self._clock.adjust(headers.get(CLOCK_HEADER))
        if not request.is_for(self._nodename):
            return
        request_headers.set(headers)
        value = await self._registry.dispatch(request.method, request.arguments)
        if request.wants_reply and request.method != "shutdown":
            await self._reply(request, value, message.content_type)

    async def _reply(self, request: ControlRequest, value: Any, content_type: str | None) -> None:
        assert request.reply_to is not None and request.ticket is not None
        # Replies go out in the request's content type: a json-only Celery CLI aborts on msgpack.
        payload, ctype, encoding = codec.encode({self._nodename: value}, content_type or "json")
        exchange = await self._reply_exchange(request.reply_to.exchange)
        headers = self._security.sign(
            "reply",
            exchange=request.reply_to.exchange,
            body=payload,
            content_type=ctype,
            content_encoding=encoding,
            headers={TICKET_HEADER: request.ticket, CLOCK_HEADER: self._clock.forward()},
        )
        message = aio_pika.Message(
            payload,
            content_type=ctype,
            content_encoding=encoding,
            headers=headers,
            user_id=self._security.user_id,
        )
        await exchange.publish(message, routing_key=request.reply_to.routing_key)

    async def _reply_exchange(self, name: str) -> aio_pika.abc.AbstractExchange:
        exchange = self._reply_exchanges.get(name)
        if exchange is None:
            default = reply_exchange(self._namespace)
            exchange = await self._channel.declare_exchange(
                name, type=aio_pika.ExchangeType(default.type), **default.declare_options()
            )
            self._reply_exchanges[name] = exchange
        return exchange
