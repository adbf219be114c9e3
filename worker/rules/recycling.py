"""When a child retires to be replaced: Celery's ``max_tasks_per_child`` and ``max_memory_per_child``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["RecyclingLimits", "worn_out"]


class RecyclingLimits(Protocol):
    """A child's limits (``FeedSpec``'s): None is no limit."""

    @property
    def max_tasks_per_child(self) -> int | None: ...

    @property
    def max_memory_per_child_kib(self) -> int | None: ...


def worn_out(limits: RecyclingLimits, processed: int, resident_kib: Callable[[], int | None]) -> str | None:
    """Which limit a child passed after ``processed`` tasks, if any; checked as a task ends.

    Args:
        limits: the child's limits.
        processed: the tasks its threads ended so far.
        resident_kib: reads its resident memory (asked only when a memory limit is set).

    Returns:
        ``"max_tasks_per_child"``, ``"max_memory_per_child"`` or None.
    """
    if limits.max_tasks_per_child is not None and processed >= limits.max_tasks_per_child:
        return "max_tasks_per_child"
    if limits.max_memory_per_child_kib is not None:
        rss_kib = resident_kib()
        if rss_kib is not None and rss_kib > limits.max_memory_per_child_kib:
            return "max_memory_per_child"
    return None
