"""Publishing on the I/O thread: send what the outbox holds, and settle each message by its confirm.

``Confirms`` is the publishing half of a ``BrokerConnection``: it writes the outbox's messages to
the channel (declaring a queue first where one is missing), tracks each delivery tag, and settles a
message when the broker acks it, nacks it (retried on a fresh connection), returns it (Unroutable),
or holds it past ``confirm_timeout_s`` behind a resource alarm. The connection's life cycle —
connect, reconnect, failover, the tick — stays in ``io_thread.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pika
import pika.channel
import pika.exceptions
import pika.frame
import pika.spec

from broker_svc.connection.channel import message_properties
from broker_svc.connection.failures import max_message_size, missing_exchange
from broker_svc.connection.outbox import Outbox
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import BrokerBlocked, BrokerUnavailable, PublishError, PublishNacked, Unroutable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec

__all__ = ["ConfirmRate", "Confirms"]

log = get_logger(__name__)

# How fast a broker is assumed to confirm until it has been measured (ETA routing).
_INITIAL_CONFIRM_RATE = 1000.0
# After a nack the channel is reopened before the message goes again, after this pause (doubled
# per nack in a row): RabbitMQ 3.10 keeps nacking a quorum queue's publishes on a channel opened
# while the queue had no leader, even once it has one, and a fresh channel is acked at once.
_NACK_PAUSE_START_S = 0.25
_NACK_PAUSE_MAX_S = 2.0


class Confirms:
    """Sends the outbox's messages and settles them by the broker's confirms (I/O thread only).

    Args:
        settings: publish attempts and timeouts.
        outbox: where each message waits, and which delivery tag it went out with.
        name: the connection's name, for logs.
        declared: the queues declared on the current channel; the connection owns it (its
            consumers' queues are in it too), a returned message drops its queue from it.
        declare_then_drain: declare a queue, then drain the outbox again.
        reopen_later: reopen the connection after a pause in seconds; False if it is not open.
    """

    def __init__(
        self,
        settings: Settings,
        outbox: Outbox,
        *,
        name: str,
        declared: set[str],
        declare_then_drain: Callable[[QueueSpec], None],
        reopen_later: Callable[[float], bool],
    ) -> None:
        self._settings = settings
        self._outbox = outbox
        self._name = name
        self._declared = declared
        self._declare_then_drain = declare_then_drain
        self._reopen_later = reopen_later
        self._returned: set[tuple[str | None, str]] = set()
        self._warned_unroutable: set[str] = set()
        self._next_tag = 1
        self._confirm_rate = ConfirmRate()
        self._nack_pause_s = _NACK_PAUSE_START_S
        self._reopening = False  # a reopen after a nack is scheduled on this connection

    def channel_opened(self) -> None:
        """A fresh channel in confirm mode: its delivery tags start at 1."""
        self._next_tag = 1

    def send(self, channel: pika.channel.Channel | None, *, blocked: bool) -> None:
        """Publish what the outbox hands out on ``channel``, in order, tracking each tag."""
        # A blocked connection takes nothing more: what waits can still fail cleanly.
        can_send = channel is not None and channel.is_open and not blocked
        taken = self._outbox.take(can_send=can_send)
        if taken is None or channel is None:
            return
        batch, oldest, ahead = taken
        now = time.monotonic()
        wall = time.time()
        # A message sent now reaches its queue only after everything sent before it (a bulk send
        # can have tens of thousands ahead), and a delay queue's TTL starts then. Guess how long
        # that takes, erring long: the messages ahead at the measured rate with half again as
        # margin, or the wait of the oldest unconfirmed message (a stalled broker).
        waited_s = now - oldest.sent_at if oldest is not None else 0.0
        seconds_per_message = 1.5 / self._confirm_rate.per_s
        for index, pending in enumerate(batch):
            if pending.done:
                continue
            if pending.eta_s is not None:
                ahead_here = ahead + index
                lag_s = max(waited_s, ahead_here * seconds_per_message) if ahead_here else 0.0
                pending.route(wall, lag_s=lag_s)
            spec = next((s for s in pending.declare if s.name not in self._declared), None)
            if spec is not None:
                # Hold this and every later message (order matters) until the queue exists; the
                # next drain declares this message's next queue, if it has one.
                self._outbox.put_back(batch[index:])
                self._declare_then_drain(spec)
                return
            try:
                props = message_properties(pending)
                channel.basic_publish(
                    pending.exchange,
                    pending.routing_key,
                    pending.message.body,
                    props,
                    mandatory=pending.mandatory,
                )
            except (ValueError, TypeError) as exc:
                pending.settle(PublishError(f"message cannot be encoded by the AMQP client: {exc}"))
                continue
            except (pika.exceptions.AMQPError, OSError) as exc:
                # The connection is going away; these go out again once it is back.
                self._outbox.put_back(batch[index:])
                log.warning("publish_failed", error=str(exc))
                return
            pending.attempts += 1
            pending.sent_at = now
            if pending.first_sent_at == 0.0:
                pending.first_sent_at = now
            self._outbox.track(self._next_tag, pending)
            self._next_tag += 1

    def on_return(
        self,
        _ch: pika.channel.Channel,
        method: pika.spec.Basic.Return,
        props: pika.spec.BasicProperties,
        _body: bytes,
    ) -> None:
        """pika's return callback: remember the message, so its ack settles it ``Unroutable``."""
        # basic.return precedes the basic.ack of the same message; remember it for the ack.
        self._returned.add((props.correlation_id, method.routing_key))
        # The queue was there when declared and is gone now: declare it again before the next
        # message for it (this one is reported Unroutable, never dropped in silence).
        self._declared.discard(method.routing_key)
        if method.routing_key not in self._warned_unroutable:
            self._warned_unroutable.add(method.routing_key)  # once per key, not per message
            log.warning("publish_returned", routing_key=method.routing_key, reply=method.reply_text)

    def on_confirm(self, frame: pika.frame.Method) -> None:
        """pika's ack/nack callback: settle (or retry) what the delivery tag covers."""
        method = frame.method
        tag: int = method.delivery_tag
        nacked = isinstance(method, pika.spec.Basic.Nack)
        settled, backlog = self._outbox.confirm(tag, multiple=bool(method.multiple))
        self._confirm_rate.confirmed(len(settled), now=time.monotonic(), backlog=backlog)
        for pending in settled:
            key = (pending.message.correlation_id, pending.routing_key)
            if key in self._returned:
                self._returned.discard(key)
                pending.settle(Unroutable(f"no queue is bound for routing key {pending.routing_key!r}"))
            elif nacked:
                self._retry_after_nack(pending)
            else:
                pending.settle()
        if settled and not nacked:
            self._nack_pause_s = _NACK_PAUSE_START_S

    def _retry_after_nack(self, pending: PendingPublish) -> None:
        # Retried, on a fresh channel, until it has had its attempts *and* confirm_timeout_s has
        # passed since it was first sent: a leader election takes seconds, attempts take ms.
        spent_s = time.monotonic() - pending.first_sent_at
        if pending.attempts >= self._settings.publish_attempts and spent_s > self._settings.confirm_timeout_s:
            pending.settle(PublishNacked(f"the broker refused the message (nack) for {spent_s:.1f} s"))
            return
        self._outbox.retry_later(pending)
        if self._reopening or not self._reopen_later(self._nack_pause_s):
            return
        self._reopening = True
        log.warning("publish_nacked_reopening", connection=self._name, pause_s=self._nack_pause_s)
        self._nack_pause_s = min(self._nack_pause_s * 2, _NACK_PAUSE_MAX_S)

    def expire_blocked(self) -> None:
        """Fail what waited longer than ``confirm_timeout_s`` on a blocked connection.

        Unsent messages leave the outbox (they were never written, so never enqueued); sent ones
        stop being tracked, as the broker may still take them when the alarm clears.
        """
        cutoff = time.monotonic() - self._settings.confirm_timeout_s
        expired = self._outbox.expire(cutoff)
        error = BrokerBlocked(
            f"the broker blocked publishing (memory or disk alarm) for over "
            f"{self._settings.confirm_timeout_s} s"
        )
        for pending in expired:
            pending.settle(error)

    def channel_closed(self, reason: BaseException, *, declaring: str | None) -> None:
        """Fail what the channel's close says cannot succeed: a message over the broker's size
        limit, or one for a queue whose declaration (``declaring``) the broker refused."""
        limit = max_message_size(reason)
        if limit is not None:
            self._outbox.fail_oversized(limit, reason)
        exchange = missing_exchange(reason)
        if exchange is not None:
            # Sent to an exchange nobody declared (exchange=): retrying cannot help.
            self._outbox.fail_held_where(
                lambda p: p.exchange == exchange,
                Unroutable(f"no exchange {exchange!r}: declare it (and bind a queue) before sending to it"),
            )
        # A publish to a missing exchange closes the channel too, possibly while another queue's
        # declaration is in flight: that close is the publish's fault, not the declaration's.
        if (
            exchange is None
            and declaring is not None
            and isinstance(reason, pika.exceptions.ChannelClosedByBroker)
        ):
            # The broker refused the declaration itself (406 different arguments, 403 access):
            # retrying cannot help, so the messages for that queue fail now, with the reason.
            self._outbox.fail_where(
                lambda p: any(spec.name == declaring for spec in p.declare),
                PublishError(f"the broker refused to declare queue {declaring!r}: {reason}"),
            )

    def connection_lost(self, reason: BaseException) -> None:
        """What was sent and not confirmed goes again on the next connection, or fails if spent."""
        self._reopening = False
        lost = self._outbox.take_unconfirmed()
        self._returned.clear()
        for pending in lost:
            if pending.attempts >= self._settings.publish_attempts:
                pending.settle(BrokerUnavailable(f"connection lost before confirm: {reason}"))
            else:
                self._outbox.retry_later(pending)


class ConfirmRate:
    """How many messages a second the broker confirms while it has a backlog (I/O thread only).

    A message sent behind N unconfirmed ones reaches its queue about N / rate seconds later; ETA
    routing needs that, because a delay queue's TTL only starts then.
    """

    def __init__(self) -> None:
        self.per_s = _INITIAL_CONFIRM_RATE
        self._since: float | None = None
        self._count = 0

    def confirmed(self, count: int, *, now: float, backlog: bool) -> None:
        """Count ``count`` confirms; ``backlog`` says whether unconfirmed messages remain."""
        if self._since is None:  # idle time says nothing about the broker's speed
            if backlog:
                self._since, self._count = now, 0
            return
        self._count += count
        elapsed = now - self._since
        if elapsed >= 0.5:
            self.per_s = 0.5 * self.per_s + 0.5 * max(self._count / elapsed, 1.0)
            self._since, self._count = (now, 0) if backlog else (None, 0)
        elif not backlog:
            self._since = None
