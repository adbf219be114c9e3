"""The I/O thread's timers on an open connection: drop a broker that stopped confirming, reopen after
a nack, and abort a close the broker never answers.

Split from ``io_thread.py``, which keeps the connection's life cycle; this runs on the I/O thread
too, through the connection's ``call_later``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pika

from broker_svc.connection.confirms import Confirms
from broker_svc.connection.outbox import Outbox
from broker_svc.connection.pika_internals import abort_connection
from broker_svc.logging import get_logger
from broker_svc.settings import Settings

__all__ = ["Watchdog"]

log = get_logger(__name__)

_TICK_S = 0.5
_CLOSE_GRACE_S = 1.0


class Watchdog:
    """Ticks on each open connection (I/O thread only).

    Args:
        settings: ``confirm_timeout_s``.
        outbox: when the oldest unconfirmed message was sent.
        confirms: fails what a resource alarm held too long.
        name: the connection's name, for logs.
        blocked: whether a resource alarm blocks the connection now.
    """

    def __init__(
        self,
        settings: Settings,
        outbox: Outbox,
        confirms: Confirms,
        *,
        name: str,
        blocked: Callable[[], bool],
    ) -> None:
        self._settings = settings
        self._outbox = outbox
        self._confirms = confirms
        self._name = name
        self._blocked = blocked

    def start(self, conn: pika.SelectConnection) -> None:
        """Start ticking on ``conn``, until it closes."""
        conn.ioloop.call_later(_TICK_S, lambda: self._tick(conn))

    def reopen_later(self, conn: pika.SelectConnection | None, pause_s: float) -> bool:
        """Reopen ``conn`` after ``pause_s``; False if it is not open."""
        if conn is None or not conn.is_open:
            return False
        conn.ioloop.call_later(pause_s, lambda: self.reopen(conn, "reopen after nack"))
        return True

    def reopen(self, conn: pika.SelectConnection, why: str) -> None:
        """Close ``conn``, so the I/O thread opens a fresh one."""
        # The whole connection, not just the channel: the confirm sequence restarts at 1 and
        # unconfirmed messages are republished by the usual path (``_on_closed``).
        if conn.is_open:
            conn.close(reply_code=320, reply_text=why)
            # pika waits for the broker's close-ok without a limit, and a frozen or partitioned
            # broker never sends it: drop the socket if it has not come soon.
            conn.ioloop.call_later(_CLOSE_GRACE_S, lambda: self._abort(conn))

    def _tick(self, conn: pika.SelectConnection) -> None:
        # A broker that never confirms (frozen node, alarm) must not block callers forever:
        # drop the connection so unconfirmed messages are republished on a fresh one.
        if not conn.is_open:
            return
        if self._blocked():
            # An alarm, not a dead broker: a new connection would be blocked too.
            self._confirms.expire_blocked()
            self.start(conn)
            return
        oldest = self._outbox.oldest_sent_at()
        if oldest is not None and time.monotonic() - oldest > self._settings.confirm_timeout_s:
            log.warning("confirm_timeout", timeout_s=self._settings.confirm_timeout_s)
            self.reopen(conn, "confirm timeout")
            return
        self.start(conn)

    def _abort(self, conn: pika.SelectConnection) -> None:
        if conn.is_closed:
            return
        log.warning("broker_unresponsive", connection=self._name, grace_s=_CLOSE_GRACE_S)
        abort_connection(conn)  # ends in on_close_callback
