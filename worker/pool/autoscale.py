"""Pool autoscaling: more children while work waits for one, fewer once a child sat unneeded.

``--autoscale MAX,MIN`` starts the pool at MIN children (at least one). Every ``TICK_S`` the
autoscaler looks at the pool's load (``worker/pool/demand.py``: how many children are busy, how
much work waits):

- work waiting → grow at once by as many as wait, up to MAX;
- nothing waiting, and not every child busy at any look for ``--autoscale-keepalive`` seconds →
  retire one child per look, down to MIN (idle children exit at once; a busy one after its task:
  a running task is never killed).

No delivery waits in the worker (each child consumes for itself): the work waiting is the messages
ready in the worker's queues while every child is busy, read with a passive declare only then
(``worker/amqp/queue_depth.py``). A retired child stops consuming first, hands back what it holds
and has not started, ends its task and exits; its slot is not refilled.

**Prefetch.** Each child (each of its ``--threads``) is a consumer of its own, with the spec's
prefetch (``--prefetch-multiplier``) from start to exit, so nothing is re-subscribed: a new child
brings its consumers, a retired one takes its consumers away, and the worker's total follows the
size by itself. No headroom is needed: a backlog shows in the queues' ready count, not as a
delivery the worker holds, so a worker at prefetch 1 per child still sees it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import structlog

from worker.config import prefetch_for
from worker.pool.demand import Demand
from worker.pool.pool import ProcessPool

__all__ = ["TICK_S", "Autoscaler", "PoolSizer", "decide"]

log = structlog.get_logger(__name__)

# How often the autoscaler looks (Celery's thread looks every second).
TICK_S: Final = 0.5


def decide(
    *, size: int, waiting: int, spare_for_s: float, minimum: int, maximum: int, keepalive_s: float
) -> int:
    """The pool size the autoscaler wants now.

    Args:
        size: children the pool keeps now.
        waiting: work one more child would start now: deliveries waiting for a child, or with
            consuming children the messages ready in the queues while every child is busy.
        spare_for_s: seconds since every child was last needed (all busy, or work waiting).
        minimum: the least children (the pool keeps at least one even when it is 0).
        maximum: the most children.
        keepalive_s: how long a child may be spare before it is retired.

    Returns:
        ``size`` moved into the range; else grown by the waiting deliveries (up to ``maximum``);
        else one less once a child was spare for ``keepalive_s`` (down to ``minimum``); else ``size``.
    """
    floor = max(minimum, 1)
    if size < floor:
        return floor
    if size > maximum:
        return max(maximum, 1)
    if waiting > 0:
        return min(size + waiting, maximum)
    if spare_for_s >= keepalive_s and size > floor:
        return size - 1
    return size


class PoolSizer:
    """Resizes the pool and knows the prefetch that follows its size.

    Used by the autoscaler and by the ``pool_grow``/``pool_shrink`` commands.

    Args:
        pool: the process pool.
        multiplier: deliveries per child, or per thread (``--prefetch-multiplier``).
        threads: consumers per child (``--threads``), each at ``multiplier``.
    """

    def __init__(self, pool: ProcessPool, *, multiplier: int, threads: int = 1) -> None:
        self._pool = pool
        self._threads = threads
        self._multiplier = multiplier
        self._lock = asyncio.Lock()

    @property
    def size(self) -> int:
        """Children the pool keeps (its target; a child that is starting or retiring counts as it will be)."""
        return self._pool.target

    @property
    def prefetch_count(self) -> int:
        """What the children the pool keeps hold unacked together, at most."""
        return prefetch_for(self._pool.target, multiplier=self._multiplier, threads=self._threads)

    async def resize(self, size: int) -> int:
        """Make the pool keep ``size`` children (at least one).

        Returns:
            The new size.

        Raises:
            PoolClosedError: the pool is closing.
        """
        async with self._lock:
            current = self._pool.target
            if size > current:
                self._pool.grow(size - current)
            elif size < current:
                self._pool.shrink(current - size)
            return self._pool.target


class Autoscaler:
    """Keeps the pool between ``minimum`` and ``maximum`` children, sized to the work (see module doc).

    Args:
        sizer: resizes the pool.
        demand: how many children are busy and how much work waits (``worker/pool/demand.py``).
        maximum: the most children.
        minimum: the least children (the pool keeps at least one).
        keepalive_s: how long a child may be spare before it is retired.
        tick_s: how often to look.

    Raises:
        ValueError: ``maximum < 1``, ``minimum`` outside ``0..maximum``, or a non-positive time.
    """

    def __init__(
        self,
        sizer: PoolSizer,
        demand: Demand,
        *,
        maximum: int,
        minimum: int,
        keepalive_s: float,
        tick_s: float = TICK_S,
    ) -> None:
        _check_range(maximum, minimum)
        if not (keepalive_s > 0 and tick_s > 0):
            raise ValueError(f"keepalive_s and tick_s must be positive, got {keepalive_s} and {tick_s}")
        self._sizer = sizer
        self._demand = demand
        self._maximum, self._minimum = maximum, minimum
        self._keepalive_s, self._tick_s = keepalive_s, tick_s
        self._last_needed = 0.0  # loop time when every child was last needed
        self._lock = asyncio.Lock()

    def info(self) -> dict[str, Any]:
        """Celery's ``stats["autoscaler"]``: ``max``, ``min``, ``current`` (children) and ``qty``.

        ``qty`` counts the tasks received and not finished (running or waiting for a child), as
        Celery's ``len(reserved_requests)``; with consuming children, the tasks they run.
        """
        return {
            "max": self._maximum,
            "min": self._minimum,
            "current": self._sizer.size,
            "qty": self._demand.held(),
        }

    async def run(self) -> None:
        """Look every ``tick_s`` until cancelled (at shutdown, before the consumers are cancelled)."""
        self._last_needed = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                await self.scale()
            except Exception:  # one failed look (the channel is reconnecting) must not end autoscaling
                log.exception("autoscale_failed")

    async def scale(self) -> int:
        """Look once and resize the pool if it should; returns the size."""
        async with self._lock:
            size = self._sizer.size
            load = await self._demand.look(size)
            now = asyncio.get_running_loop().time()
            waiting, busy = load.waiting, load.busy
            if waiting or busy >= size:
                self._last_needed = now
            new_size = decide(
                size=size,
                waiting=waiting,
                spare_for_s=now - self._last_needed,
                minimum=self._minimum,
                maximum=self._maximum,
                keepalive_s=self._keepalive_s,
            )
            if new_size == size:
                return size
            await self._sizer.resize(new_size)
            log.info(
                "autoscale_grow" if new_size > size else "autoscale_shrink",
                old_size=size,
                new_size=new_size,
                waiting=waiting,
                busy=busy,
                prefetch=self._sizer.prefetch_count,
            )
            if new_size > size:
                self._last_needed = now  # the children just added are needed
            return new_size

    async def update(self, maximum: int | None = None, minimum: int | None = None) -> tuple[int, int]:
        """Change the range (the ``autoscale`` command); a size outside it is corrected at once.

        Args:
            maximum: the new maximum; None keeps it.
            minimum: the new minimum; None keeps it.

        Returns:
            ``(maximum, minimum)`` now.

        Raises:
            ValueError: the range would have ``maximum < 1`` or ``minimum`` outside ``0..maximum``.
        """
        new_max = self._maximum if maximum is None else maximum
        new_min = self._minimum if minimum is None else minimum
        _check_range(new_max, new_min)
        async with self._lock:
            self._maximum, self._minimum = new_max, new_min
            size = self._sizer.size
            await self._sizer.resize(min(max(size, new_min, 1), new_max))
        log.info("autoscale_updated", max=new_max, min=new_min, old_size=size, new_size=self._sizer.size)
        return new_max, new_min


def _check_range(maximum: int, minimum: int) -> None:
    if maximum < 1 or not 0 <= minimum <= maximum:
        raise ValueError(f"autoscale needs max >= 1 and 0 <= min <= max, got max={maximum} min={minimum}")
