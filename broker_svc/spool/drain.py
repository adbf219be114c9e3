"""The spool's drain: a thread that publishes spooled tasks in order, through the confirm machinery.

It takes tasks from the store in number order while the connection can publish (connected, not
blocked by an alarm), keeps at most ``window`` unconfirmed, and hands each batch to the connection
in one call (one wake-up of the I/O thread, a few socket writes). The connection's own retries
run first (a lost connection's unconfirmed messages go again on the next one); what it gives up
on for a broker reason (unavailable, alarm, nack) is taken back and sent again once it can
publish, marked resent where an earlier copy may have been enqueued. What the broker refuses
for good (unroutable, too large, a refused declaration) fails the caller's result and is logged:
never dropped in silence. The drain then tells the store ``low``: every task below is settled.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Final

from broker_svc.connection.io_thread import BrokerConnection
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import BrokerBlocked, BrokerSvcError, BrokerUnavailable, PublishNacked
from broker_svc.logging import get_logger
from broker_svc.spool.entry import Entry
from broker_svc.spool.store import SpoolStore

__all__ = ["SpoolDrain"]

log = get_logger(__name__)

# Errors of the broker's state, not of the message: spooled tasks wait them out.
_RETRIABLE: Final = (BrokerUnavailable, BrokerBlocked, PublishNacked)
_POLL_S: Final = 0.1  # how often a drain with nothing to do looks at the connection again
_RETRY_PAUSE_S: Final = 0.5


class SpoolDrain:
    """Publishes what the store holds, in order, and settles it by the broker's confirms.

    Args:
        store: the spool's tasks.
        connection: the app's connection (confirms, reconnect, failover).
        window: the most tasks handed to the connection and not yet settled.
        name: for the thread's name and logs.
    """

    def __init__(self, store: SpoolStore, connection: BrokerConnection, *, window: int, name: str) -> None:
        self._store = store
        self._connection = connection
        self._window = window
        self._inflight: dict[int, tuple[Entry, PendingPublish]] = {}
        self._order: collections.deque[int] = collections.deque()  # first sends, in number order
        self._resent: set[int] = set()  # retries in flight
        self._retry: list[Entry] = []  # waiting to go again, by number
        self._done: collections.deque[tuple[Entry, PendingPublish]] = collections.deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"clockwork-spool-{name}", daemon=True)
        self.published = self.failed = self.resent = self.replayed = 0
        self.oldest_inflight_at: float | None = None

    def start(self) -> None:
        """Start draining in the background."""
        self._thread.start()

    def wake(self) -> None:
        """New tasks were spooled."""
        self._wake.set()

    @property
    def held(self) -> int:
        """Tasks taken from the store and not settled yet (in flight or waiting to go again)."""
        return len(self._inflight) + len(self._retry)

    def stop(self, timeout: float) -> None:
        """Stop taking tasks; what is unsettled stays in the spool for the next start."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- the drain's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        # A predecessor's tasks first: indexed here, not in the first send, which must stay fast.
        self.replayed = self._store.recover()
        if self.replayed:
            log.warning("spool_replaying", directory=str(self._store.directory), tasks=self.replayed)
        while not self._stopping.is_set():
            self._wake.clear()  # before the work: a wake-up during it ends the wait below at once
            try:
                self._settle_done()
                if self._connection.can_publish:
                    self._send()
                self._store.set_low(self._low())
            except Exception:  # never let the drain die quietly: the spool would only grow
                log.exception("spool_drain_error")
                self._stopping.wait(_RETRY_PAUSE_S)
            self._wake.wait(_POLL_S)

    def _send(self) -> None:
        room = self._window - len(self._inflight)
        if room <= 0:
            return
        now = time.monotonic()
        again = 0  # the retries due, oldest first, go ahead of new tasks
        while again < min(room, len(self._retry)) and self._retry[again].retry_at <= now:
            again += 1
        batch = self._retry[:again]
        del self._retry[:again]
        batch += self._store.take(room - again)
        if not batch:
            return
        pendings = []
        for index, entry in enumerate(batch):
            pending = entry.template.copy(resent=entry.resend)
            pending.on_settle = functools.partial(self._on_settle, entry)
            self._inflight[entry.seq] = (entry, pending)
            if index < again:
                self._resent.add(entry.seq)
            else:
                self._order.append(entry.seq)
            pendings.append(pending)
        try:
            self._connection.publish_many(pendings)
        except BrokerUnavailable:  # the connection is closing: they stay in the spool
            for entry in batch:
                self._inflight.pop(entry.seq, None)
                self._retry_later(entry, now)
            self._retry.sort(key=lambda e: e.seq)

    def _on_settle(self, entry: Entry, pending: PendingPublish) -> None:
        # On the I/O thread: only note it, the drain's thread does the rest.
        self._done.append((entry, pending))
        self._wake.set()

    def _settle_done(self) -> None:
        now = time.monotonic()
        retries = len(self._retry)
        while self._done:
            entry, pending = self._done.popleft()
            held = self._inflight.get(entry.seq)
            if held is None or held[1] is not pending:
                continue  # a copy from before a retry, or from a stop
            del self._inflight[entry.seq]
            self._resent.discard(entry.seq)
            error = pending.error
            if error is None:
                self._finish(entry, None)
                self.published += 1
            elif isinstance(error, _RETRIABLE):
                entry.resend = entry.resend or pending.attempts > 0  # it was on a socket
                self._retry_later(entry, now)
            else:
                self._finish(entry, error)
                self.failed += 1
                log.error("spool_task_failed", task_id=pending.message.headers.get("id"), error=str(error))
        if len(self._retry) != retries:
            self._retry.sort(key=lambda e: e.seq)  # once, not per failure: a lost connection fails thousands

    def _retry_later(self, entry: Entry, now: float) -> None:
        if entry.resend:
            self.resent += 1
        entry.retry_at = now + _RETRY_PAUSE_S
        self._retry.append(entry)

    def _finish(self, entry: Entry, error: BrokerSvcError | None) -> None:
        entry.settled = True
        handle, entry.handle = entry.handle, None
        if handle is not None:
            handle.settle(error)

    def _low(self) -> int:
        order = self._order
        while order and order[0] not in self._inflight:
            order.popleft()
        candidates = [self._store.send_next]
        if order:
            candidates.append(order[0])
        if self._resent:
            candidates.append(min(self._resent))
        if self._retry:
            candidates.append(self._retry[0].seq)
        self.oldest_inflight_at = self._oldest_at()
        return min(candidates)

    def _oldest_at(self) -> float | None:
        first = self._inflight.get(self._order[0]) if self._order else None
        times = [first[0].at] if first is not None else []
        if self._retry:
            times.append(self._retry[0].at)
        return min(times, default=None)
