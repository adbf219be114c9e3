"""Live events put back in Lamport order: ``(clock, "hostname.pid")``, after a short hold."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

__all__ = ["ReorderBuffer"]


class ReorderBuffer:
    """Holds events for a short window and releases them ordered by ``(clock, "hostname.pid")``.

    Events from many workers arrive interleaved; each is held ``window_s`` seconds so a slightly
    later arrival with a smaller clock can still go first (DESIGN.md §3 total order).
    """

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._heap: list[tuple[int, str, int, float, dict[str, Any]]] = []
        self._seq = itertools.count()  # arrival order breaks remaining ties; dicts never compare

    def push(self, event: dict[str, Any], now: float) -> None:
        """Hold an event received at ``now``."""
        clock = event.get("clock")
        key = clock if isinstance(clock, int) and not isinstance(clock, bool) else 0
        origin = f"{event.get('hostname')}.{event.get('pid')}"
        heapq.heappush(self._heap, (key, origin, next(self._seq), now, event))

    def pop_ready(self, now: float) -> list[dict[str, Any]]:
        """Events whose window passed, smallest first (one still held blocks larger ones)."""
        ready = []
        while self._heap and self._heap[0][3] + self._window_s <= now:
            ready.append(heapq.heappop(self._heap)[4])
        return ready

    def drain(self) -> list[dict[str, Any]]:
        """Everything still held, in order."""
        return [heapq.heappop(self._heap)[4] for _ in range(len(self._heap))]

    def __len__(self) -> int:
        return len(self._heap)
