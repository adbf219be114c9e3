"""A consuming connection's prefetch, from a time budget: a short time's worth of work, never a count.

A child at prefetch 1 waits a broker round trip for each task (a quarter of a no-op drain); a
deep fixed prefetch hoards tasks an idle child could run, and a long task holds them back. With a
budget, a connection's prefetch is about ``budget`` ÷ its recent task time, per thread: no-op tasks
get a deep prefetch, tasks slower than the budget get 1. Pure: the consumer reports each task's
time and applies what this returns (``FeedConnection.set_prefetch``).

Task time is an average that rises at once and falls slowly: one long task makes the connection
careful, only a run of short ones makes it deep again. A change is made only when the prefetch is
at least twice or at most half what the connection has, so it is not moved for every task.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["DEFAULT_BUDGET_S", "MAX_PER_THREAD", "PrefetchBudget"]

# Chosen by measurement (BENCHMARKS.md, "Prefetch budget"): the drain gains little beyond it, and a
# child holds no more than this much work that another child could have run.
DEFAULT_BUDGET_S: Final = 0.01
# At most this many unacked deliveries per thread, however short the tasks: bounds the memory
# held and what `inspect reserved` lists.
MAX_PER_THREAD: Final = 64
_FALL: Final = 0.2  # weight of a shorter task in the average (a longer one replaces it at once)
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
        self._average_s: float | None = None
        self._seen = 0

    @property
    def target(self) -> int:
        """The prefetch the recent task time asks for (the current one until tasks were seen)."""
        if self._average_s is None:
            return self.current
        per_thread = self._budget_s / max(self._average_s, 1e-6)
        return max(1, min(MAX_PER_THREAD, math.floor(per_thread))) * self._threads

    def observe(self, seconds: float) -> int | None:
        """A task took ``seconds`` (from its delivery to its settle): the new prefetch, if it must change."""
        average = self._average_s
        if average is None or seconds >= average:
            self._average_s = seconds
        else:
            self._average_s = average + _FALL * (seconds - average)
        self._seen += 1
        if self._seen < _WARM_UP:
            return None
        target = self.target
        if target >= 2 * self.current or 2 * target <= self.current:
            self.current = target
            return target
        return None
