"""The blocking control client (pika): broadcast mailbox requests, collect replies, log revokes.

One ``pika.BlockingConnection`` per client object, kept by ``control.blocking.connection``. A client is
**not thread-safe**: use one per thread (``control.api.Control`` keeps one per thread for you).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal, Unpack

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import DEFAULT_NAMESPACE, pidbox_exchange
from broker_svc.wire import codec
from control.blocking.connection import ControlConnection
from control.blocking.event_feed import follow_events
from control.protocol.collector import ReplyCollector
from control.protocol.membership import Membership
from control.protocol.replies import BroadcastResult, CallOptions, InspectReply, RevokeResult
from control.protocol.request import CLOCK_HEADER, EXPIRES_HEADER, ControlRequest, Matcher, flatten_replies
from control.protocol.revoke_log import LOGGED_HEADER, RevokeEntry
from control.protocol.signing import ControlSecurity

__all__ = ["ControlClient", "QueueDepth"]

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """A queue as a passive declare sees it: messages ready for delivery, and consumers."""

    ready: int
    consumers: int


# While waiting, membership is re-read this often, so a node whose heartbeats stop stops
# holding the call up.
_TICK_S: Final = 0.1
_REPLY_ACCEPT: Final = codec.accept_set(("json", "msgpack"))


class ControlClient:
    """Talks to workers over Celery's mailbox; learns who is alive from the members stream.

    A call returns as soon as every addressed node answered: the destination list, or else every
    live member (from their heartbeats) the request is for. ``timeout_s`` is only the upper bound
    of a whole call (Celery's timeout is an idle timeout instead).

    Args:
        settings: the broker URL and connection timeouts.
        namespace: the mailbox namespace (Celery's ``control_exchange``).
        clock: the process's Lamport clock (forwarded on send, adjusted from every reply).
        serializer: how requests are encoded; workers reply in the same content type. ``json``
            is what every Celery worker accepts.
        hostname: this client's name in revocation log entries and the connection name.

    Requests carry ``user_id`` (the URL's user) and, with ``settings.control_signing_key``, a
    signature; a client with a key drops replies that are not signed with it.

    Raises:
        ValueError: an unknown serializer.
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
        if serializer not in ("json", "msgpack"):
            raise ValueError(f"serializer must be 'json' or 'msgpack', got {serializer!r}")
        self.settings = settings
        self.namespace = namespace
        self.clock = clock or LamportClock()
        self.hostname = hostname or f"ctl{os.getpid()}@{socket.gethostname()}"
        self.membership = Membership()
        self.security = ControlSecurity.from_settings(settings)
        self._serializer = serializer
        self._connection = ControlConnection(
            settings,
            namespace=namespace,
            hostname=self.hostname,
            membership=self.membership,
            clock=self.clock,
            user_id=self.security.user_id,
            on_reply=self._on_reply,
        )
        self._collector: ReplyCollector | None = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the reply queue and any event queue go with it)."""
        self._connection.close()

    # -- requests --------------------------------------------------------------------------------

    def broadcast(
        self,
        method: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        destination: str | Sequence[str] | None = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        reply: bool = False,
        timeout_s: float = 1.0,
        limit: int | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> BroadcastResult:
        """Send one request to every node it is for; with ``reply``, collect their answers.

        Args:
            method: the command name.
            arguments: its keyword arguments.
            destination: node names (a lone name is a list of one); None or empty means all.
            pattern: a node-name pattern used when there is no destination.
            matcher: ``glob`` (default) or ``pcre`` for ``pattern``.
            reply: wait for replies (a call) or not (a cast).
            timeout_s: the longest a call waits in all.
            limit: stop after this many nodes answered.
            headers: extra message headers (str, bool, int or None values).

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
            TypeError: the arguments cannot be encoded with the serializer.
        """
        started = time.monotonic()
        names = _destination(destination)
        _, channel = self._connection.ensure_open()
        reply_to, members = self._connection.reply_to, self._connection.members
        assert reply_to is not None
        ticket = ControlRequest.new_ticket() if reply else None
        request = ControlRequest(
            method=method,
            arguments=dict(arguments or {}),
            destination=names,
            pattern=pattern if names is None else None,
            matcher=matcher if names is None and pattern is not None else None,
            ticket=ticket,
            reply_to=reply_to if reply else None,
        )
        collector: ReplyCollector | None = None
        if ticket is not None:
            collector = ReplyCollector(
                ticket,
                expected=frozenset(names) if names is not None else None,
                limit=limit,
                timeout_s=timeout_s,
                now=started,
            )
            if names is None and members is not None:
                members.mark()  # learn who is alive while the replies come in
        self._publish(channel, request, timeout_s=timeout_s, extra=headers)
        if collector is None:
            return BroadcastResult([], frozenset(), frozenset(), None, time.monotonic() - started)
        self._collector = collector
        try:
            self._wait(collector, request)
        finally:
            self._collector = None
        return BroadcastResult(
            collector.replies,
            collector.answered,
            collector.missing,
            collector.expected,
            time.monotonic() - started,
        )

    def inspect(
        self, method: str, arguments: Mapping[str, Any] | None = None, **options: Unpack[CallOptions]
    ) -> InspectReply:
        """Broadcast with replies and return ``{nodename: value}`` (``.missing`` says who was silent).

        Args:
            method: the command name.
            arguments: its keyword arguments.
            **options: ``destination``, ``pattern``, ``matcher``, ``timeout_s`` and ``limit``,
                as for ``broadcast``.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        result = self.broadcast(method, arguments, reply=True, **options)
        return InspectReply(flatten_replies(result.replies), missing=result.missing)

    def revoke(
        self,
        task_ids: str | Sequence[str],
        *,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        destination: str | Sequence[str] | None = None,
        timeout_s: float = 1.0,
    ) -> RevokeResult:
        """Revoke tasks: append to the durable revocation log (confirmed), then broadcast.

        The log entry is what makes the revoke hold for workers that are down now: they read the
        log when they start. When the log cannot be written (a broker without streams, a nack),
        the broadcast still goes out, ``logged`` is False and a warning is logged.

        Raises:
            ValueError: no ids, too many, or a malformed id.
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        entry = RevokeEntry.new(task_ids, terminate=terminate, signal=signal, hostname=self.hostname)
        logged = self._connection.log_revoke(entry)
        result = self.broadcast(
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

    def revoke_by_stamped_headers(
        self,
        headers: Mapping[str, Any] | Sequence[str],
        *,
        terminate: bool = False,
        signal: str = "SIGTERM",
        reply: bool = False,
        destination: str | Sequence[str] | None = None,
        timeout_s: float = 1.0,
    ) -> RevokeResult:
        """Revoke the tasks stamped with these values (Celery's command), durably as ``revoke``:
        the revocation log first (confirmed), then the broadcast.

        Raises:
            ValueError: ``headers`` is not a map of stamp names to values (or lists of them).
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        entry = RevokeEntry.stamped(headers, terminate=terminate, signal=signal, hostname=self.hostname)
        logged = self._connection.log_revoke(entry)
        result = self.broadcast(
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

    def iter_events(self, *, routing_key: str = "#", tick_s: float = 0.1) -> Iterator[list[dict[str, Any]]]:
        """Follow live events (Celery's ``celeryev``) on an exclusive queue.

        Yields the events received during each tick of about ``tick_s`` (often none); the caller
        stops by leaving the loop. Bodies that are lists (Celery's batched task events) are
        flattened; anything that is not a JSON map is skipped.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        conn, _ = self._connection.ensure_open()
        events = follow_events(
            conn,
            routing_key=routing_key,
            tick_s=tick_s,
            clock=self.clock,
            max_body_bytes=self.settings.max_body_bytes,
        )
        try:
            yield from events
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._connection.unavailable(exc) from exc

    def queue_depths(self, names: Sequence[str]) -> dict[str, QueueDepth | None]:
        """The ready messages and consumers of each queue (a passive declare); None if it does not exist.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or refused for another reason.
        """
        conn, _ = self._connection.ensure_open()
        depths: dict[str, QueueDepth | None] = {}
        channel: Channel | None = None
        try:
            for name in names:
                if channel is None or not channel.is_open:
                    channel = conn.channel()  # a missing queue (404) closes the channel it was asked on
                try:
                    frame = channel.queue_declare(name, passive=True)
                except pika.exceptions.ChannelClosedByBroker as exc:
                    if exc.reply_code != 404:
                        raise
                    depths[name] = None
                    continue
                method = frame.method
                assert isinstance(method, pika.spec.Queue.DeclareOk)
                depths[name] = QueueDepth(ready=method.message_count, consumers=method.consumer_count)
            if channel is not None and channel.is_open:
                channel.close()
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._connection.unavailable(exc) from exc
        return depths

    # -- replies ---------------------------------------------------------------------------------

    def _publish(
        self, channel: Channel, request: ControlRequest, *, timeout_s: float, extra: Mapping[str, Any] | None
    ) -> None:
        body, content_type, encoding = codec.encode(request.to_wire(), self._serializer)
        # Celery sends ``expires`` as a float; pika cannot encode floats in headers, and nobody
        # checks it on receipt (WIRE.md §5.2), so whole seconds, rounded up, it is.
        expires = math.ceil(time.time() + timeout_s) if timeout_s else 0
        exchange = pidbox_exchange(self.namespace).name
        headers = self.security.sign(
            "request",
            exchange=exchange,
            body=body,
            content_type=content_type,
            content_encoding=encoding,
            headers={CLOCK_HEADER: self.clock.forward(), EXPIRES_HEADER: expires, **(extra or {})},
        )
        properties = pika.BasicProperties(
            content_type=content_type,
            content_encoding=encoding,
            headers=headers,
            delivery_mode=2,
            user_id=self.security.user_id,
        )
        try:
            channel.basic_publish(exchange, "", body, properties)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._connection.unavailable(exc) from exc

    def _wait(self, collector: ReplyCollector, request: ControlRequest) -> None:
        conn = self._connection.conn
        assert conn is not None
        while True:
            now = time.monotonic()
            members = self._connection.members
            if request.destination is None and members is not None and members.caught_up:
                alive = self.membership.alive(time.time())
                collector.expect(node for node in alive if request.is_for(node))
            if collector.done(now):
                return
            try:
                # Returns early when a reply or a stream message arrives.
                conn.process_data_events(time_limit=min(_TICK_S, max(collector.deadline - now, 0.0)))
            except (pika.exceptions.AMQPError, OSError) as exc:
                raise self._connection.unavailable(exc) from exc

    def _on_reply(
        self, _ch: Channel, method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        headers = props.headers or {}
        if self.security.signing:
            refusal = self.security.check(
                "reply",
                exchange=method.exchange or "",
                body=body,
                content_type=props.content_type,
                content_encoding=props.content_encoding,
                headers=headers,
                user_id=props.user_id,
            )
            if refusal is not None:
                log.warning("control_reply_refused", reason=str(refusal), size=len(body))
                return
        self.clock.adjust(headers.get(CLOCK_HEADER))
        collector = self._collector
        if collector is None:
            return  # a late reply to an earlier call
        try:
            value = codec.decode(
                body, props.content_type, accept=_REPLY_ACCEPT, max_bytes=self.settings.max_body_bytes
            )
        except MessageError as exc:
            log.warning("control_reply_undecodable", error=str(exc), size=len(body))
            return
        collector.offer(headers, value)


def _destination(destination: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if destination is None:
        return None
    names = (destination,) if isinstance(destination, str) else tuple(destination)
    return names or None  # an empty list means everyone, as in kombu
