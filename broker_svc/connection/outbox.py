"""Where each message a connection holds is: queued to send, waiting to go again, or awaiting a confirm.

BrokerConnection's bookkeeping: the three collections, the lock that keeps them consistent with
each other, and the backpressure wait that bounds them. Callers on any thread add to it; the I/O
thread takes, tracks and settles. It is separate from ``connection.py`` because it is pure
thread-safe state (no pika): the I/O thread decides *when* a message moves, this keeps *where* it is.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import BrokerSvcError, BrokerUnavailable, MessageTooLarge

__all__ = ["Outbox"]


class Outbox:
    """Messages handed to a connection and not yet settled (thread-safe).

    Queued messages wait to be sent; retries were sent on a connection that was lost (or nacked
    them) and go out first on the next one; unconfirmed ones, by delivery tag in send order, await
    the broker's confirm.
    """

    def __init__(self) -> None:
        self._queued: collections.deque[PendingPublish] = collections.deque()
        self._retry: collections.deque[PendingPublish] = collections.deque()
        self._unconfirmed: dict[int, PendingPublish] = {}
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._space_waiters = 0
        self._wake_pending = False  # a drain is coming on the I/O thread and will take what is queued

    def __len__(self) -> int:
        """Messages handed over and not yet settled."""
        with self._lock:
            return self._pending_locked()

    def unsent(self) -> int:
        """Messages handed over and not sent yet (queued or to be retried)."""
        with self._lock:
            return len(self._queued) + len(self._retry)

    def _pending_locked(self) -> int:
        return len(self._queued) + len(self._retry) + len(self._unconfirmed)

    def put(
        self,
        items: Sequence[PendingPublish],
        *,
        max_pending: int,
        closing: Callable[[], bool],
        ready: threading.Event,
    ) -> bool:
        """Queue ``items`` once there is room; True if the I/O thread must be woken to send them.

        Args:
            items: the messages, in send order.
            max_pending: how many messages may be pending before a caller waits (at least ``items``).
            closing: whether the connection is closing (checked while waiting).
            ready: set while the connection can publish; no wake-up is needed before that.

        Raises:
            BrokerUnavailable: the connection was closed.
        """
        with self._lock:
            # Backpressure: a producer faster than the broker waits here instead of growing the
            # outbox without bound. Confirms and failures make room.
            limit = max(max_pending, len(items))
            while not closing() and self._pending_locked() + len(items) > limit:
                self._space_waiters += 1
                try:
                    self._space.wait(1.0)
                finally:
                    self._space_waiters -= 1
            if closing():
                raise BrokerUnavailable("the connection is closed")
            now = time.monotonic()
            for pending in items:
                if not pending.attempts:
                    pending.sent_at = now  # handed over: a blocked connection times it from here
            self._queued.extend(items)
            wake = not self._wake_pending and ready.is_set()
            if wake:
                self._wake_pending = True
        return wake

    def take(self, *, can_send: bool) -> tuple[list[PendingPublish], PendingPublish | None, int] | None:
        """For a drain: what is queued, the oldest unconfirmed message and how many are unconfirmed.

        Returns None, taking nothing, unless ``can_send``.
        """
        with self._lock:
            self._wake_pending = False
            if not can_send:
                return None
            batch = list(self._queued)
            self._queued.clear()
            oldest = next(iter(self._unconfirmed.values()), None)  # lowest tag: sent first
            ahead = len(self._unconfirmed)
        return batch, oldest, ahead

    def put_back(self, items: Sequence[PendingPublish]) -> None:
        """Return taken messages to the front of the queue, in their order."""
        with self._lock:
            self._queued.extendleft(reversed(items))

    def track(self, tag: int, pending: PendingPublish) -> None:
        """Await the confirm of ``pending``, sent with delivery tag ``tag``."""
        with self._lock:
            self._unconfirmed[tag] = pending

    def oldest_sent_at(self) -> float | None:
        """When the oldest unconfirmed message was sent (monotonic), if any awaits a confirm."""
        with self._lock:
            first = next(iter(self._unconfirmed.values()), None)  # lowest tag: sent first
            return first.sent_at if first is not None else None

    def confirm(self, tag: int, *, multiple: bool) -> tuple[list[PendingPublish], bool]:
        """Stop tracking what a confirm (ack or nack) settles; also whether others still await one."""
        with self._lock:
            if multiple:
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
        return settled, backlog

    def retry_later(self, pending: PendingPublish) -> None:
        """Send ``pending`` again, ahead of the queue, once a connection is ready."""
        with self._lock:
            self._retry.append(pending)

    def requeue_retries(self) -> None:
        """On a ready connection: retries go to the front of the queue, for the drain that follows."""
        with self._lock:
            # What a lost connection left unconfirmed goes out first, in its original order.
            self._queued.extendleft(reversed(self._retry))
            self._retry.clear()
            self._wake_pending = True

    def take_unconfirmed(self) -> list[PendingPublish]:
        """Stop tracking every unconfirmed message (its connection is gone); they come in send order."""
        with self._lock:
            lost = [self._unconfirmed[t] for t in sorted(self._unconfirmed)]
            self._unconfirmed.clear()
        return lost

    def expire(self, cutoff: float) -> list[PendingPublish]:
        """Stop holding every message handed over or sent before ``cutoff`` (monotonic); returns them.

        Unsent messages leave the queue (they were never written, so never enqueued); sent ones
        stop being tracked, as the broker may still take them.
        """
        with self._lock:
            expired = [p for p in (*self._queued, *self._retry) if p.sent_at < cutoff]
            if expired:
                gone = {id(p) for p in expired}
                for queue in (self._queued, self._retry):
                    kept = [p for p in queue if id(p) not in gone]
                    queue.clear()
                    queue.extend(kept)
            for tag in [t for t, p in self._unconfirmed.items() if p.sent_at < cutoff]:
                expired.append(self._unconfirmed.pop(tag))
            if expired:
                self._space.notify_all()
        return expired

    def fail_where(self, matches: Callable[[PendingPublish], bool], error: BrokerSvcError) -> None:
        """Fail the queued messages that ``matches`` accepts."""
        with self._lock:
            failing = [p for p in self._queued if matches(p)]
            kept = [p for p in self._queued if not matches(p)]
            self._queued.clear()
            self._queued.extend(kept)
            self._space.notify_all()
        for pending in failing:
            pending.settle(error)

    def fail_oversized(self, limit: int, reason: BaseException) -> None:
        """Fail every message, queued or unconfirmed, with a body over the broker's ``limit``."""
        # The broker closed the channel for one message over its max_message_size: that one (and
        # any other that big) fails; the rest go out again on the next channel, never lost.
        with self._lock:
            too_big = [t for t, p in self._unconfirmed.items() if len(p.message.body) > limit]
            failing = [self._unconfirmed.pop(t) for t in too_big]
        self.fail_where(lambda p: len(p.message.body) > limit, MessageTooLarge(f"broker refused: {reason}"))
        for pending in failing:
            pending.settle(
                MessageTooLarge(f"the broker refused a body of {len(pending.message.body)} bytes: {reason}")
            )

    def fail_held_where(self, matches: Callable[[PendingPublish], bool], error: BrokerSvcError) -> None:
        """Fail the messages ``matches`` accepts, queued or unconfirmed (the rest go out again)."""
        with self._lock:
            tags = [t for t, p in self._unconfirmed.items() if matches(p)]
            failing = [self._unconfirmed.pop(t) for t in tags]
        self.fail_where(matches, error)
        for pending in failing:
            pending.settle(error)

    def fail_all(self, error: BrokerSvcError) -> None:
        """Fail every message held, queued, retried or unconfirmed."""
        with self._lock:
            items = [*self._queued, *self._retry, *self._unconfirmed.values()]
            self._queued.clear()
            self._retry.clear()
            self._unconfirmed.clear()
            self._space.notify_all()
        for pending in items:
            pending.settle(error)
