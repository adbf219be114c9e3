"""The blocking control client (pika): broadcast mailbox requests, collect replies, log revokes.

One ``pika.BlockingConnection`` per client object. A client is **not thread-safe**: use one per
thread (``control.api.Control`` keeps one per thread for you).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import pika
import pika.exceptions
import pika.spec
import structlog
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc import codec
from broker_svc.clock import LamportClock
from broker_svc.errors import BrokerUnavailable, MessageError
from broker_svc.settings import Settings
from broker_svc.topology import (
    DEFAULT_EXCHANGE,
    DEFAULT_NAMESPACE,
    ExchangeSpec,
    QueueSpec,
    control_reply_queue,
    event_queue,
    members_stream,
    pidbox_exchange,
    revocation_log,
)
from control.collect import ReplyCollector
from control.members import Membership
from control.protocol import (
    CLOCK_HEADER,
    EXPIRES_HEADER,
    MARKER_HEADER,
    ControlRequest,
    Matcher,
    ReplyAddress,
    flatten_replies,
)
from control.revocations import CONTENT_TYPE as REVOKE_CONTENT_TYPE
from control.revocations import LOGGED_HEADER, RevokeEntry

__all__ = ["BroadcastResult", "ControlClient", "InspectReply", "RevokeResult"]

log = structlog.get_logger(__name__)

# A node is alive for 2 x freq after its last event; a minute back covers any sane freq.
_MEMBERS_LOOKBACK_S: Final = 60.0
_MEMBERS_PREFETCH: Final = 1000
_MEMBERS_ACK_EVERY: Final = 250
# While waiting, membership is re-read this often, so a node whose heartbeats stop stops
# holding the call up.
_TICK_S: Final = 0.1
_REPLY_ACCEPT: Final = codec.accept_set(("json", "msgpack"))
_EVENT_ACCEPT: Final = codec.accept_set(("json",))


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    """What a broadcast got back.

    Attributes:
        replies: one-entry maps ``{nodename: value}`` in arrival order (one per node).
        answered: nodes that replied.
        missing: nodes we waited for that did not reply (empty when that set was unknown).
        expected: the destination list, else the live members the request was for; None when
            membership was unknown (then the call waited out its timeout).
        elapsed_s: how long the call took.
    """

    replies: list[dict[str, Any]]
    answered: frozenset[str]
    missing: frozenset[str]
    expected: frozenset[str] | None
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class RevokeResult(BroadcastResult):
    """A broadcast ``revoke``, and whether its entry is on disk in the revocation log."""

    logged: bool = False


class InspectReply(dict[str, Any]):
    """``{nodename: value}``, plus the nodes that were expected and did not answer."""

    def __init__(self, by_node: Mapping[str, Any], *, missing: frozenset[str] = frozenset()) -> None:
        super().__init__(by_node)
        self.missing = missing


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
        self._serializer = serializer
        self._conn: pika.BlockingConnection | None = None
        self._channel: Channel | None = None
        self._reply_to: ReplyAddress | None = None
        self._members: _MembersFeed | None = None
        self._log_channel: Channel | None = None
        self._collector: ReplyCollector | None = None
        self._members_warned = False

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the reply queue and any event queue go with it)."""
        conn, self._conn = self._conn, None
        members, self._members = self._members, None
        self._channel = self._log_channel = None
        if conn is not None and conn.is_open:
            try:
                if members is not None:
                    members.close()
                conn.close()
            except (pika.exceptions.AMQPError, OSError) as exc:
                log.debug("control_close_failed", error=str(exc))

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
        _, channel = self._ensure_open()
        assert self._reply_to is not None
        ticket = ControlRequest.new_ticket() if reply else None
        request = ControlRequest(
            method=method,
            arguments=dict(arguments or {}),
            destination=names,
            pattern=pattern if names is None else None,
            matcher=matcher if names is None and pattern is not None else None,
            ticket=ticket,
            reply_to=self._reply_to if reply else None,
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
            if names is None and self._members is not None:
                self._members.mark()  # learn who is alive while the replies come in
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
        self,
        method: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        destination: str | Sequence[str] | None = None,
        pattern: str | None = None,
        matcher: Matcher | None = None,
        timeout_s: float = 1.0,
        limit: int | None = None,
    ) -> InspectReply:
        """Broadcast with replies and return ``{nodename: value}`` (``.missing`` says who was silent).

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        result = self.broadcast(
            method,
            arguments,
            destination=destination,
            pattern=pattern,
            matcher=matcher,
            reply=True,
            timeout_s=timeout_s,
            limit=limit,
        )
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
        logged = self._log_revoke(entry)
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

    def iter_events(self, *, routing_key: str = "#", tick_s: float = 0.1) -> Iterator[list[dict[str, Any]]]:
        """Follow live events (Celery's ``celeryev``) on an exclusive queue.

        Yields the events received during each tick of about ``tick_s`` (often none); the caller
        stops by leaving the loop. Bodies that are lists (Celery's batched task events) are
        flattened; anything that is not a JSON map is skipped.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        conn, _ = self._ensure_open()
        received: list[dict[str, Any]] = []

        def on_message(
            _ch: Channel, _method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
        ) -> None:
            for event in _decode_events(body, props, max_bytes=self.settings.max_body_bytes):
                if event.get("type") != "task-sent":  # clients' clocks are not trusted (as Celery)
                    self.clock.adjust(event.get("clock"))
                received.append(event)

        try:
            channel = conn.channel()
            spec = event_queue(routing_key)
            _declare_queue(channel, spec, bind=True)
            channel.basic_consume(spec.name, on_message, auto_ack=True, exclusive=True)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        try:
            while True:
                try:
                    conn.process_data_events(time_limit=tick_s)
                except (pika.exceptions.AMQPError, OSError) as exc:
                    raise self._unavailable(exc) from exc
                batch = received[:]
                received.clear()
                yield batch
        finally:
            if channel.is_open and conn.is_open:
                try:
                    channel.close()  # the exclusive queue goes with it
                except (pika.exceptions.AMQPError, OSError):
                    pass

    # -- connection ------------------------------------------------------------------------------

    def _ensure_open(self) -> tuple[pika.BlockingConnection, Channel]:
        conn, channel = self._conn, self._channel
        if conn is not None and channel is not None and conn.is_open and channel.is_open:
            try:
                # An idle blocking connection misses heartbeats and may have been closed by the
                # broker meanwhile; this notices it, and we reconnect.
                conn.process_data_events(time_limit=0)
                return conn, channel
            except (pika.exceptions.AMQPError, OSError) as exc:
                log.info("control_reconnecting", url=self.settings.safe_broker_url, error=str(exc))
        self.close()
        return self._connect()

    def _connect(self) -> tuple[pika.BlockingConnection, Channel]:
        try:
            conn = pika.BlockingConnection(self._parameters())
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        try:
            channel = conn.channel()
            # Both exchanges exist before the first request, whether or not a worker runs.
            _declare_exchange(channel, pidbox_exchange(self.namespace))
            spec = control_reply_queue(self.namespace)
            _declare_queue(channel, spec, bind=True)
            channel.basic_consume(spec.name, self._on_reply, auto_ack=True, exclusive=True)
        except (pika.exceptions.AMQPError, OSError) as exc:
            if conn.is_open:
                conn.close()
            raise self._unavailable(exc) from exc
        self._conn, self._channel = conn, channel
        assert spec.exchange is not None
        self._reply_to = ReplyAddress(spec.exchange.name, spec.routing_key)
        self._members = _MembersFeed.start(conn, self)
        return conn, channel

    def _parameters(self) -> pika.URLParameters:
        params = pika.URLParameters(self.settings.broker_url)
        params.virtual_host = self.settings.virtual_host  # pika reads "//" as vhost ""
        params.heartbeat = self.settings.heartbeat_s
        params.socket_timeout = self.settings.connect_timeout_s
        params.stack_timeout = self.settings.connect_timeout_s * 2
        params.blocked_connection_timeout = self.settings.confirm_timeout_s
        params.connection_attempts = 1
        params.client_properties = {
            "connection_name": f"clockwork-ctl {self.hostname}",
            "product": "clockwork",
        }
        return params

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        return BrokerUnavailable(f"broker {self.settings.safe_broker_url}: {_describe(exc)}")

    # -- replies ---------------------------------------------------------------------------------

    def _publish(
        self, channel: Channel, request: ControlRequest, *, timeout_s: float, extra: Mapping[str, Any] | None
    ) -> None:
        body, content_type, encoding = codec.encode(request.to_wire(), self._serializer)
        # Celery sends ``expires`` as a float; pika cannot encode floats in headers, and nobody
        # checks it on receipt (WIRE.md §5.2), so whole seconds, rounded up, it is.
        expires = math.ceil(time.time() + timeout_s) if timeout_s else 0
        headers = {CLOCK_HEADER: self.clock.forward(), EXPIRES_HEADER: expires, **(extra or {})}
        properties = pika.BasicProperties(
            content_type=content_type, content_encoding=encoding, headers=headers, delivery_mode=2
        )
        try:
            channel.basic_publish(pidbox_exchange(self.namespace).name, "", body, properties)
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc

    def _wait(self, collector: ReplyCollector, request: ControlRequest) -> None:
        conn = self._conn
        assert conn is not None
        while True:
            now = time.monotonic()
            if request.destination is None and self._members is not None and self._members.caught_up:
                alive = self.membership.alive(time.time())
                collector.expect(node for node in alive if request.is_for(node))
            if collector.done(now):
                return
            try:
                # Returns early when a reply or a stream message arrives.
                conn.process_data_events(time_limit=min(_TICK_S, max(collector.deadline - now, 0.0)))
            except (pika.exceptions.AMQPError, OSError) as exc:
                raise self._unavailable(exc) from exc

    def _on_reply(
        self, _ch: Channel, _method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        headers = props.headers or {}
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

    # -- the revocation log ----------------------------------------------------------------------

    def _log_revoke(self, entry: RevokeEntry) -> bool:
        conn, _ = self._ensure_open()
        spec = revocation_log(self.namespace)
        properties = pika.BasicProperties(
            content_type=REVOKE_CONTENT_TYPE, delivery_mode=2, headers={CLOCK_HEADER: self.clock.forward()}
        )
        try:
            channel = self._log_channel
            if channel is None or not channel.is_open:
                channel = conn.channel()
                _declare_queue(channel, spec, bind=False)
                channel.confirm_delivery()
                self._log_channel = channel
            # With confirms on, this returns once the broker has the entry on disk.
            channel.basic_publish(DEFAULT_EXCHANGE, spec.name, entry.encode(), properties, mandatory=True)
        except (
            pika.exceptions.ChannelClosed,
            pika.exceptions.NackError,
            pika.exceptions.UnroutableError,
        ) as exc:
            self._log_channel = None
            log.warning(
                "revoke_not_logged", stream=spec.name, task_ids=len(entry.task_ids), error=_describe(exc)
            )
            return False
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return True


class _MembersFeed:
    """Reads the members stream into the client's ``Membership``, on a channel of its own.

    A broker without streams (or a stream declared with other arguments) closes only this
    channel; the client then has no membership and calls wait out their timeout.
    """

    def __init__(self, channel: Channel, client: ControlClient) -> None:
        self._channel = channel
        self._client = client
        self._stream = members_stream(client.namespace).name
        self._marker: str | None = None
        self._unacked = 0
        self.caught_up = False

    @classmethod
    def start(cls, conn: pika.BlockingConnection, client: ControlClient) -> _MembersFeed | None:
        spec = members_stream(client.namespace)
        try:
            channel = conn.channel()
            _declare_queue(channel, spec, bind=True)
            channel.basic_qos(prefetch_count=_MEMBERS_PREFETCH)  # streams need manual acks and a qos
            feed = cls(channel, client)
            since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=_MEMBERS_LOOKBACK_S)
            channel.basic_consume(
                spec.name, feed._on_message, auto_ack=False, arguments={"x-stream-offset": since}
            )
        except pika.exceptions.ChannelClosed as exc:
            if not client._members_warned:  # once per client, not once per reconnect
                client._members_warned = True
                log.warning("members_stream_unavailable", stream=spec.name, error=_describe(exc))
            return None
        return feed

    def mark(self) -> None:
        """Append a marker; ``caught_up`` turns true once we have read up to it."""
        self.caught_up = False
        self._marker = str(uuid.uuid4())
        if not self._channel.is_open:
            return
        properties = pika.BasicProperties(headers={MARKER_HEADER: self._marker})
        try:
            self._channel.basic_publish(DEFAULT_EXCHANGE, self._stream, b"", properties)
        except pika.exceptions.ChannelClosed as exc:
            log.warning("members_stream_unavailable", stream=self._stream, error=_describe(exc))

    def close(self) -> None:
        """Close the channel without cancelling its consumer first.

        pika's ``BlockingChannel.close`` cancels consumers and rejects the deliveries it holds;
        a stream refuses basic.reject by closing the whole *connection* (540). Closing the
        underlying channel drops them instead, which is all a stream consumer needs.
        """
        impl = getattr(self._channel, "_impl", None)  # pika's channel under the blocking wrapper
        if impl is None or not impl.is_open:
            return
        impl.close()
        deadline = time.monotonic() + 2.0
        while not self._channel.is_closed and time.monotonic() < deadline:
            self._channel.connection.process_data_events(time_limit=0.05)

    def _on_message(
        self, channel: Channel, method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        marker = (props.headers or {}).get(MARKER_HEADER)
        if marker is None:
            client = self._client
            for event in _decode_events(body, props, max_bytes=client.settings.max_body_bytes):
                client.clock.adjust(event.get("clock"))
                client.membership.feed(event)
        elif marker == self._marker:
            self.caught_up = True
        self._unacked += 1
        if self._unacked >= _MEMBERS_ACK_EVERY or self.caught_up:
            self._unacked = 0
            channel.basic_ack(method.delivery_tag, multiple=True)


def _decode_events(body: bytes, props: pika.spec.BasicProperties, *, max_bytes: int) -> list[dict[str, Any]]:
    try:
        decoded = codec.decode(body, props.content_type, accept=_EVENT_ACCEPT, max_bytes=max_bytes)
    except MessageError as exc:
        log.debug("event_undecodable", error=str(exc), size=len(body))
        return []
    items = decoded if isinstance(decoded, list) else [decoded]
    return [item for item in items if isinstance(item, dict)]


def _declare_exchange(channel: Channel, spec: ExchangeSpec) -> None:
    channel.exchange_declare(
        spec.name, exchange_type=spec.type, durable=spec.durable, auto_delete=spec.auto_delete
    )


def _declare_queue(channel: Channel, spec: QueueSpec, *, bind: bool) -> None:
    channel.queue_declare(
        spec.name,
        durable=spec.durable,
        exclusive=spec.exclusive,
        auto_delete=spec.auto_delete,
        arguments=spec.arguments or None,
    )
    if bind and spec.exchange is not None:
        _declare_exchange(channel, spec.exchange)
        channel.queue_bind(spec.name, spec.exchange.name, routing_key=spec.routing_key)


def _destination(destination: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if destination is None:
        return None
    names = (destination,) if isinstance(destination, str) else tuple(destination)
    return names or None  # an empty list means everyone, as in kombu


def _describe(exc: BaseException) -> str:
    if isinstance(exc, pika.exceptions.ProbableAuthenticationError):
        return "authentication failed (check the user name and password)"
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return "access denied (check the vhost and the user's permissions)"
    if isinstance(exc, pika.exceptions.AMQPConnectionError) and exc.args:
        inner = exc.args[0]
        if isinstance(inner, BaseException):
            return f"cannot connect ({type(inner).__name__}: {inner})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
