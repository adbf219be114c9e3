"""The leader tests' journal and checker: every candidate's leadership intervals, and their overlaps.

Each candidate process appends JSON lines to a file of its own (``O_APPEND``, fsync'd): ``start``
when its term began (from its ``inaugurate`` hook), ``act`` for each action its ``execute`` took
(stamped before the guard that allowed it), ``stop`` when its term ended (from ``hand_over``: the
moment the term stopped, the lease's end when it was lost). Timestamps are ``time.time()`` of the
one machine. :func:`check` rebuilds each term's interval — from its start to its stop or, for a
leader killed before it could write one, its last action — and counts the pairs of terms that
overlap, and the actions taken outside their own term.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Interval", "LeaderVerdict", "check", "check_intervals", "read_intervals", "record"]


def record(path: Path, event: str, *, epoch: int, at: float | None = None, **extra: Any) -> None:
    """Append one event to a candidate's journal file, durably (one write, then fsync)."""
    line = {"event": event, "epoch": epoch, "at": time.time() if at is None else at, "pid": os.getpid()}
    line.update(extra)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Interval:
    """One term as its leader journaled it."""

    holder: str
    epoch: int
    start: float
    stop: float | None = None
    acts: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        """Its stop, else (killed before it wrote one) its last action, else its start."""
        if self.stop is not None:
            return self.stop
        return max(self.acts, default=self.start)


@dataclass(frozen=True)
class LeaderVerdict:
    """What the checker found."""

    terms: int
    overlaps: list[tuple[str, str]]
    acts_outside: int
    epochs_not_increasing: int

    @property
    def ok(self) -> bool:
        """No overlap, no action outside its term, epochs rising with time."""
        return not self.overlaps and not self.acts_outside and not self.epochs_not_increasing


def read_intervals(directory: Path) -> list[Interval]:
    """Every term journaled in ``directory`` (one ``*.jsonl`` file per candidate)."""
    intervals: list[Interval] = []
    for path in sorted(directory.glob("*.jsonl")):
        current: dict[int, Interval] = {}
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            epoch = int(entry["epoch"])
            if entry["event"] == "start":
                current[epoch] = Interval(path.stem, epoch, float(entry["at"]))
                intervals.append(current[epoch])
            elif epoch in current and entry["event"] == "act":
                current[epoch].acts.append(float(entry["at"]))
            elif epoch in current and entry["event"] == "stop":
                current[epoch].stop = float(entry["at"])
                current[epoch].extra = {k: v for k, v in entry.items() if k not in ("event", "epoch", "at")}
    return intervals


def check_intervals(intervals: Sequence[Interval]) -> LeaderVerdict:
    """Overlapping pairs, actions outside their term, and epochs that did not rise with start time."""
    ordered = sorted(intervals, key=lambda i: i.start)
    overlaps = [
        (f"{a.holder}#{a.epoch}", f"{b.holder}#{b.epoch}")
        for n, a in enumerate(ordered)
        for b in ordered[n + 1 :]
        if b.start < a.end and a.start < b.end
    ]
    outside = sum(1 for i in ordered for t in i.acts if not i.start <= t <= i.end)
    rising = sum(1 for a, b in zip(ordered, ordered[1:], strict=False) if b.epoch <= a.epoch)
    return LeaderVerdict(len(ordered), overlaps, outside, rising)


def check(directory: Path) -> LeaderVerdict:
    """:func:`check_intervals` of the journal in ``directory``."""
    return check_intervals(read_intervals(directory))


def gaps(intervals: Iterable[Interval]) -> list[float]:
    """Seconds between each term's end and the next term's start, in start order."""
    ordered = sorted(intervals, key=lambda i: i.start)
    return [b.start - a.end for a, b in zip(ordered, ordered[1:], strict=False)]
