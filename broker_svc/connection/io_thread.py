"""The blocking side's one broker connection: pika driven by a background I/O thread.

Callers on any thread hand messages over and return at once; the I/O thread publishes them with
publisher confirms (pipelined, never one round trip per message), tracks each confirm, republishes
what a lost connection left unconfirmed, and delivers consumed messages to callbacks. A lone
message on an idle connection is written by its caller instead, under the lock the I/O thread
releases only while it waits for events (``_send_here``). This module holds the connection's life
cycle: connect, failover, reconnect with backoff, resource alarms. Sending and confirms are in
``confirms.py``, where each message is in ``outbox.py``, the timers (confirm timeout, reopen) in
``watchdog.py``; pika's parameters in ``parameters.py`` and the reading of its failures in
``failures.py``. pika's exceptions are translated here and in the control client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pika
import pika.channel
import pika.frame

from broker_svc.connection.channel import Consumer, declare, delivery_handler
from broker_svc.connection.confirms import Confirms
from broker_svc.connection.failures import describe_connect_error, is_permanent
from broker_svc.connection.outbox import Outbox
from broker_svc.connection.parameters import connection_parameters
from broker_svc.connection.pending import PendingPublish
from broker_svc.connection.pika_internals import GatheringConnection, release_while_polling
from broker_svc.connection.watchdog import Watchdog
from broker_svc.errors import BrokerSvcError, BrokerUnavailable
from broker_svc.logging import get_logger
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec

__all__ = ["BrokerConnection"]

log = get_logger(__name__)

_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0


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
        self._declared: set[str] = set()
        self._declaring: str | None = None
        self._confirms = Confirms(
            settings,
            self._outbox,
            name=name,
            declared=self._declared,
            declare_then_drain=lambda spec: self._declare(spec, on_done=self._drain),
            reopen_later=lambda pause_s: self._watchdog.reopen_later(self._conn, pause_s),
        )
        self._watchdog = Watchdog(
            settings, self._outbox, self._confirms, name=name, blocked=lambda: self._blocked_since is not None
        )
        self._lock = threading.Lock()
        # Held by the I/O thread except while its loop waits for events: a caller holding it may
        # use the connection itself (``_send_here``).
        self._io_lock = threading.Lock()
        # Set by close(); the I/O thread's reconnect backoff waits on it, so close() ends it at once.
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._conn: GatheringConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._down_since: float | None = None
        self._last_error: str | None = None  # why the last attempt failed or the connection was lost
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

    def unavailable(self) -> str | None:
        """Why nothing reaches the broker now (no connection, and the last error), or None when connected."""
        if self._ready.is_set():
            return None
        url = redact_url(self._urls[self._url_index])
        return f"no connection to {url}" + (f" ({self._last_error})" if self._last_error else "")

    @property
    def can_publish(self) -> bool:
        """Connected with a channel in confirm mode, and not blocked by a resource alarm."""
        return self._ready.is_set() and self._blocked_since is None

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
            closing=self._stopping.is_set,
            ready=self._ready,
        )
        if not self._started:
            self.start()
        if wake and not self._send_here(len(items)):
            self._call_soon(self._drain)

    def _send_here(self, count: int) -> bool:
        # The ``count`` messages just handed over, with nothing else unsent and at most as many
        # awaiting a confirm (a caller that waits for each reply, whose previous confirm may come
        # after the reply): this thread writes them as the I/O thread would, while that thread
        # waits for events, sparing a wake-up of it (2-4 % of a round trip). A stream of messages
        # still goes through the I/O thread, whose drains send many in one write (enqueue rate).
        unsent, pending = self._outbox.unsent(), len(self._outbox)
        if unsent != count or pending > 2 * count or not self._io_lock.acquire(blocking=False):
            return False
        try:
            if self._conn is None or not self._ready.is_set():
                return False
            self._drain()
            return True
        finally:
            self._io_lock.release()

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
            self._stopping.set()
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
        while not self._stopping.is_set():
            started = time.monotonic()
            self._opened = False
            self._run_connection()
            if self._stopping.is_set():
                break
            tried = 0 if self._opened else tried + 1
            if self._down_since is None:
                self._down_since = time.monotonic()
            if time.monotonic() - self._down_since > self._settings.reconnect_window_s:
                last = f" (last: {self._last_error})" if self._last_error else ""
                self._outbox.fail_all(
                    BrokerUnavailable(
                        f"no connection to {self._settings.safe_broker_url} for "
                        f"{self._settings.reconnect_window_s} s{last}"
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
            self._stopping.wait(backoff)  # reconnect backoff, cut short by close()
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        self._outbox.fail_all(BrokerUnavailable("the connection was closed before the broker confirmed"))

    def _run_connection(self) -> None:
        with self._io_lock:  # released only while the loop waits for events (``_send_here``)
            self._run_connection_locked()

    def _run_connection_locked(self) -> None:
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
            self._last_error = describe_connect_error(exc)
            log.warning("broker_connect_failed", url=redact_url(url), error=self._last_error)
            if isinstance(exc, BrokerSvcError):  # the TLS files: no retry fixes them
                self._outbox.fail_all(BrokerUnavailable(f"cannot connect to {redact_url(url)}: {exc}"))
            return
        conn.add_on_connection_blocked_callback(self._on_blocked)
        conn.add_on_connection_unblocked_callback(self._on_unblocked)
        release_while_polling(conn, self._io_lock)
        self._conn = conn
        try:
            conn.ioloop.start()
        except AssertionError:
            # pika 1.3, when close() aborts its connection workflow mid-handshake, hands itself the
            # Aborted class instead of an instance and asserts on it (base_connection.py); its
            # transport has closed the socket by then. The attempt ended, as close() asked.
            if not self._stopping.is_set():
                raise
            log.debug("connect_aborted_mid_handshake", connection=self._name)
        finally:
            self._conn = None
            conn.ioloop.close()  # releases the loop's wake-up socket pair

    def _on_open_error(self, conn: pika.SelectConnection, error: BaseException | str) -> None:
        if self._stopping.is_set():  # close() aborted the attempt: nothing failed
            conn.ioloop.stop()
            return
        url = redact_url(self._urls[self._url_index])
        reason = describe_connect_error(error)
        self._last_error = reason
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

    def _on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        self._declared.clear()
        self._confirms.channel_opened()
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._confirms.on_return)
        channel.confirm_delivery(ack_nack_callback=self._confirms.on_confirm, callback=self._on_confirm_mode)

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
        self._last_error = None
        self._outbox.requeue_retries()  # what a lost connection left unconfirmed goes out first
        self._ready.set()
        log.debug("broker_connected", connection=self._name)
        self._drain()
        if self._conn is not None:
            self._watchdog.start(self._conn)

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
            self._confirms.send(self._channel, blocked=self._blocked_since is not None)

    def _on_channel_closed(self, _ch: pika.channel.Channel, reason: BaseException) -> None:
        # A channel error (e.g. a 406 on a declare) ends the channel, not the process: start
        # over on a fresh connection so the confirm sequence begins at 1 again.
        self._channel = None
        declaring, self._declaring = self._declaring, None
        self._confirms.channel_closed(reason, declaring=declaring)
        if not self._stopping.is_set():
            log.warning("broker_channel_closed", connection=self._name, reason=str(reason))
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()

    def _on_closed(self, conn: pika.SelectConnection, reason: BaseException) -> None:
        self._ready.clear()
        self._channel = None
        self._blocked_since = None
        self._confirms.connection_lost(reason)
        self._last_error = f"lost: {reason}"
        if not self._stopping.is_set():
            log.warning("broker_connection_lost", connection=self._name, reason=str(reason))
        conn.ioloop.stop()

    def _shutdown(self) -> None:
        conn = self._conn
        if conn is None:
            return
        if not (conn.is_closing or conn.is_closed):
            # Open: the AMQP close. Still opening: pika aborts its connection workflow and closes
            # the socket it was connecting (stopping the loop here would leave that socket open).
            # Either way a close callback follows and stops the loop.
            conn.close()
        else:
            conn.ioloop.stop()
