"""Which waiting delivery gets the next free child: round-robin across queues, FIFO within one.

A worker reading ``-Q a,b,c`` keeps one waiting line per queue and serves the lines in turn, so
10,000 tasks waiting in ``a`` delay a task of ``b`` by at most one task per other queue, not until
``a`` drains. The capacity is the pool size and follows the autoscaler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

__all__ = ["FairSlots"]


class FairSlots:
    """``capacity`` slots (one per child) handed out fairly across queues.

    Args:
        capacity: how many holders at once.

    Raises:
        ValueError: ``capacity < 0``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._capacity = capacity
        self._in_use = 0
        self._lines: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._turns: collections.deque[str] = collections.deque()  # queues with waiters, in turn

    @property
    def capacity(self) -> int:
        """Slots in all (the pool size)."""
        return self._capacity

    @property
    def in_use(self) -> int:
        """Slots held now."""
        return self._in_use

    @property
    def waiting(self) -> int:
        """Deliveries waiting for a slot, over all queues."""
        return sum(1 for line in self._lines.values() for f in line if not f.done())

    def waiting_in(self, queue: str) -> int:
        """Deliveries of ``queue`` waiting for a slot."""
        return sum(1 for f in self._lines.get(queue, ()) if not f.done())

    async def acquire(self, queue: str) -> None:
        """Wait for a slot, in ``queue``'s line. Cancelling a waiter leaks nothing."""
        if self._in_use < self._capacity and not self._turns:
            self._in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._lines.setdefault(queue, collections.deque())
        line.append(waiter)
        if queue not in self._turns:
            self._turns.append(queue)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    line.remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back; the next line in turn gets it."""
        self._in_use -= 1
        self._hand_out()

    def resize(self, capacity: int) -> None:
        """Change the capacity; holders above a smaller one keep their slots until they release.

        Raises:
            ValueError: ``capacity < 0``.
        """
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._capacity = capacity
        self._hand_out()

    def _hand_out(self) -> None:
        while self._in_use < self._capacity and self._turns:
            queue = self._turns.popleft()
            line = self._lines[queue]
            while line and line[0].done():  # cancelled waiters
                line.popleft()
            if not line:
                del self._lines[queue]
                continue
            line.popleft().set_result(None)
            self._in_use += 1
            if line:
                self._turns.append(queue)  # back of the rotation: the other queues go first
            else:
                del self._lines[queue]
