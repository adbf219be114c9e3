"""What the autoscaler reads at each look: how many children are busy and how much work waits.

No delivery waits in the worker (each child consumes for itself), so the busy children come from
the board, and the work waiting is the messages *ready* in the worker's queues while every child is
busy (``BacklogDemand``). Only ready messages count: a delivery a child prefetched behind its task
is bound to that child's channel, and a new child could not take it. Every worker on a queue sees
the same backlog, so each grows toward its own MAX.

With ``--threads N`` a child is N consumers: it is busy when its N threads all run a task, and N
ready messages make work for one more child.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["BacklogDemand", "Demand", "Load"]


@dataclass(frozen=True, slots=True)
class Load:
    """One look at the pool's work.

    Attributes:
        busy: children running a task now (retiring ones not counted).
        waiting: work that one more child would start now (``decide``'s ``waiting``).
    """

    busy: int
    waiting: int


class Demand(Protocol):
    """How busy the pool is and what waits for it."""

    async def look(self, size: int) -> Load:
        """The load of a pool that keeps ``size`` children."""
        ...

    def held(self) -> int:
        """Tasks taken and not finished, running or waiting here (Celery's ``autoscaler.qty``)."""
        ...


class BacklogDemand:
    """Consuming children: busy ones from the board, and the queues' ready messages once all are busy.

    The queues are asked only when every child is busy, the one case where their depth matters:
    a worker with a free consumer has nothing waiting for it, whatever the queues hold (the free
    consumer takes the next message itself). So an idle or half-busy worker costs the broker
    nothing.

    Args:
        running: tasks running in the children now, retiring children's not counted
            (``ProcessPool.busy_count``).
        ready: messages ready in the worker's task queues (``worker.amqp.queue_depth.QueueDepth.ready``).
        threads: consumers per child (``--threads``).
    """

    def __init__(
        self, *, running: Callable[[], int], ready: Callable[[], Awaitable[int]], threads: int = 1
    ) -> None:
        self._running = running
        self._ready = ready
        self._threads = threads

    async def look(self, size: int) -> Load:
        busy = self._running() // self._threads  # children whose every thread runs a task
        if busy < size:
            return Load(busy=busy, waiting=0)
        return Load(busy=busy, waiting=math.ceil(await self._ready() / self._threads))

    def held(self) -> int:
        # What each child prefetched behind its task is not visible here: the running tasks.
        return self._running()
