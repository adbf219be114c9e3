"""The blocking side's one broker connection: pika driven by a background I/O thread.

Callers on any thread hand messages over and return at once; the I/O thread publishes them with
publisher confirms (pipelined, never one round trip per message), tracks each confirm, republishes
what a lost connection left unconfirmed, and delivers consumed messages to callbacks. This is the
only module that imports pika, so pika's exceptions are translated here.
"""

from __future__ import annotations

import collections
import re
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import pika
import pika.channel
import pika.exceptions
import pika.frame
import pika.spec
import structlog

from broker_svc.errors import (
    BrokerBlocked,
    BrokerSvcError,
    BrokerUnavailable,
    MessageTooLarge,
    PublishError,
    PublishNacked,
    Unroutable,
)
from broker_svc.message import RESENT_HEADER
from broker_svc.pending import Delivery, PendingPublish, _ConfirmRate
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec

__all__ = [
    "BrokerConnection",
    "Consumer",
    "Delivery",
    "PendingPublish",
    "all_connection_parameters",
    "connection_parameters",
    "describe_connect_error",
]

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


# An OpenSSL error as text: with TLS 1.3 the server's refusal of our certificate arrives after the
# handshake, so pika reports it as a lost stream whose message holds the alert.
_TLS_ERROR_TEXT = re.compile(r"\[SSL: ([A-Z0-9_]+)\] ([^(']+?) \(_ssl")
# RabbitMQ's text when a message is over its ``max_message_size`` (406 on the channel).
_MAX_SIZE_TEXT = re.compile(r"larger than configured max size (\d+)")


def _causes(error: BaseException | str) -> list[BaseException | str]:
    """``error`` and the exceptions pika wrapped in it (a connection workflow keeps them in args)."""
    found: list[BaseException | str] = [error]
    index = 0
    while index < len(found):
        item = found[index]
        index += 1
        if isinstance(item, BaseException):
            # pika's connection workflow keeps a list (``exceptions``), each phase one (``exception``).
            wrapped = [*item.args, *getattr(item, "exceptions", ()), getattr(item, "exception", None)]
            found.extend(a for a in wrapped if isinstance(a, BaseException) and a not in found)
            if item.__cause__ is not None and item.__cause__ not in found:
                found.append(item.__cause__)
    return found


def _is_permanent(error: BaseException | str) -> bool:
    """Wrong credentials, vhost or TLS setup: retrying the same way cannot succeed."""
    for cause in _causes(error):
        if isinstance(
            cause, pika.exceptions.ProbableAuthenticationError | pika.exceptions.ProbableAccessDeniedError
        ):
            return True
        if isinstance(cause, pika.exceptions.ConnectionClosedByBroker) and cause.reply_code in (403, 530):
            return True
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError):
            return True  # certificate refused, on either side
    return _tls_alert(error) is not None


def _tls_alert(error: BaseException | str) -> str | None:
    """The OpenSSL reason (``tlsv13 alert certificate required``) a failure's text carries, if any."""
    for cause in _causes(error):
        text = cause if isinstance(cause, str) else f"{cause!s} {cause!r}"
        found = _TLS_ERROR_TEXT.search(text)
        if found and ("ALERT" in found.group(1) or "VERIFY" in found.group(1)):
            return found.group(2).strip()
    return None


def describe_connect_error(error: BaseException | str) -> str:
    """One readable line for a failed connection attempt: the innermost cause pika wrapped."""
    causes = _causes(error)
    for cause in reversed(causes):
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError):
            return f"TLS handshake failed: {cause}"
    alert = _tls_alert(error)
    if alert is not None:
        return f"TLS handshake failed: {alert}"
    inner = causes[-1]
    if isinstance(inner, BaseException):
        return f"{type(inner).__name__}: {inner}"
    return str(inner)


Consumer = Callable[[Delivery], None]


def connection_parameters(
    settings: Settings, *, connection_name: str, url: str | None = None
) -> pika.URLParameters:
    """pika's parameters for one connection attempt to a broker ``settings`` name.

    The vhost comes from ``Settings.virtual_host``, heartbeat and timeouts from their settings,
    TLS from ``Settings.tls_context``; the connection makes one attempt, as each caller retries
    (and fails over) in its own way.

    Args:
        settings: the broker URL(s), TLS options and the connection timeouts.
        connection_name: the name shown by ``rabbitmqctl list_connections``.
        url: which of ``settings.broker_urls`` to connect to (default: the first).

    Raises:
        ValueError: pika rejects the URL (a bad port or query parameter).
        ConfigurationError: the TLS files cannot be loaded.
    """
    url = url or settings.broker_urls[0]
    params = pika.URLParameters(url)
    params.virtual_host = settings.virtual_host  # pika reads "//" as vhost ""
    params.heartbeat = settings.heartbeat_s
    params.socket_timeout = settings.connect_timeout_s
    params.stack_timeout = settings.connect_timeout_s * 2
    # Blocked connections (resource alarms) are timed per publish by BrokerConnection, which keeps
    # the connection so publishing resumes when the alarm clears; the control client uses this.
    params.blocked_connection_timeout = settings.confirm_timeout_s
    params.connection_attempts = 1
    params.client_properties = {"connection_name": connection_name, "product": "clockwork"}
    context = settings.tls_context(url)
    if context is not None:
        params.ssl_options = pika.SSLOptions(context)
    return params


def all_connection_parameters(settings: Settings, *, connection_name: str) -> list[pika.URLParameters]:
    """Parameters for every URL of ``settings.broker_urls``, in failover order.

    Raises:
        ValueError: pika rejects a URL.
        ConfigurationError: the TLS files cannot be loaded.
    """
    return [
        connection_parameters(settings, connection_name=connection_name, url=url)
        for url in settings.broker_urls
    ]


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
        self._outbox: collections.deque[PendingPublish] = collections.deque()
        self._retry: collections.deque[PendingPublish] = collections.deque()
        self._unconfirmed: dict[int, PendingPublish] = {}
        self._returned: set[tuple[str | None, str]] = set()
        self._declared: set[str] = set()
        self._warned_unroutable: set[str] = set()
        self._declaring: str | None = None
        self._next_tag = 1
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._space_waiters = 0
        self._wake_pending = False
        self._stopping = False
        self._ready = threading.Event()
        self._conn: pika.SelectConnection | None = None
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
        with self._lock:
            return self._pending_locked()

    def _pending_locked(self) -> int:
        return len(self._outbox) + len(self._retry) + len(self._unconfirmed)

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
        with self._lock:
            # Backpressure: a producer faster than the broker waits here instead of growing the
            # outbox without bound. Confirms and failures make room.
            limit = max(self._settings.max_unconfirmed, len(items))
            while not self._stopping and self._pending_locked() + len(items) > limit:
                self._space_waiters += 1
                try:
                    self._space.wait(1.0)
                finally:
                    self._space_waiters -= 1
            if self._stopping:
                raise BrokerUnavailable("the connection is closed")
            now = time.monotonic()
            for pending in items:
                if not pending.attempts:
                    pending.sent_at = now  # handed over: a blocked connection times it from here
            self._outbox.extend(items)
            wake = not self._wake_pending and self._ready.is_set()
            if wake:
                self._wake_pending = True
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
        self._fail_all(BrokerUnavailable("the connection was closed before the broker confirmed"))

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
                self._fail_all(
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
        self._fail_all(BrokerUnavailable("the connection was closed before the broker confirmed"))

    def _run_connection(self) -> None:
        url = self._urls[self._url_index]
        try:
            params = connection_parameters(self._settings, connection_name=self._name, url=url)
            # We time blocked publishes ourselves and keep the connection, so publishing resumes
            # as soon as the alarm clears (pika's timeout would drop it and republish into it).
            params.blocked_connection_timeout = None
            conn = pika.SelectConnection(
                params,
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
        except Exception as exc:
            log.warning("broker_connect_failed", url=redact_url(url), error=describe_connect_error(exc))
            if isinstance(exc, BrokerSvcError):  # the TLS files: no retry fixes them
                self._fail_all(BrokerUnavailable(f"cannot connect to {redact_url(url)}: {exc}"))
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
        if _is_permanent(error):
            # Wrong credentials, vhost or certificates will not fix themselves: fail what waits
            # now, keep trying in the background for what comes later.
            self._fail_all(BrokerUnavailable(f"broker {url} refused the connection: {reason}"))
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
        with self._lock:
            expired = [p for p in (*self._outbox, *self._retry) if p.sent_at < cutoff]
            if expired:
                gone = {id(p) for p in expired}
                for queue in (self._outbox, self._retry):
                    kept = [p for p in queue if id(p) not in gone]
                    queue.clear()
                    queue.extend(kept)
            for tag in [t for t, p in self._unconfirmed.items() if p.sent_at < cutoff]:
                expired.append(self._unconfirmed.pop(tag))
            if expired:
                self._space.notify_all()
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
                channel.basic_consume(spec.name, self._deliver(callback), auto_ack=True)
                self._start_consumers(remaining[1:])

            self._declare(spec, on_done=consume)
            return
        self._down_since = None
        with self._lock:
            # What a lost connection left unconfirmed goes out first, in its original order.
            self._outbox.extendleft(reversed(self._retry))
            self._retry.clear()
            self._wake_pending = True
        self._ready.set()
        log.debug("broker_connected", connection=self._name)
        self._drain()
        self._schedule_tick()

    def _deliver(self, callback: Consumer) -> Callable[..., None]:
        def on_message(
            _ch: pika.channel.Channel,
            method: pika.spec.Basic.Deliver,
            props: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:
            delivery = Delivery(
                body=body,
                content_type=props.content_type,
                correlation_id=props.correlation_id,
                headers=props.headers or {},
                routing_key=method.routing_key,
                redelivered=bool(method.redelivered),
            )
            try:
                callback(delivery)
            except Exception:
                log.exception("consumer_callback_failed", connection=self._name)

        return on_message

    def _declare(self, spec: QueueSpec, on_done: Callable[[], None] | None = None) -> None:
        """Declare a queue (and its exchange and binding); ``on_done`` runs after the bind-ok.

        pika holds RPCs back while another is in flight but sends publishes at once, so a publish
        must wait for ``on_done`` rather than rely on channel ordering.
        """
        channel = self._channel
        if channel is None:
            return
        exchange = spec.exchange
        self._declaring = spec.name

        def bound(_frame: pika.frame.Method | None = None) -> None:
            self._declared.add(spec.name)
            self._declaring = None
            if on_done is not None:
                on_done()

        def declare_queue(_frame: pika.frame.Method | None = None) -> None:
            channel.queue_declare(
                spec.name,
                durable=spec.durable,
                exclusive=spec.exclusive,
                auto_delete=spec.auto_delete,
                arguments=spec.arguments or None,
                callback=bind if exchange is not None else bound,
            )

        def bind(_frame: pika.frame.Method) -> None:
            assert exchange is not None
            channel.queue_bind(spec.name, exchange.name, routing_key=spec.routing_key, callback=bound)

        if exchange is not None:
            channel.exchange_declare(
                exchange.name,
                exchange_type=exchange.type,
                durable=exchange.durable,
                auto_delete=exchange.auto_delete,
                callback=declare_queue,
            )
        else:
            declare_queue()

    def _drain(self) -> None:
        channel = self._channel
        with self._lock:
            self._wake_pending = False
            if channel is None or not channel.is_open or self._blocked_since is not None:
                return  # a blocked connection takes nothing more: what waits can still fail cleanly
            batch = list(self._outbox)
            self._outbox.clear()
            oldest = next(iter(self._unconfirmed.values()), None)  # lowest tag: sent first
            ahead = len(self._unconfirmed)
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
                with self._lock:
                    self._outbox.extendleft(reversed(batch[index:]))
                self._declare(spec, on_done=self._drain)
                return
            msg = pending.message
            # A resend says so: the earlier send may have been enqueued, so this can be a duplicate.
            headers = {**msg.headers, RESENT_HEADER: pending.attempts} if pending.attempts else msg.headers
            props = pika.BasicProperties(
                content_type=msg.content_type,
                content_encoding=msg.content_encoding,
                headers=headers,
                delivery_mode=msg.delivery_mode,
                priority=msg.priority,
                correlation_id=msg.correlation_id,
                reply_to=msg.reply_to,
                expiration=msg.expiration,
            )
            try:
                channel.basic_publish(
                    pending.exchange, pending.routing_key, msg.body, props, mandatory=pending.mandatory
                )
            except (ValueError, TypeError) as exc:
                pending.settle(PublishError(f"message cannot be encoded by the AMQP client: {exc}"))
                continue
            except (pika.exceptions.AMQPError, OSError) as exc:
                # The connection is going away; these go out again once it is back.
                with self._lock:
                    self._outbox.extendleft(reversed(batch[index:]))
                log.warning("publish_failed", error=str(exc))
                return
            pending.attempts += 1
            pending.sent_at = now
            if pending.first_sent_at == 0.0:
                pending.first_sent_at = now
            with self._lock:
                self._unconfirmed[self._next_tag] = pending
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
        with self._lock:
            if method.multiple:
                # Tags grow with insertion order, so the settled ones are a prefix: O(settled).
                tags = []
                for t in self._unconfirmed:
                    if t > tag:
                        break
                    tags.append(t)
            else:
                tags = [tag] if tag in self._unconfirmed else []
            settled = [self._unconfirmed.pop(t) for t in tags]
            backlog = bool(self._unconfirmed)
            if self._space_waiters:
                self._space.notify_all()
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
        with self._lock:
            self._retry.append(pending)
        conn = self._conn
        if self._reopening or conn is None or not conn.is_open:
            return
        self._reopening = True
        log.warning("publish_nacked_reopening", connection=self._name, pause_s=self._nack_pause_s)
        conn.ioloop.call_later(self._nack_pause_s, lambda: self._reopen(conn))
        self._nack_pause_s = min(self._nack_pause_s * 2, _NACK_PAUSE_MAX_S)

    def _reopen(self, conn: pika.SelectConnection) -> None:
        # The whole connection, not just the channel: the confirm sequence restarts at 1 and
        # unconfirmed messages are republished by the usual path (``_on_closed``).
        if conn.is_open:
            conn.close(reply_code=320, reply_text="reopen after nack")
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
        with self._lock:
            first = next(iter(self._unconfirmed.values()), None)  # lowest tag: sent first
            oldest = first.sent_at if first is not None else None
        if oldest is not None and time.monotonic() - oldest > self._settings.confirm_timeout_s:
            log.warning("confirm_timeout", timeout_s=self._settings.confirm_timeout_s)
            conn.close(reply_code=320, reply_text="confirm timeout")
            # pika waits for the broker's close-ok without a limit, and a frozen or partitioned
            # broker never sends it: drop the socket if it has not come soon.
            conn.ioloop.call_later(_CLOSE_GRACE_S, lambda: self._abort(conn))
            return
        self._schedule_tick()

    def _abort(self, conn: pika.SelectConnection) -> None:
        if conn.is_closed:
            return
        log.warning("broker_unresponsive", connection=self._name, grace_s=_CLOSE_GRACE_S)
        conn._adapter_disconnect_stream()  # pika's own abort: ends in on_close_callback

    def _on_channel_closed(self, _ch: pika.channel.Channel, reason: BaseException) -> None:
        # A channel error (e.g. a 406 on a declare) ends the channel, not the process: start
        # over on a fresh connection so the confirm sequence begins at 1 again.
        self._channel = None
        declaring, self._declaring = self._declaring, None
        limit = _max_size(reason)
        if limit is not None:
            self._fail_oversized(limit, reason)
        if declaring is not None and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # The broker refused the declaration itself (406 different arguments, 403 access):
            # retrying cannot help, so the messages for that queue fail now, with the reason.
            self._fail_where(
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
        with self._lock:
            lost = [self._unconfirmed[t] for t in sorted(self._unconfirmed)]
            self._unconfirmed.clear()
            self._returned.clear()
        for pending in lost:
            if pending.attempts >= self._settings.publish_attempts:
                pending.settle(BrokerUnavailable(f"connection lost before confirm: {reason}"))
            else:
                with self._lock:
                    self._retry.append(pending)
        if not self._stopping:
            log.warning("broker_connection_lost", connection=self._name, reason=str(reason))
        conn.ioloop.stop()

    def _shutdown(self) -> None:
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()
        elif conn is not None:
            conn.ioloop.stop()

    def _fail_where(self, matches: Callable[[PendingPublish], bool], error: BrokerSvcError) -> None:
        with self._lock:
            failing = [p for p in self._outbox if matches(p)]
            kept = [p for p in self._outbox if not matches(p)]
            self._outbox.clear()
            self._outbox.extend(kept)
            self._space.notify_all()
        for pending in failing:
            pending.settle(error)

    def _fail_oversized(self, limit: int, reason: BaseException) -> None:
        # The broker closed the channel for one message over its max_message_size: that one (and
        # any other that big) fails; the rest go out again on the next channel, never lost.
        with self._lock:
            too_big = [t for t, p in self._unconfirmed.items() if len(p.message.body) > limit]
            failing = [self._unconfirmed.pop(t) for t in too_big]
        self._fail_where(lambda p: len(p.message.body) > limit, MessageTooLarge(f"broker refused: {reason}"))
        for pending in failing:
            pending.settle(
                MessageTooLarge(f"the broker refused a body of {len(pending.message.body)} bytes: {reason}")
            )

    def _fail_all(self, error: BrokerSvcError) -> None:
        with self._lock:
            items = [*self._outbox, *self._retry, *self._unconfirmed.values()]
            self._outbox.clear()
            self._retry.clear()
            self._unconfirmed.clear()
            self._space.notify_all()
        for pending in items:
            pending.settle(error)


def _max_size(reason: BaseException) -> int | None:
    """The broker's ``max_message_size`` when it closed a channel for a message over it."""
    if not isinstance(reason, pika.exceptions.ChannelClosedByBroker) or reason.reply_code != 406:
        return None
    found = _MAX_SIZE_TEXT.search(str(reason.reply_text))
    return int(found.group(1)) if found else None
