"""What a consuming child counted between two reports to the worker, and its frame (pure).

The worker's main process never sees a task, yet ``inspect stats``
(``total``) and the Prometheus counters (``worker/metrics.py``) count every task of the worker. Each
child counts what it did and sends the counts in one ``tally`` frame at most every second and as it
exits (``worker/consume/ledger.py``); the worker adds them up (``worker/pool/feeding.py``).

A count is keyed by an event and its labels::

    ("received" | "started" | "succeeded" | "retried" | "rejected" | "revoked", task name, queue)
    ("failed", task name, queue, exception type)
    ("dead_lettered", queue, reason)
    ("redelivered", queue)
    ("requeued", queue, outcome)    a requeued dead letter's last delivery: done or dead_lettered
    ("total", task name)            runs of that task (inspect stats ``total``)

and the runtimes of the runs that succeeded or failed, in seconds, per ``(task name, queue)``.
"""

from __future__ import annotations

import collections
from typing import Any, Final

from broker_svc.errors import DecodeError

__all__ = ["ARITY", "Tally"]

# How many labels each event carries.
ARITY: Final = {
    "received": 2,
    "started": 2,
    "succeeded": 2,
    "retried": 2,
    "rejected": 2,
    "revoked": 2,
    "failed": 3,
    "dead_lettered": 2,
    "redelivered": 1,
    "requeued": 2,
    "total": 1,
    "unknown": 1,  # a task name the app does not register (inspect stats unknown_tasks)
}


class Tally:
    """Counts and runtimes since the last report."""

    __slots__ = ("confirms", "counts", "runtimes")

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.runtimes: dict[tuple[str, str], list[float]] = {}
        self.confirms: dict[str, list[float]] = {}  # publish kind -> seconds to each confirm

    def __bool__(self) -> bool:
        return bool(self.counts or self.runtimes or self.confirms)

    def count(self, event: str, *labels: str, n: int = 1) -> None:
        """Add ``n`` to ``event`` with ``labels``."""
        self.counts[(event, *labels)] += n

    def ran(self, task_name: str, queue: str, runtime_s: float) -> None:
        """A run of ``task_name`` from ``queue`` succeeded or failed after ``runtime_s``."""
        self.runtimes.setdefault((task_name, queue), []).append(runtime_s)

    def confirmed(self, kind: str, seconds: float) -> None:
        """A publish of ``kind`` (result, task, dead_letter, ...) was confirmed after ``seconds``."""
        self.confirms.setdefault(kind, []).append(seconds)

    def of(self, event: str) -> dict[tuple[str, ...], int]:
        """The counts of ``event``, by their labels."""
        return {key[1:]: n for key, n in self.counts.items() if key[0] == event}

    def add(self, other: Tally) -> None:
        """Add ``other``'s counts and runtimes to these."""
        self.counts.update(other.counts)
        for key, seconds in other.runtimes.items():
            self.runtimes.setdefault(key, []).extend(seconds)
        for kind, seconds in other.confirms.items():
            self.confirms.setdefault(kind, []).extend(seconds)

    def to_frame(self) -> dict[str, Any]:
        """The ``tally`` frame a child sends its worker."""
        return {
            "op": "tally",
            "counts": [[*key, n] for key, n in self.counts.items()],
            "runtimes": [[name, queue, seconds] for (name, queue), seconds in self.runtimes.items()],
            "confirms": [[kind, seconds] for kind, seconds in self.confirms.items()],
        }

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> Tally:
        """Read a ``tally`` frame.

        Raises:
            DecodeError: a row of an unknown event, or of the wrong shape.
        """
        tally = cls()
        for row in _rows(frame, "counts"):
            if not row or ARITY.get(row[0]) != len(row) - 2:
                raise DecodeError(f"tally: bad count row {row!r}")
            *key, n = row
            if not all(isinstance(label, str) for label in key) or not _natural(n):
                raise DecodeError(f"tally: bad count row {row!r}")
            tally.counts[tuple(key)] += n
        for row in _rows(frame, "runtimes"):
            if len(row) != 3 or not isinstance(row[0], str) or not isinstance(row[1], str):
                raise DecodeError(f"tally: bad runtime row {row!r}")
            seconds = row[2]
            if not _seconds(seconds):
                raise DecodeError(f"tally: bad runtimes in {row!r}")
            tally.runtimes.setdefault((row[0], row[1]), []).extend(float(s) for s in seconds)
        for row in _rows(frame, "confirms"):
            if len(row) != 2 or not isinstance(row[0], str) or not _seconds(row[1]):
                raise DecodeError(f"tally: bad confirm row {row!r}")
            tally.confirms.setdefault(row[0], []).extend(float(s) for s in row[1])
        return tally


def _rows(frame: dict[str, Any], field: str) -> list[list[Any]]:
    rows = frame.get(field) or []
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise DecodeError(f"tally: {field} is not a list of rows")
    return rows


def _seconds(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(s, int | float) for s in values)


def _natural(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0
