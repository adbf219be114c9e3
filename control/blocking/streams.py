"""The blocking (pika) readers of what workers broadcast: the members stream and live events.

``control.blocking.client`` runs them on its connection and shares the channel helpers at the bottom.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
import structlog
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.topology import DEFAULT_EXCHANGE, ExchangeSpec, QueueSpec, event_queue, members_stream
from broker_svc.wire import codec
from control.protocol.membership import Membership
from control.protocol.request import MARKER_HEADER

__all__ = [
    # readers
    "MembersFeed",
    "follow_events",
    "decode_events",
    # channel helpers
    "declare_exchange",
    "declare_queue",
    "describe_error",
]

log = structlog.get_logger(__name__)

# A node is alive for 2 x freq after its last event; a minute back covers any sane freq.
_MEMBERS_LOOKBACK_S: Final = 60.0
_MEMBERS_PREFETCH: Final = 1000
_MEMBERS_ACK_EVERY: Final = 250
_EVENT_ACCEPT: Final = codec.accept_set(("json",))


class MembersFeed:
    """Reads the members stream into a ``Membership``, on a channel of its own.

    A broker without streams (or a stream declared with other arguments) closes only this
    channel; the client then has no membership and calls wait out their timeout.

    Args:
        channel: the feed's own channel, consuming the stream.
        stream: the members stream's name.
        membership: what the events are fed into.
        clock: adjusted from every event.
        max_body_bytes: larger events are skipped.
    """

    def __init__(
        self,
        channel: Channel,
        stream: str,
        membership: Membership,
        clock: LamportClock,
        *,
        max_body_bytes: int,
    ) -> None:
        self._channel = channel
        self._stream = stream
        self._membership = membership
        self._clock = clock
        self._max_body_bytes = max_body_bytes
        self._marker: str | None = None
        self._unacked = 0
        self.caught_up = False

    @classmethod
    def start(
        cls,
        conn: pika.BlockingConnection,
        namespace: str,
        membership: Membership,
        clock: LamportClock,
        *,
        max_body_bytes: int,
    ) -> MembersFeed:
        """Open a channel and read the members stream from a minute back.

        Raises:
            pika.exceptions.ChannelClosed: the broker refused the stream (the connection stays open).
            pika.exceptions.AMQPError: the connection failed.
        """
        spec = members_stream(namespace)
        channel = conn.channel()
        declare_queue(channel, spec, bind=True)
        channel.basic_qos(prefetch_count=_MEMBERS_PREFETCH)  # streams need manual acks and a qos
        feed = cls(channel, spec.name, membership, clock, max_body_bytes=max_body_bytes)
        since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=_MEMBERS_LOOKBACK_S)
        channel.basic_consume(
            spec.name, feed._on_message, auto_ack=False, arguments={"x-stream-offset": since}
        )
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
            log.warning("members_stream_unavailable", stream=self._stream, error=describe_error(exc))

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
            for event in decode_events(body, props, max_bytes=self._max_body_bytes):
                self._clock.adjust(event.get("clock"))
                self._membership.feed(event)
        elif marker == self._marker:
            self.caught_up = True
        self._unacked += 1
        if self._unacked >= _MEMBERS_ACK_EVERY or self.caught_up:
            self._unacked = 0
            channel.basic_ack(method.delivery_tag, multiple=True)


def follow_events(
    conn: pika.BlockingConnection,
    *,
    routing_key: str,
    tick_s: float,
    clock: LamportClock,
    max_body_bytes: int,
) -> Iterator[list[dict[str, Any]]]:
    """Follow live events (Celery's ``celeryev``) on an exclusive queue of a channel of its own.

    Yields the events received during each tick of about ``tick_s`` (often none); closing the
    generator closes the channel, and the queue goes with it. Bodies that are lists (Celery's
    batched task events) are flattened; anything that is not a JSON map is skipped.

    Raises:
        pika.exceptions.AMQPError: the channel or the connection failed.
        OSError: the socket failed.
    """
    received: list[dict[str, Any]] = []

    def on_message(
        _ch: Channel, _method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        for event in decode_events(body, props, max_bytes=max_body_bytes):
            if event.get("type") != "task-sent":  # clients' clocks are not trusted (as Celery)
                clock.adjust(event.get("clock"))
            received.append(event)

    channel = conn.channel()
    spec = event_queue(routing_key)
    declare_queue(channel, spec, bind=True)
    channel.basic_consume(spec.name, on_message, auto_ack=True, exclusive=True)
    try:
        while True:
            conn.process_data_events(time_limit=tick_s)
            batch = received[:]
            received.clear()
            yield batch
    finally:
        if channel.is_open and conn.is_open:
            try:
                channel.close()  # the exclusive queue goes with it
            except (pika.exceptions.AMQPError, OSError):
                pass


def decode_events(body: bytes, props: pika.spec.BasicProperties, *, max_bytes: int) -> list[dict[str, Any]]:
    """The events in one message: a JSON map, or a list of them; nothing if it does not decode."""
    try:
        decoded = codec.decode(body, props.content_type, accept=_EVENT_ACCEPT, max_bytes=max_bytes)
    except MessageError as exc:
        log.debug("event_undecodable", error=str(exc), size=len(body))
        return []
    items = decoded if isinstance(decoded, list) else [decoded]
    return [item for item in items if isinstance(item, dict)]


# -- channel helpers -----------------------------------------------------------------------------


def declare_exchange(channel: Channel, spec: ExchangeSpec) -> None:
    """Declare ``spec``'s exchange.

    Raises:
        pika.exceptions.ChannelClosed: the broker refused the declaration.
    """
    channel.exchange_declare(spec.name, exchange_type=spec.type, **spec.declare_options())


def declare_queue(channel: Channel, spec: QueueSpec, *, bind: bool) -> None:
    """Declare ``spec``'s queue; with ``bind``, its exchange and binding too.

    Raises:
        pika.exceptions.ChannelClosed: the broker refused a declaration.
    """
    channel.queue_declare(spec.name, **spec.declare_options())
    if bind and spec.exchange is not None:
        declare_exchange(channel, spec.exchange)
        channel.queue_bind(spec.name, spec.exchange.name, routing_key=spec.routing_key)


def describe_error(exc: BaseException) -> str:
    """A pika or socket error as one line a user can act on."""
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
