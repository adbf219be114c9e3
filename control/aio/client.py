"""The control client for asyncio programs (aio-pika): ping, inspect, revoke, as ``app.control`` does.

The same pidbox requests and reply collection as the blocking client (``control.blocking.client``),
through the broadcaster a worker uses for Mingle (``control.aio.broadcaster``). Before a call
addressed to everyone it reads the members stream (``read_members``), so the call returns as soon
as every live worker has answered; the timeout is only the upper bound.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq.abc

from broker_svc.aio.connection import connect_any
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerUnavailable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import DEFAULT_NAMESPACE, revocation_log
from control.aio.broadcaster import AsyncBroadcaster, read_members
from control.aio.declare import declare_queue
from control.aio.header_ints import install_header_int_guard
from control.protocol.replies import BroadcastResult, InspectReply, RevokeResult
from control.protocol.request import CLOCK_HEADER, ControlRequest, Matcher, flatten_replies
from control.protocol.revoke_log import CONTENT_TYPE as REVOKE_CONTENT_TYPE
from control.protocol.revoke_log import LOGGED_HEADER, RevokeEntry
from control.protocol.signing import ControlSecurity

if TYPE_CHECKING:
    from broker_svc.app import App

__all__ = ["AsyncControl"]

log = get_logger(__name__)

Destination = str | Sequence[str] | None


class AsyncControl:
    """Remote control of the workers from asyncio: ``await control.ping()``, ``inspect``, ``revoke``.

    Use it as ``async with AsyncControl.from_app(app) as control:`` on one event loop.

    Args:
        settings: the broker URL and connection timeouts.
        namespace: the mailbox namespace (Celery's ``control_exchange``).
        clock: the process's Lamport clock (forwarded on send, adjusted from every reply).
        serializer: how requests are encoded (json: what every Celery worker accepts).
        hostname: this client's name in revocation log entries and the connection name.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        clock: LamportClock | None = None,
        serializer: Literal["json", "msgpack"] = "json",
        hostname: str | None = None,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.clock = clock or LamportClock()
        self.hostname = hostname or f"actl{os.getpid()}@{socket.gethostname()}"
        self.security = ControlSecurity.from_settings(settings)
        self._serializer = serializer
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._members_connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._broadcaster: AsyncBroadcaster | None = None
        self._members_channel: aio_pika.abc.AbstractChannel | None = None
        self._log_channel: aio_pika.abc.AbstractChannel | None = None

    @classmethod
    def from_app(cls, app: App, **options: Any) -> AsyncControl:
        """The control client of ``app``: its settings and clock."""
        return cls(app.settings, clock=app.clock, **options)

    async def __aenter__(self) -> AsyncControl:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect, declare the mailbox exchanges and consume this client's reply queue.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        if self._broadcaster is not None:
            return
        # Control requests carry small ints in their headers: sent as pamqp picks them, py-amqp
        # before 5.4.2 (older Celery workers) misreads them. This process's pamqp, from now on.
        install_header_int_guard()
        self._connection = await connect_any(self.settings, name=f"clockwork-aio-control {self.hostname}")
        broadcaster = AsyncBroadcaster(
            await self._connection.channel(),
            clock=self.clock,
            namespace=self.namespace,
            serializer=self._serializer,
            security=self.security,
        )
        await broadcaster.start()
        # The members stream is read on a connection of its own: a read that races the stream's
        # start (workers declaring it this very moment) gets a 541 that closes its whole
        # connection, which must not take the reply queue, and the replies of calls under way, along.
        self._members_connection = await connect_any(
            self.settings, name=f"clockwork-aio-control {self.hostname} members"
        )
        self._members_channel = await self._members_connection.channel()
        self._broadcaster = broadcaster

    async def close(self) -> None:
        """Close the connections (the reply queue goes with them)."""
        connections = (self._connection, self._members_connection)
        self._connection = self._members_connection = self._broadcaster = None
        for connection in connections:
            if connection is not None:
                await connection.close()

    # -- requests --------------------------------------------------------------------------------

    async def broadcast(
        self,
        method: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        destination: Destination = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        reply: bool = False,
        timeout_s: float = 1.0,
        limit: int | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> BroadcastResult:
        """Send one request to every node it is for; with ``reply``, collect their answers.

        Without a destination, the live workers are read from the members stream first, and the
        call ends once each of those the request is for has answered (or at ``timeout_s``).

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        await self.connect()
        broadcaster, members = self._broadcaster, self._members_channel
        assert broadcaster is not None and members is not None
        started = time.monotonic()
        names = _destination(destination)
        try:
            if not reply:
                await broadcaster.cast(
                    method, dict(arguments or {}), destination=names, pattern=pattern, matcher=matcher,
                    headers=headers,
                )  # fmt: skip
                return BroadcastResult([], frozenset(), frozenset(), None, time.monotonic() - started)
            expected: frozenset[str] | None = frozenset(names) if names is not None else None
            if names is None:
                alive = await read_members(members, namespace=self.namespace, timeout_s=min(2.0, timeout_s))
                if alive is not None:
                    probe = ControlRequest(method=method, pattern=pattern, matcher=matcher)
                    expected = frozenset(node for node in alive if probe.is_for(node))
            collector = await broadcaster.call(
                method, dict(arguments or {}), expected=expected, timeout_s=timeout_s, destination=names,
                pattern=pattern, matcher=matcher, limit=limit, headers=headers,
            )  # fmt: skip
        except (aio_pika.exceptions.AMQPError, ConnectionError) as exc:
            raise BrokerUnavailable(f"broker {self.settings.safe_broker_url}: {exc!r}") from exc
        return BroadcastResult(
            collector.replies,
            collector.answered,
            collector.missing,
            collector.expected,
            time.monotonic() - started,
        )

    async def inspect(
        self,
        method: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        destination: Destination = None,
        timeout_s: float = 1.0,
    ) -> InspectReply:
        """Ask ``method`` of the workers; ``{nodename: value}`` (``.missing``: who was silent).

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        result = await self.broadcast(
            method, arguments, destination=destination, reply=True, timeout_s=timeout_s
        )
        return InspectReply(flatten_replies(result.replies), missing=result.missing)

    async def ping(self, destination: Destination = None, timeout_s: float = 1.0) -> list[dict[str, Any]]:
        """Celery's ``app.control.ping``: ``[{nodename: {"ok": "pong"}}, ...]``.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        result = await self.broadcast("ping", destination=destination, reply=True, timeout_s=timeout_s)
        return result.replies

    async def active(self, destination: Destination = None, timeout_s: float = 1.0) -> InspectReply:
        """The tasks each worker runs now (``inspect().active()``)."""
        return await self.inspect("active", destination=destination, timeout_s=timeout_s)

    async def registered(self, destination: Destination = None, timeout_s: float = 1.0) -> InspectReply:
        """The task names each worker knows (``inspect().registered()``)."""
        return await self.inspect("registered", destination=destination, timeout_s=timeout_s)

    async def stats(self, destination: Destination = None, timeout_s: float = 1.0) -> InspectReply:
        """Each worker's statistics (``inspect().stats()``)."""
        return await self.inspect("stats", destination=destination, timeout_s=timeout_s)

    async def revoke(
        self,
        task_ids: str | Sequence[str],
        *,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        destination: Destination = None,
        timeout_s: float = 1.0,
    ) -> RevokeResult:
        """Revoke tasks: append to the durable revocation log (confirmed), then broadcast.

        As the blocking client: the log makes the revoke hold for workers that are down now;
        when it cannot be written the broadcast still goes out and ``logged`` is False.

        Raises:
            ValueError: no ids, too many, or a malformed id.
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        entry = RevokeEntry.new(task_ids, terminate=terminate, signal=signal, hostname=self.hostname)
        await self.connect()
        logged = await self._log_revoke(entry)
        result = await self.broadcast(
            "revoke",
            {"task_id": list(entry.task_ids), "terminate": terminate, "signal": signal},
            destination=destination,
            reply=reply,
            timeout_s=timeout_s,
            headers={LOGGED_HEADER: True} if logged else None,
        )
        return RevokeResult(
            result.replies, result.answered, result.missing, result.expected, result.elapsed_s, logged
        )

    async def revoke_by_stamped_headers(
        self,
        headers: Mapping[str, Any] | Sequence[str],
        *,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        destination: Destination = None,
        timeout_s: float = 1.0,
    ) -> RevokeResult:
        """Revoke the tasks stamped with these values, durably as ``revoke`` (the blocking client's).

        Raises:
            ValueError: ``headers`` is not a map of stamp names to values (or lists of them).
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        entry = RevokeEntry.stamped(headers, terminate=terminate, signal=signal, hostname=self.hostname)
        await self.connect()
        logged = await self._log_revoke(entry)
        result = await self.broadcast(
            "revoke_by_stamped_headers",
            {"headers": dict(entry.stamps or {}), "terminate": terminate, "signal": signal},
            destination=destination,
            reply=reply,
            timeout_s=timeout_s,
            headers={LOGGED_HEADER: True} if logged else None,
        )
        return RevokeResult(
            result.replies, result.answered, result.missing, result.expected, result.elapsed_s, logged
        )

    async def _log_revoke(self, entry: RevokeEntry) -> bool:
        connection = self._connection
        assert connection is not None
        spec = revocation_log(self.settings.namespace)
        try:
            channel = self._log_channel
            if channel is None or channel.is_closed:
                channel = await connection.channel(publisher_confirms=True)
                await declare_queue(channel, spec)
                self._log_channel = channel
            message = aio_pika.Message(
                entry.encode(),
                content_type=REVOKE_CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={CLOCK_HEADER: self.clock.forward()},
                user_id=self.security.user_id,
            )
            confirm = await channel.default_exchange.publish(message, routing_key=spec.name, mandatory=True)
            if isinstance(confirm, aiormq.abc.DeliveredMessage):
                log.warning(
                    "revoke_not_logged", stream=spec.name, task_ids=len(entry.task_ids), error="returned"
                )
                return False
        except (aio_pika.exceptions.ChannelClosed, aio_pika.exceptions.DeliveryError) as exc:
            self._log_channel = None
            log.warning("revoke_not_logged", stream=spec.name, task_ids=len(entry.task_ids), error=repr(exc))
            return False
        except (aio_pika.exceptions.AMQPError, ConnectionError) as exc:
            raise BrokerUnavailable(f"broker {self.settings.safe_broker_url}: {exc!r}") from exc
        return True


def _destination(destination: Destination) -> tuple[str, ...] | None:
    if destination is None:
        return None
    names = (destination,) if isinstance(destination, str) else tuple(destination)
    return names or None  # an empty list means everyone, as in kombu
