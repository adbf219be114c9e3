"""What a spool reports: its depth and age, and counts since it opened; as Prometheus metrics too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["SpoolStats", "spool_collector"]


@dataclass(frozen=True, slots=True)
class SpoolStats:
    """One look at a producer's spool (``App.spool_stats()``).

    Attributes:
        directory: the slot directory this process holds.
        depth: tasks accepted and not yet confirmed by the broker (nor failed for good).
        bytes: what the spool holds, on disk and in its buffer.
        oldest_age_s: how long the oldest of those has waited (None when there is none).
        buffered: tasks waiting for a trigger to be written.
        segments: segment files.
        accepted: tasks taken since the spool opened.
        written: tasks written to segment files (a task confirmed first is never written).
        fsyncs: fsync calls on segment files.
        published: tasks confirmed by the broker.
        failed: tasks the broker refused for good (each also fails its result).
        refused: tasks not accepted (``SpoolFull`` or ``SpoolError``).
        replayed: tasks found at start, left by a predecessor in the same slot.
        resent: sends marked resent (an earlier copy may have been enqueued: a possible duplicate).
        can_publish: the connection is up and not blocked by an alarm.
        write_error: the last write's error while it lasts (a full disk), else None.
    """

    directory: str
    depth: int
    bytes: int
    oldest_age_s: float | None
    buffered: int
    segments: int
    accepted: int
    written: int
    fsyncs: int
    published: int
    failed: int
    refused: int
    replayed: int
    resent: int
    can_publish: bool
    write_error: str | None


_GAUGES = {
    "depth": "Tasks in the spool not yet confirmed by the broker",
    "bytes": "Bytes the spool holds, on disk and buffered",
    "oldest_age_s": "Seconds the oldest unconfirmed task has waited in the spool",
}
_COUNTERS = {
    "accepted": "Tasks accepted into the spool",
    "written": "Tasks written to spool segment files",
    "published": "Spooled tasks confirmed by the broker",
    "failed": "Spooled tasks the broker refused for good",
    "refused": "Tasks the spool did not accept (SpoolFull, SpoolError)",
    "replayed": "Tasks replayed from a predecessor's spool",
    "resent": "Spooled tasks sent again after an earlier copy may have been enqueued",
}


def spool_collector(read: Callable[[], SpoolStats | None], *, app: str) -> object:
    """A Prometheus collector of a spool's figures, for ``registry.register(...)``.

    ``clockwork_spool_{depth,bytes,oldest_age_seconds}`` are gauges and
    ``clockwork_spool_{accepted,written,published,failed,refused,replayed,resent}_total`` counters,
    labelled ``app``; nothing is reported while the app has no spool open.
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only when asked for

    class SpoolCollector:
        def collect(self) -> Iterator[Metric]:
            stats = read()
            if stats is None:
                return
            for field, text in _GAUGES.items():
                name = "oldest_age_seconds" if field == "oldest_age_s" else field
                gauge = GaugeMetricFamily(f"clockwork_spool_{name}", text, labels=["app"])
                gauge.add_metric([app], float(getattr(stats, field) or 0.0))
                yield gauge
            for field, text in _COUNTERS.items():
                counter = CounterMetricFamily(f"clockwork_spool_{field}", text, labels=["app"])
                counter.add_metric([app], float(getattr(stats, field)))
                yield counter

    return SpoolCollector()
