"""What the threads of a ``SharedFeedConnection`` wait on: a publish's confirm, a settle's write."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping

from broker_svc.amqp.delivery import ConnectionLost, TaskDelivery

__all__ = ["PendingPublish", "QueuedSettle", "SettleQueue", "mark_returned"]


class PendingPublish:
    """One publish awaiting its confirm; a basic.return is matched to it by what it sent."""

    __slots__ = ("body", "done", "exchange", "nacked", "returned", "routing_key")

    def __init__(self, exchange: str, routing_key: str, body: bytes) -> None:
        self.exchange, self.routing_key, self.body = exchange, routing_key, body
        self.done = self.nacked = False
        self.returned: str | None = None


def mark_returned(
    pending: Mapping[int, PendingPublish], exchange: str, routing_key: str, body: bytes, *, why: str
) -> None:
    """Mark the oldest publish waiting for its confirm that sent this returned message.

    A basic.return does not name its sequence number; the broker sends it before the confirm.
    """
    for sequence in sorted(pending):
        waiting = pending[sequence]
        if (
            not waiting.done
            and waiting.returned is None
            and (waiting.exchange, waiting.routing_key, waiting.body) == (exchange, routing_key, body)
        ):
            waiting.returned = why
            return


class QueuedSettle:
    """An ack or nack queued for the socket: ``done`` once written, or ``failure`` if that failed."""

    __slots__ = ("delivery", "done", "failure", "frame")

    def __init__(self, delivery: TaskDelivery, frame: bytes) -> None:
        self.delivery, self.frame = delivery, frame
        self.done = False
        self.failure: ConnectionLost | None = None


class SettleQueue:
    """Acks and nacks from many threads, written together when they meet at the socket lock.

    A thread that settles while another writes queues its frame behind the lock; the first to get
    the lock writes every frame waiting, in one system call, and the others find theirs done. Each
    raises as if it had written its own. No frame waits for a later write, so a thread knows, as it
    returns, whether its settle reached the socket (the join of a redelivered copy depends on it).

    Args:
        lock: the socket's write lock (connect holds it while the socket changes).
        write: writes bytes to the socket; raises ``ConnectionLost``.
        current: whether a delivery came on the connection now up (a tag means nothing on another).
    """

    def __init__(
        self,
        lock: threading.RLock,
        write: Callable[[bytes], None],
        current: Callable[[TaskDelivery], bool],
    ) -> None:
        self._lock, self._write, self._current = lock, write, current
        self._queued: collections.deque[QueuedSettle] = collections.deque()  # atomic appends and pops

    def __len__(self) -> int:
        return len(self._queued)

    def settle(self, delivery: TaskDelivery, frame: bytes) -> None:
        """Write ``frame`` (an ack or nack of ``delivery``), or see another thread write it.

        Raises:
            ConnectionLost: the write that carried it failed.
        """
        settle = QueuedSettle(delivery, frame)
        self._queued.append(settle)
        with self._lock:
            if not settle.done:
                self._write_queued()  # raises the write's failure itself
        if settle.failure is not None:
            raise settle.failure.again() from settle.failure

    def _write_queued(self) -> None:
        # Under the lock: everything queued (only here are they taken), current tags only.
        batch = [self._queued.popleft() for _ in range(len(self._queued))]
        try:
            data = b"".join(each.frame for each in batch if self._current(each.delivery))
            if data:
                self._write(data)
        except ConnectionLost as exc:
            for each in batch:
                each.failure = exc
            raise
        finally:
            for each in batch:
                each.done = True
