"""A consuming connection's prefetch, from a time budget: a short time's worth of work, never a count.

A child at prefetch 1 waits a broker round trip for each task (a quarter of a no-op drain); a
deep fixed prefetch hoards tasks an idle child could run, and a long task holds them back. With a
budget, a connection's prefetch is about ``budget`` ÷ its recent task time, per thread: no-op tasks
get a deep prefetch, tasks slower than the budget get 1. Pure: the consumer reports each task's
time and applies what this returns (``FeedConnection.set_prefetch``).

Task time is the median of the last 16 tasks, except that a task that ran past the budget (its
child handed back what it held, ``worker/child/stall.py``) counts at once: one long task makes the
connection careful until short ones are the majority again, and a child descheduled for a moment
on a busy machine moves nothing. The prefetch deepens once the time asks for twice as much, and
gets shallower only at a quarter, at most once per 16 tasks (unless a task ran past the budget).

The consumer reports the task's own run time: on a busy 2-core machine the whole handling of a
delivery swings several-fold with the CPU the broker takes, which made the prefetch move up and
down during a drain (BENCHMARKS.md, "Prefetch budget"). A 10 ms budget is the worker's default: the
side-by-side run against Dramatiq and Celery showed it pays.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Final

__all__ = ["DEFAULT_BUDGET_S", "MAX_PER_THREAD", "PrefetchBudget"]

# Chosen by measurement (BENCHMARKS.md, "Prefetch budget"): the drain gains little beyond it, and a
# child holds no more than this much work that another child could have run.
DEFAULT_BUDGET_S: Final = 0.01
# At most this many unacked deliveries per thread, however short the tasks: bounds the memory
# held and what `inspect reserved` lists.
MAX_PER_THREAD: Final = 64
# The typical task time is the median of the last tasks: a child descheduled for a moment on a busy
# machine (a no-op task taking 10 ms once) must not halve a deep prefetch and make its consumer anew.
_WINDOW: Final = 16
_WARM_UP: Final = 3  # tasks seen before the first change: one odd first task decides nothing


class PrefetchBudget:
    """One connection's prefetch, from the time its tasks take.

    Args:
        budget_s: the work a connection may hold, in seconds of its tasks.
        threads: the connection's task threads (its prefetch is per thread, times this).
        current: the prefetch the connection starts with.
    """

    def __init__(self, budget_s: float, *, threads: int = 1, current: int = 1) -> None:
        if not budget_s > 0:
            raise ValueError(f"the prefetch budget must be positive, got {budget_s}")
        self._budget_s = budget_s
        self._threads = threads
        self.current = current
        self._recent: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._since_change = 0

    @property
    def target(self) -> int:
        """The prefetch the recent task time asks for (the current one until tasks were seen)."""
        if not self._recent:
            return self.current
        typical_s = statistics.median(self._recent)
        per_thread = self._budget_s / max(typical_s, 1e-6)
        return max(1, min(MAX_PER_THREAD, math.floor(per_thread))) * self._threads

    def observe(self, seconds: float, *, long: bool = False) -> int | None:
        """A task took ``seconds`` (from its delivery to its settle): the new prefetch, if it must change.

        ``long``: it ran past the budget (its child handed back what it held): it counts at once.
        """
        if long:
            self._recent.clear()  # careful at once: only a run of short tasks makes it deep again
        self._recent.append(seconds)
        self._since_change += 1
        if len(self._recent) < _WARM_UP and not long:
            return None
        target = self.target
        # Deeper as soon as it doubles; shallower only at a quarter, and not within a window of the
        # last change: a deep prefetch on a busy machine makes every task's wall time longer for a
        # while, which must not swing it back and forth (each change makes the consumers anew).
        deeper = target >= 2 * self.current
        shallower = 4 * target <= self.current and (long or self._since_change >= _WINDOW)
        if deeper or shallower:
            self.current, self._since_change = target, 0
            return target
        return None
