"""The control client's connection: one ``pika.BlockingConnection`` and the channels on it.

``ControlConnection`` opens the connection lazily, notices a dropped idle one and reconnects,
and owns the three channels the client runs on it: the mailbox channel (requests out, the reply
queue consumed), the members feed, and the revocation log's channel with publisher confirms. It is
separate from ``control.blocking.client`` so that module holds only the calls (what is sent, who must
answer, when a call is done); like the client, it is blocking and **not thread-safe**.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel as Channel

from broker_svc.clock import LamportClock
from broker_svc.connection.blocking import open_blocking
from broker_svc.errors import BrokerUnavailable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import (
    DEFAULT_EXCHANGE,
    control_reply_queue,
    members_stream,
    pidbox_exchange,
    revocation_log,
)
from control.blocking.declarations import declare_exchange, declare_queue
from control.blocking.failures import describe_error
from control.blocking.members_feed import MembersFeed
from control.protocol.membership import Membership
from control.protocol.request import CLOCK_HEADER, ReplyAddress
from control.protocol.revoke_log import CONTENT_TYPE as REVOKE_CONTENT_TYPE
from control.protocol.revoke_log import RevokeEntry

__all__ = ["ControlConnection", "ReplyCallback"]

log = get_logger(__name__)

ReplyCallback = Callable[[Channel, pika.spec.Basic.Deliver, pika.spec.BasicProperties, bytes], None]

# Connections made in a row when the broker closes each as the members feed subscribes.
_MEMBERS_ATTEMPTS: Final = 3


class ControlConnection:
    """One control client's connection, (re)opened on demand, and the channels on it.

    Args:
        settings: the broker URL and connection timeouts.
        namespace: the mailbox namespace (Celery's ``control_exchange``).
        hostname: the client's name, used in the connection name.
        membership: what the members feed is read into.
        clock: forwarded on revocation log entries, adjusted from the members stream.
        user_id: stamped as ``user_id`` on log entries (None: not stamped).
        on_reply: called with every message on the reply queue.

    Attributes:
        conn: the open connection, or None before the first call and after ``close``.
        channel: the mailbox channel, or None.
        reply_to: where workers send replies (the reply queue's exchange and routing key).
        members: the members feed, or None if the broker refused the stream.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        namespace: str,
        hostname: str,
        membership: Membership,
        clock: LamportClock,
        user_id: str | None,
        on_reply: ReplyCallback,
    ) -> None:
        self.settings = settings
        self._namespace = namespace
        self._hostname = hostname
        self._membership = membership
        self._clock = clock
        self._user_id = user_id
        self._on_reply = on_reply
        self.conn: pika.BlockingConnection | None = None
        self.channel: Channel | None = None
        self.reply_to: ReplyAddress | None = None
        self.members: MembersFeed | None = None
        self._log_channel: Channel | None = None
        self._members_warned = False

    def close(self) -> None:
        """Close the connection (the reply queue and any event queue go with it)."""
        conn, self.conn = self.conn, None
        members, self.members = self.members, None
        self.channel = self._log_channel = None
        if conn is not None and conn.is_open:
            try:
                if members is not None:
                    members.close()
                conn.close()
            except (pika.exceptions.AMQPError, OSError) as exc:
                log.debug("control_close_failed", error=str(exc))

    def ensure_open(self) -> tuple[pika.BlockingConnection, Channel]:
        """The open connection and mailbox channel, connecting (again) if need be.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        conn, channel = self.conn, self.channel
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
        # Our consume of the members stream may race its start (workers declaring it this very
        # moment), which RabbitMQ 3.10 answers with a 541 that closes the whole connection. No
        # request has gone out on it yet, so nothing is lost: connect again; the stream is up by then.
        attempt = 1
        while True:
            try:
                return self._connect_once()
            except pika.exceptions.ConnectionClosedByBroker as exc:
                if attempt >= _MEMBERS_ATTEMPTS:
                    raise self.unavailable(exc) from exc
                attempt += 1
                log.info("control_reconnecting", url=self.settings.safe_broker_url, error=describe_error(exc))

    def _connect_once(self) -> tuple[pika.BlockingConnection, Channel]:
        # pika tries each URL of a failover list in turn, once.
        conn = open_blocking(self.settings, connection_name=f"clockwork-ctl {self._hostname}")
        try:
            channel = conn.channel()
            # Both exchanges exist before the first request, whether or not a worker runs.
            declare_exchange(channel, pidbox_exchange(self._namespace))
            spec = control_reply_queue(self._namespace)
            declare_queue(channel, spec, bind=True)
            channel.basic_consume(spec.name, self._on_reply, auto_ack=True, exclusive=True)
        except (pika.exceptions.AMQPError, OSError) as exc:
            if conn.is_open:
                conn.close()
            raise self.unavailable(exc) from exc
        self.conn, self.channel = conn, channel
        assert spec.exchange is not None
        self.reply_to = ReplyAddress(spec.exchange.name, spec.routing_key)
        try:
            self.members = MembersFeed.start(
                conn,
                self._namespace,
                self._membership,
                self._clock,
                max_body_bytes=self.settings.max_body_bytes,
            )
        except pika.exceptions.ConnectionClosedByBroker:
            self.close()
            raise
        except pika.exceptions.ChannelClosed as exc:
            if not self._members_warned:  # once per client, not once per reconnect
                self._members_warned = True
                stream = members_stream(self._namespace).name
                log.warning("members_stream_unavailable", stream=stream, error=describe_error(exc))
        return conn, channel

    def unavailable(self, exc: BaseException) -> BrokerUnavailable:
        """The error to raise for a pika or socket error ``exc`` (the URL without its password)."""
        return BrokerUnavailable(f"broker {self.settings.safe_broker_url}: {describe_error(exc)}")

    # -- the revocation log ----------------------------------------------------------------------

    def log_revoke(self, entry: RevokeEntry) -> bool:
        """Append ``entry`` to the revocation log and wait for the broker's confirm.

        Returns:
            False (and a warning is logged) if the log could not be written: no streams, a nack.

        Raises:
            BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        """
        conn, _ = self.ensure_open()
        spec = revocation_log(self.settings.namespace)
        properties = pika.BasicProperties(
            content_type=REVOKE_CONTENT_TYPE,
            delivery_mode=2,
            headers={CLOCK_HEADER: self._clock.forward()},
            user_id=self._user_id,
        )
        try:
            channel = self._log_channel
            if channel is None or not channel.is_open:
                channel = conn.channel()
                declare_queue(channel, spec, bind=False)
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
                "revoke_not_logged", stream=spec.name, task_ids=len(entry.task_ids), error=describe_error(exc)
            )
            return False
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise self.unavailable(exc) from exc
        return True
