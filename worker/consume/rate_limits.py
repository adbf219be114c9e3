"""Per-worker task rate limits: one token bucket per task name, reserved ahead of time.

Pure bookkeeping, like Celery's per-task ``kombu.utils.limits.TokenBucket`` (capacity 1): a task
limited to 10/s starts at most every 0.1 s on this worker. Unlike Celery's bucket, a reservation
never waits and never fails: ``reserve`` takes the token at once, letting the bucket go into debt,
and says how long until that token is due. The consumer then holds a task due soon or parks one
due later in a broker delay queue, so a rate-limited task never blocks the tasks behind it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from broker_svc.tasks.task import Task
from broker_svc.wire.rates import parse_rate

__all__ = ["RATE_RESERVED_HEADER", "RateLimits", "parse_rate"]

# On a copy parked for its turn under a rate limit: it holds its token already.
RATE_RESERVED_HEADER: Final = "x-clockwork-rate-reserved"


@dataclass(slots=True)
class _Bucket:
    """A capacity-1 token bucket kept as the time its next token is due (GCRA's "theoretical
    arrival time"): full whenever ``next_free`` is not in the future."""

    rate: float  # tokens per second
    interval: float  # seconds per token, 1 / rate
    next_free: float = -math.inf


class RateLimits:
    """The rate limits of one worker, by task name.

    Not thread-safe: use it from the event loop only. Tasks without a limit cost one dict miss.

    Args:
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    @classmethod
    def for_tasks(cls, tasks: Mapping[str, Task], clock: Callable[[], float] = time.monotonic) -> RateLimits:
        """The limits the tasks declare (``@app.task(rate_limit=...)``), e.g. ``for_tasks(app.tasks)``.

        Raises:
            ValueError: a task's ``rate_limit`` is not a rate (``build_task_class`` refuses those).
        """
        limits = cls(clock)
        for name, task in tasks.items():
            limits.set(name, task.rate_limit)
        return limits

    def set(self, task_name: str, rate: str | int | float | None) -> None:
        """Limit ``task_name`` to ``rate`` (``"10/s"``, ``"100/m"``, ``"2/h"``, a number per second).

        ``None``, ``""`` or zero removes the limit; a limit set again later starts with a full
        bucket. Changing an existing limit keeps the bucket's level, in tokens: reservations
        already handed out still count against the new rate, which only changes how fast the
        bucket refills from now on. So a task that was idle may start at once, one in debt waits
        ``debt / new rate``, setting the same rate again changes nothing, and going from A to B
        and back to A restores the schedule.

        Raises:
            ValueError: ``rate`` is not a rate.
        """
        per_second = parse_rate(rate)
        if per_second is None:
            self._buckets.pop(task_name, None)
            return
        bucket = self._buckets.get(task_name)
        if bucket is None:
            self._buckets[task_name] = _Bucket(per_second, 1.0 / per_second)
            return
        if per_second == bucket.rate:
            return
        now = self._clock()
        if bucket.next_free > now:
            # debt in tokens = (next_free - now) * old rate; the same debt at the new rate:
            bucket.next_free = now + (bucket.next_free - now) * bucket.rate / per_second
        bucket.rate, bucket.interval = per_second, 1.0 / per_second

    def get(self, task_name: str) -> float | None:
        """The limit of ``task_name`` in tokens per second, or None when it has none."""
        bucket = self._buckets.get(task_name)
        return None if bucket is None else bucket.rate

    def reserve(self, task_name: str) -> float:
        """Take one token of ``task_name`` now and return the seconds until it is due.

        Reservations are first come, first served: once the bucket's one token is used, each
        reservation is due ``1 / rate`` after the previous one. A task without a limit is always
        due now.

        Returns:
            Seconds to wait before starting the task (0.0 when it may start now).
        """
        bucket = self._buckets.get(task_name)
        if bucket is None:
            return 0.0
        now = self._clock()
        start = bucket.next_free if bucket.next_free > now else now
        bucket.next_free = start + bucket.interval
        return start - now
