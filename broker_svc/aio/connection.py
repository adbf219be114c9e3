"""The asyncio client's connection (aio-pika): confirmed publishes on one channel, a reply queue.

One robust connection and one channel in confirm mode. Every send awaits its own confirm while
others are in flight (aiormq keeps a future per delivery tag), so ten thousand concurrent sends
share the channel as the blocking client's pipelined confirms do. When the connection drops,
aio-pika reconnects and restores the reply queue's consumer; a send that fails meanwhile waits for
the reconnect and goes again, marked as resent, until ``reconnect_window_s`` has passed, then
raises ``BrokerUnavailable``, as the blocking client does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq
import aiormq.abc
import pamqp.commands

from broker_svc.aio.properties import EncodedProperties
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import BrokerUnavailable, PublishError, PublishNacked, Unroutable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec

__all__ = ["AioConnection", "OnReply", "connect_any"]

log = get_logger(__name__)

OnReply = Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]

# Pause between connection attempts, doubled up to the cap, within ``reconnect_window_s``.
_FIRST_PAUSE_S: Final = 0.2
_MAX_PAUSE_S: Final = 2.0
# aio-pika's pause before each reconnect attempt (its default is 5 s).
_RECONNECT_INTERVAL_S: Final = 0.5
# What a lost connection or channel raises from a publish or a declare.
_LOST: Final = (
    *aio_pika.exceptions.CONNECTION_EXCEPTIONS,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
# What a refusal raises (the channel is closed by it, the connection stays).
_REFUSED: Final = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelAccessRefused,
)


class AioConnection:
    """One robust connection, a confirm-mode channel on it, and a consumed reply queue.

    Args:
        settings: broker URL(s), timeouts, ``reconnect_window_s``, ``heartbeat_s``.
        name: the connection name the broker shows.
        reply_queue: the queue results come to (declared, consumed with auto-ack).
        on_reply: called with every message on the reply queue.
    """

    def __init__(self, settings: Settings, *, name: str, reply_queue: QueueSpec, on_reply: OnReply) -> None:
        self._settings = settings
        self._name = name
        self._reply_spec = reply_queue
        self._on_reply = on_reply
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._reply: tuple[aio_pika.abc.AbstractRobustQueue, str] | None = None
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        # Queues declared on this connection: a send declares its queue once, and every
        # concurrent send for that queue waits on the same declare.
        self._declared: dict[str, asyncio.Future[None]] = {}
        self._closed = False
        # Set while the connection is believed up: cleared by a send that finds it lost, set again
        # once aio-pika has reconnected and restored the channel. ``_generation`` counts the
        # reconnects, so a send that failed on an older connection does not wait for a newer one.
        self._up = asyncio.Event()
        self._generation = 0

    @property
    def is_open(self) -> bool:
        """True once opened and not closed."""
        return self._connection is not None and not self._closed

    async def open(self) -> None:
        """Connect (trying each broker URL, again and again until ``reconnect_window_s``), declare
        and consume the reply queue.

        Raises:
            BrokerUnavailable: no broker could be reached within ``reconnect_window_s``.
        """
        deadline = time.monotonic() + self._settings.reconnect_window_s
        pause = _FIRST_PAUSE_S
        while True:
            try:
                self._connection = await connect_any(self._settings, name=self._name)
                break
            except BrokerUnavailable:
                if time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)  # backoff between attempts, not a poll for a result
            pause = min(pause * 2, _MAX_PAUSE_S)
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        channel = await self._connection.channel(publisher_confirms=True)
        self._channel = channel
        queue = await channel.declare_queue(self._reply_spec.name, **self._reply_spec.declare_options())
        self._reply = (queue, await queue.consume(self._on_reply, no_ack=True))
        self._up.set()

    def _on_reconnect(self, *_args: Any) -> None:
        # Called once aio-pika has restored the channel and the reply queue's consumer. A new
        # connection knows none of our declares (a queue may have been deleted meanwhile).
        log.info("aio_client_reconnected", connection=self._name)
        self._declared.clear()
        self._generation += 1
        self._up.set()

    async def publish(self, pending: PendingPublish) -> None:
        """Send one task and wait for its confirm; send it again after a lost connection.

        Raises:
            Unroutable: the broker returned it (no queue for its routing key).
            PublishNacked: the broker refused it.
            PublishError: no confirm within ``confirm_timeout_s``.
            BrokerUnavailable: the connection did not come back within ``reconnect_window_s``.
        """
        deadline = time.monotonic() + self._settings.reconnect_window_s
        while True:
            generation = self._generation
            pending.route(time.time())
            properties = EncodedProperties(pending)
            try:
                await self._declare_all(pending.declare)
                confirm = await self._basic_publish(pending, properties)
            except _REFUSED as exc:
                # A refusal of the broker (a 406 on a declare, a 404 exchange) closed the channel:
                # sending again cannot help. Open a fresh channel for the sends after this one.
                await self._reopen_channel()
                raise PublishError(f"the broker refused the task for {pending.routing_key!r}: {exc}") from exc
            except _LOST as exc:
                if self._closed or time.monotonic() >= deadline:
                    raise BrokerUnavailable(f"broker {self._settings.safe_broker_url}: {exc!r}") from exc
                await self._wait_connected(deadline, exc, generation)
                pending.attempts += 1  # its RESENT header says it may be a duplicate
                continue
            except TimeoutError as exc:
                raise PublishError(f"no confirm within {self._settings.confirm_timeout_s} s") from exc
            if isinstance(confirm, aiormq.abc.DeliveredMessage):
                raise Unroutable(f"no queue took the task for routing key {pending.routing_key!r}")
            if isinstance(confirm, pamqp.commands.Basic.Nack):
                raise PublishNacked(f"the broker refused the task for {pending.routing_key!r}")
            return

    async def publish_side(self, record: PendingPublish) -> None:
        """Send a side record (``best_effort``: a park record) once, beside the tasks it belongs
        to; never raises: how it ended is its ``settle`` (its ``on_settle`` logs a failure).

        One attempt with no declaration: a lost connection or a refusal costs the record, never
        a wait for a reconnect nor a task's channel.
        """
        error: PublishError | None = None
        try:
            confirm = await self._basic_publish(record, EncodedProperties(record))
        except (*_LOST, *_REFUSED, TimeoutError) as exc:
            error = PublishError(f"not written to {record.routing_key!r}: {exc!r}")
        else:
            if isinstance(confirm, pamqp.commands.Basic.Nack):
                error = PublishNacked(f"the broker refused the record for {record.routing_key!r}")
        record.settle(error)

    async def _reopen_channel(self) -> None:
        channel, connection = self._channel, self._connection
        if channel is not None and channel.is_closed and connection is not None and not connection.is_closed:
            try:
                await channel.reopen()
            except _LOST as exc:
                log.warning("aio_channel_reopen_failed", error=repr(exc))

    async def _basic_publish(
        self, pending: PendingPublish, properties: EncodedProperties
    ) -> aiormq.abc.ConfirmationFrameType | None:
        channel = self._channel
        if channel is None or channel.is_closed:
            raise aio_pika.exceptions.ChannelInvalidStateError("the channel is closed")
        underlay = await channel.get_underlay_channel()
        return await underlay.basic_publish(
            pending.message.body,
            exchange=pending.exchange,
            routing_key=pending.routing_key,
            properties=properties,
            mandatory=pending.mandatory,
            timeout=self._settings.confirm_timeout_s,
        )

    async def _wait_connected(self, deadline: float, error: BaseException, generation: int) -> None:
        if generation == self._generation:  # lost on the current connection: wait for the next
            self._up.clear()
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait_for(self._up.wait(), remaining)
        except TimeoutError:
            raise BrokerUnavailable(
                f"broker {self._settings.safe_broker_url}: not back within "
                f"{self._settings.reconnect_window_s} s ({error!r})"
            ) from error

    async def _declare_all(self, specs: tuple[QueueSpec, ...]) -> None:
        for spec in specs:
            done = self._declared.get(spec.name)
            if done is None:
                done = self._declared[spec.name] = asyncio.ensure_future(self._declare(spec))
                done.add_done_callback(self._forget_failed(spec.name))
            await asyncio.shield(done)

    def _forget_failed(self, name: str) -> Callable[[asyncio.Future[None]], None]:
        def forget(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is not None:
                if self._declared.get(name) is future:
                    del self._declared[name]

        return forget

    async def _declare(self, spec: QueueSpec) -> None:
        # The flags come from topology, as for the blocking declarer (a difference is a 406).
        channel = self._channel
        if channel is None or channel.is_closed:
            raise aio_pika.exceptions.ChannelInvalidStateError("the channel is closed")
        queue = await channel.declare_queue(spec.name, robust=False, **spec.declare_options())
        exchange = spec.exchange
        if exchange is not None:
            declared = await channel.declare_exchange(
                exchange.name,
                type=aio_pika.ExchangeType(exchange.type),
                robust=False,
                **exchange.declare_options(),
            )
            await queue.bind(declared, routing_key=spec.routing_key, robust=False)

    async def close(self, *, delete_reply_queue: bool = True) -> None:
        """Delete the reply queue (unless told not to) and close the connection."""
        if self._closed:
            return
        self._closed = True
        connection, channel = self._connection, self._channel
        if connection is None:
            return
        try:
            if delete_reply_queue and channel is not None and not channel.is_closed:
                if self._reply is not None:  # cancelled first: a deleted queue's consumer is logged
                    queue, tag = self._reply
                    await asyncio.wait_for(queue.cancel(tag), 2.0)
                await asyncio.wait_for(channel.queue_delete(self._reply_spec.name), 2.0)
        except (*_LOST, TimeoutError, aio_pika.exceptions.AMQPError):
            pass  # its x-expires removes it later
        finally:
            await connection.close()


async def connect_any(settings: Settings, *, name: str) -> aio_pika.abc.AbstractRobustConnection:
    """A robust connection to the first broker URL that answers, in failover order.

    Shared by the asyncio client and ``AsyncControl``. The robust connection reconnects by itself
    afterwards (to the URL it first reached).

    Raises:
        BrokerUnavailable: no URL answered (the last error is named).
    """
    error: BaseException | None = None
    for url in settings.broker_urls:
        try:
            return await aio_pika.connect_robust(
                url,
                timeout=settings.connect_timeout_s,
                ssl_context=settings.tls_context(url),
                client_properties={"connection_name": name},
                heartbeat=settings.heartbeat_s,
                reconnect_interval=_RECONNECT_INTERVAL_S,
            )
        except (*_LOST, TimeoutError) as exc:
            error = exc
    raise BrokerUnavailable(f"broker {settings.safe_broker_url}: {error!r}") from error
