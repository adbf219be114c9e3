"""Which workers are alive, learned from their worker events (Celery's rule, WIRE.md §7.5)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["DEFAULT_FREQ_S", "EXPIRE_FACTOR", "Membership"]

# Celery's heartbeat interval and HEARTBEAT_EXPIRE_WINDOW (200 %): a node is alive while
# now < last heartbeat + 2 x freq.
DEFAULT_FREQ_S: Final = 2.0
EXPIRE_FACTOR: Final = 2.0
_TYPES: Final = frozenset({"worker-online", "worker-heartbeat", "worker-offline"})
# Bounds, so a flood of made-up hostnames cannot grow a client without limit.
_MAX_NODES: Final = 100_000
_MAX_HOSTNAME: Final = 256


@dataclass(frozen=True, slots=True)
class _Seen:
    timestamp: float
    freq_s: float
    offline: bool


class Membership:
    """The last worker event of each node, and who is alive at a given time.

    Events come from any source (the members stream, a live event queue) and in any order: the
    newest event of a node (by its ``timestamp``) decides, so a late, older heartbeat cannot bring
    back a node that said ``worker-offline``. Times are epoch seconds, compared with the events'
    own ``timestamp`` (replayed events have no receive time worth using), so clocks across hosts
    are assumed to agree within a fraction of ``freq``.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, _Seen] = {}
        self.ignored = 0

    def feed(self, event: Any) -> bool:
        """Take one event; anything that is not a well-formed worker event is ignored.

        Returns:
            True when the event was used.
        """
        seen = _parse(event)
        if seen is None:
            self.ignored += 1
            return False
        hostname, entry = seen
        previous = self._nodes.get(hostname)
        if previous is None and len(self._nodes) >= _MAX_NODES:
            self.ignored += 1
            return False
        if previous is not None and entry.timestamp < previous.timestamp:
            return False  # older than what we know: changes nothing
        self._nodes[hostname] = entry
        return True

    def feed_body(self, body: Any) -> int:
        """Take a decoded event body: one event map, or a list of them (Celery batches).

        Returns:
            How many events were used.
        """
        if isinstance(body, list):
            return sum(self.feed(event) for event in body)
        return int(self.feed(body))

    def alive(self, now: float) -> set[str]:
        """Nodes whose last event is not ``worker-offline`` and is less than 2 x freq old."""
        return {
            node
            for node, seen in self._nodes.items()
            if not seen.offline and now < seen.timestamp + EXPIRE_FACTOR * seen.freq_s
        }

    def __len__(self) -> int:
        return len(self._nodes)


def _parse(event: Any) -> tuple[str, _Seen] | None:
    if not isinstance(event, Mapping):
        return None
    kind, hostname = event.get("type"), event.get("hostname")
    if kind not in _TYPES or not isinstance(hostname, str) or not 0 < len(hostname) <= _MAX_HOSTNAME:
        return None
    timestamp = _number(event.get("timestamp"))
    raw_freq = event.get("freq")
    freq = DEFAULT_FREQ_S if raw_freq is None else _number(raw_freq)
    if timestamp is None or freq is None or freq <= 0:
        return None
    return hostname, _Seen(timestamp, freq, kind == "worker-offline")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None
