"""The blocking side's one broker connection: pika driven by a background I/O thread.

Callers on any thread hand messages over and return at once; the I/O thread publishes them with
publisher confirms (pipelined, never one round trip per message), tracks each confirm, republishes
what a lost connection left unconfirmed, and delivers consumed messages to callbacks. Where each
message is lives in ``outbox.py``; pika's parameters in ``parameters.py`` and the reading of its
failures in ``failures.py``. pika's exceptions are translated here and in the control client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pika
import pika.channel
import pika.exceptions
import pika.frame
import pika.spec
import structlog

from broker_svc.connection.channel import Consumer, declare, delivery_handler, message_properties
from broker_svc.connection.failures import describe_connect_error, is_permanent, max_message_size
from broker_svc.connection.outbox import Outbox
from broker_svc.connection.parameters import connection_parameters
from broker_svc.connection.pending import PendingPublish, _ConfirmRate
from broker_svc.connection.pika_internals import GatheringConnection, abort_connection
from broker_svc.errors import (
    BrokerBlocked,
    BrokerSvcError,
    BrokerUnavailable,
    PublishError,
    PublishNacked,
    Unroutable,
)
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec

__all__ = ["BrokerConnection"]

log = structlog.get_logger(__name__)

_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0
_TICK_S = 0.5
_CLOSE_GRACE_S = 1.0
# After a nack the channel is reopened before the message goes again, after this pause (doubled
# per nack in a row): RabbitMQ 3.10 keeps nacking a quorum queue's publishes on a channel opened
# while the queue had no leader, even once it has one, and a fresh channel is acked at once.
_NACK_PAUSE_START_S = 0.25
_NACK_PAUSE_MAX_S = 2.0


class BrokerConnection:
    """A pika connection run by its own daemon thread, with reconnect and pipelined confirms.

    Args:
        settings: broker URL, timeouts and retry bounds.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        consumers: queues to declare and consume (auto-ack) on every (re)connect.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        consumers: Sequence[tuple[QueueSpec, Consumer]] = (),
    ) -> None:
        self._settings = settings
        self._name = name
        self._consumers = list(consumers)
        self._urls = settings.broker_urls
        self._url_index = 0  # the URL the next attempt goes to (failover order)
        self._opened = False  # whether the current attempt got as far as an open connection
        self._blocked_since: float | None = None  # a resource alarm blocks the connection
        self._outbox = Outbox()
        self._returned: set[tuple[str | None, str]] = set()
        self._declared: set[str] = set()
        self._warned_unroutable: set[str] = set()
        self._declaring: str | None = None
        self._next_tag = 1
        self._lock = threading.Lock()
        self._stopping = False
        self._ready = threading.Event()
        self._conn: GatheringConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._down_since: float | None = None
        self._confirm_rate = _ConfirmRate()
        self._nack_pause_s = _NACK_PAUSE_START_S
        self._reopening = False  # a reopen after a nack is scheduled on this connection
        self._thread = threading.Thread(target=self._run, name=f"clockwork-io-{name}", daemon=True)
        self._started = False

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the I/O thread (idempotent); connecting happens in the background."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until connected with a channel in confirm mode."""
        return self._ready.wait(timeout)

    @property
    def pending_count(self) -> int:
        """Messages handed over and not yet settled."""
        return len(self._outbox)

    def publish(self, pending: PendingPublish) -> None:
        """Hand a message to the I/O thread; returns without waiting for the broker.

        Raises:
            BrokerUnavailable: the connection was closed.
        """
        self.publish_many((pending,))

    def publish_many(self, items: Sequence[PendingPublish]) -> None:
        """Hand several messages over in one wake-up of the I/O thread.

        Raises:
            BrokerUnavailable: the connection was closed.
        """
        wake = self._outbox.put(
            items,
            max_pending=self._settings.max_unconfirmed,
            closing=lambda: self._stopping,
            ready=self._ready,
        )
        if not self._started:
            self.start()
        if wake:
            self._call_soon(self._drain)

    def call(self, fn: Callable[[pika.channel.Channel, Callable[[], None]], None], timeout: float) -> None:
        """Run ``fn(channel, done)`` on the I/O thread and wait until it calls ``done``.

        Raises:
            BrokerUnavailable: not connected, or ``done`` was not called within ``timeout``.
        """
        finished = threading.Event()
        if not self.wait_ready(timeout):
            raise BrokerUnavailable(f"not connected to {self._settings.safe_broker_url}")

        def run() -> None:
            if self._channel is None or not self._channel.is_open:
                return
            fn(self._channel, finished.set)

        self._call_soon(run)
        if not finished.wait(timeout):
            raise BrokerUnavailable(f"broker operation did not finish within {timeout} s")

    def delete_queue(self, name: str, timeout: float) -> None:
        """Delete a queue (used for a client's result queue on close).

        Raises:
            BrokerUnavailable: not connected, or the broker did not answer in time.
        """

        def run(channel: pika.channel.Channel, done: Callable[[], None]) -> None:
            channel.queue_delete(name, callback=lambda _frame: done())

        self.call(run, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread; what is still unsettled fails with ``BrokerUnavailable``."""
        with self._lock:
            self._stopping = True
            started = self._started
        if started:
            self._call_soon(self._shutdown)
            self._thread.join(timeout)
        self._outbox.fail_all(BrokerUnavailable("the connection was closed before the broker confirmed"))

    # -- I/O thread ------------------------------------------------------------------------------

    def _call_soon(self, fn: Callable[[], None]) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            conn.ioloop.add_callback_threadsafe(fn)
        except Exception:  # the loop is gone; the run loop settles everything on its way out
            log.debug("io_loop_unavailable", connection=self._name)

    def _run(self) -> None:
        backoff = _BACKOFF_START_S
        tried = 0  # failed attempts since the last open connection
        while not self._stopping:
            started = time.monotonic()
            self._opened = False
            self._run_connection()
            if self._stopping:
                break
            tried = 0 if self._opened else tried + 1
            if self._down_since is None:
                self._down_since = time.monotonic()
            if time.monotonic() - self._down_since > self._settings.reconnect_window_s:
                self._outbox.fail_all(
                    BrokerUnavailable(
                        f"no connection to {self._settings.safe_broker_url} for "
                        f"{self._settings.reconnect_window_s} s"
                    )
                )
                self._down_since = time.monotonic()
            if len(self._urls) > 1:
                # Failover: a lost connection or a failed attempt moves on to the next broker; only
                # a whole round of failed attempts waits out the backoff.
                self._url_index = (self._url_index + 1) % len(self._urls)
                log.info(
                    "broker_failover", connection=self._name, url=redact_url(self._urls[self._url_index])
                )
                if tried < len(self._urls):
                    continue
                tried = 0
            if time.monotonic() - started > 10:
                backoff = _BACKOFF_START_S  # it was up for a while: retry quickly
            time.sleep(backoff)  # reconnect backoff on the I/O thread; no caller waits on it
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        self._outbox.fail_all(BrokerUnavailable("the connection was closed before the broker confirmed"))

    def _run_connection(self) -> None:
        url = self._urls[self._url_index]
        try:
            params = connection_parameters(self._settings, connection_name=self._name, url=url)
            # We time blocked publishes ourselves and keep the connection, so publishing resumes
            # as soon as the alarm clears (pika's timeout would drop it and republish into it).
            params.blocked_connection_timeout = None
            conn = GatheringConnection(
                params,
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
        except Exception as exc:
            log.warning("broker_connect_failed", url=redact_url(url), error=describe_connect_error(exc))
            if isinstance(exc, BrokerSvcError):  # the TLS files: no retry fixes them
                self._outbox.fail_all(BrokerUnavailable(f"cannot connect to {redact_url(url)}: {exc}"))
            return
        conn.add_on_connection_blocked_callback(self._on_blocked)
        conn.add_on_connection_unblocked_callback(self._on_unblocked)
        self._conn = conn
        try:
            conn.ioloop.start()
        finally:
            self._conn = None
            conn.ioloop.close()  # releases the loop's wake-up socket pair

    def _on_open_error(self, conn: pika.SelectConnection, error: BaseException | str) -> None:
        url = redact_url(self._urls[self._url_index])
        reason = describe_connect_error(error)
        log.warning("broker_connect_failed", url=url, error=reason)
        if is_permanent(error):
            # Wrong credentials, vhost or certificates will not fix themselves: fail what waits
            # now, keep trying in the background for what comes later.
            self._outbox.fail_all(BrokerUnavailable(f"broker {url} refused the connection: {reason}"))
        conn.ioloop.stop()

    def _on_open(self, conn: pika.SelectConnection) -> None:
        self._opened = True
        conn.channel(on_open_callback=self._on_channel_open)

    def _on_blocked(self, _conn: pika.SelectConnection, frame: pika.frame.Method) -> None:
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        log.warning("broker_blocked", connection=self._name, reason=getattr(frame.method, "reason", ""))

    def _on_unblocked(self, _conn: pika.SelectConnection, _frame: pika.frame.Method) -> None:
        blocked_s = 0.0 if self._blocked_since is None else time.monotonic() - self._blocked_since
        self._blocked_since = None
        log.warning("broker_unblocked", connection=self._name, blocked_s=round(blocked_s, 3))
        self._drain()

    def _expire_blocked(self) -> None:
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

    def _on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        self._declared.clear()
        self._next_tag = 1
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: pika.frame.Method) -> None:
        assert self._channel is not None
        self._start_consumers(list(self._consumers))

    def _start_consumers(self, remaining: list[tuple[QueueSpec, Consumer]]) -> None:
        # Consumers first (a reply queue must exist before any task names it), then publishing.
        channel = self._channel
        if channel is None:
            return
        if remaining:
            spec, callback = remaining[0]

            def consume() -> None:
                channel.basic_consume(
                    spec.name, delivery_handler(callback, connection_name=self._name), auto_ack=True
                )
                self._start_consumers(remaining[1:])

            self._declare(spec, on_done=consume)
            return
        self._down_since = None
        self._outbox.requeue_retries()  # what a lost connection left unconfirmed goes out first
        self._ready.set()
        log.debug("broker_connected", connection=self._name)
        self._drain()
        self._schedule_tick()

    def _declare(self, spec: QueueSpec, on_done: Callable[[], None] | None = None) -> None:
        """Declare a queue (and its exchange and binding); ``on_done`` runs after the bind-ok."""
        channel = self._channel
        if channel is None:
            return
        self._declaring = spec.name

        def bound() -> None:
            self._declared.add(spec.name)
            self._declaring = None
            if on_done is not None:
                on_done()

        declare(channel, spec, on_bound=bound)

    def _drain(self) -> None:
        conn = self._conn
        if conn is None:
            return
        with conn.gathered():  # the batch goes to the socket in a few large writes
            self._send_taken()

    def _send_taken(self) -> None:
        channel = self._channel
        # A blocked connection takes nothing more: what waits can still fail cleanly.
        can_send = channel is not None and channel.is_open and self._blocked_since is None
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
                self._declare(spec, on_done=self._drain)
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

    def _on_return(
        self,
        _ch: pika.channel.Channel,
        method: pika.spec.Basic.Return,
        props: pika.spec.BasicProperties,
        _body: bytes,
    ) -> None:
        # basic.return precedes the basic.ack of the same message; remember it for the ack.
        self._returned.add((props.correlation_id, method.routing_key))
        # The queue was there when declared and is gone now: declare it again before the next
        # message for it (this one is reported Unroutable, never dropped in silence).
        self._declared.discard(method.routing_key)
        if method.routing_key not in self._warned_unroutable:
            self._warned_unroutable.add(method.routing_key)  # once per key, not per message
            log.warning("publish_returned", routing_key=method.routing_key, reply=method.reply_text)

    def _on_confirm(self, frame: pika.frame.Method) -> None:
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
        conn = self._conn
        if self._reopening or conn is None or not conn.is_open:
            return
        self._reopening = True
        log.warning("publish_nacked_reopening", connection=self._name, pause_s=self._nack_pause_s)
        conn.ioloop.call_later(self._nack_pause_s, lambda: self._reopen(conn, "reopen after nack"))
        self._nack_pause_s = min(self._nack_pause_s * 2, _NACK_PAUSE_MAX_S)

    def _reopen(self, conn: pika.SelectConnection, why: str) -> None:
        # The whole connection, not just the channel: the confirm sequence restarts at 1 and
        # unconfirmed messages are republished by the usual path (``_on_closed``).
        if conn.is_open:
            conn.close(reply_code=320, reply_text=why)
            # pika waits for the broker's close-ok without a limit, and a frozen or partitioned
            # broker never sends it: drop the socket if it has not come soon.
            conn.ioloop.call_later(_CLOSE_GRACE_S, lambda: self._abort(conn))

    def _schedule_tick(self) -> None:
        if self._conn is not None:
            self._conn.ioloop.call_later(_TICK_S, self._tick)

    def _tick(self) -> None:
        # A broker that never confirms (frozen node, alarm) must not block callers forever:
        # drop the connection so unconfirmed messages are republished on a fresh one.
        conn = self._conn
        if conn is None or not conn.is_open:
            return
        if self._blocked_since is not None:
            # An alarm, not a dead broker: a new connection would be blocked too.
            self._expire_blocked()
            self._schedule_tick()
            return
        oldest = self._outbox.oldest_sent_at()
        if oldest is not None and time.monotonic() - oldest > self._settings.confirm_timeout_s:
            log.warning("confirm_timeout", timeout_s=self._settings.confirm_timeout_s)
            self._reopen(conn, "confirm timeout")
            return
        self._schedule_tick()

    def _abort(self, conn: pika.SelectConnection) -> None:
        if conn.is_closed:
            return
        log.warning("broker_unresponsive", connection=self._name, grace_s=_CLOSE_GRACE_S)
        abort_connection(conn)  # ends in on_close_callback

    def _on_channel_closed(self, _ch: pika.channel.Channel, reason: BaseException) -> None:
        # A channel error (e.g. a 406 on a declare) ends the channel, not the process: start
        # over on a fresh connection so the confirm sequence begins at 1 again.
        self._channel = None
        declaring, self._declaring = self._declaring, None
        limit = max_message_size(reason)
        if limit is not None:
            self._outbox.fail_oversized(limit, reason)
        if declaring is not None and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # The broker refused the declaration itself (406 different arguments, 403 access):
            # retrying cannot help, so the messages for that queue fail now, with the reason.
            self._outbox.fail_where(
                lambda p: any(spec.name == declaring for spec in p.declare),
                PublishError(f"the broker refused to declare queue {declaring!r}: {reason}"),
            )
        if not self._stopping:
            log.warning("broker_channel_closed", connection=self._name, reason=str(reason))
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()

    def _on_closed(self, conn: pika.SelectConnection, reason: BaseException) -> None:
        self._ready.clear()
        self._channel = None
        self._reopening = False
        self._blocked_since = None
        lost = self._outbox.take_unconfirmed()
        self._returned.clear()
        for pending in lost:
            if pending.attempts >= self._settings.publish_attempts:
                pending.settle(BrokerUnavailable(f"connection lost before confirm: {reason}"))
            else:
                self._outbox.retry_later(pending)
        if not self._stopping:
            log.warning("broker_connection_lost", connection=self._name, reason=str(reason))
        conn.ioloop.stop()

    def _shutdown(self) -> None:
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()
        elif conn is not None:
            conn.ioloop.stop()
