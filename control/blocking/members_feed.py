"""The members feed: the control client's blocking (pika) reader of the members stream."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.connection.pika_internals import underlying_channel
from broker_svc.logging import get_logger
from broker_svc.topology import DEFAULT_EXCHANGE, members_stream
from control.blocking.declarations import declare_queue
from control.blocking.event_feed import decode_events
from control.blocking.failures import describe_error
from control.protocol.membership import Membership
from control.protocol.request import MARKER_HEADER

__all__ = ["MembersFeed"]

log = get_logger(__name__)

# A node is alive for 2 x freq after its last event; a minute back covers any sane freq.
_MEMBERS_LOOKBACK_S: Final = 60.0
_MEMBERS_PREFETCH: Final = 1000
_MEMBERS_ACK_EVERY: Final = 250


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
        impl = underlying_channel(self._channel)
        if impl is None or not impl.is_open:
            return
        connection = self._channel.connection
        # ``process_data_events`` returns early only for an event of the blocking layer, and a
        # close-ok the client asked for is none: without this wake-up each turn ran its whole
        # time limit (a fixed 50 ms at the end of every ``ctl`` command).
        impl.add_on_close_callback(lambda _channel, _reason: _wake(connection))
        impl.close()
        deadline = time.monotonic() + 2.0
        while not self._channel.is_closed and (left := deadline - time.monotonic()) > 0:
            connection.process_data_events(time_limit=left)

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


def _wake(connection: pika.BlockingConnection) -> None:
    # A no-op callback queued on the connection is an event: the current wait returns.
    if connection.is_open:
        connection.add_callback_threadsafe(_nothing)


def _nothing() -> None:
    pass
