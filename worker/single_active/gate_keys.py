"""The dedup gate's state per key, as a pure state machine: head (running), tail (waiting).

Pure: a gate shard (``worker/single_active/gate_shard.py``) feeds it what arrives on its queue
and carries out what it returns; the stress test's checker replays the same machine as its model.
A key is in one of four states: Init (no entry), Process (a head), Block (a head and a tail) and,
for an arrival in Block, Decline. ``M`` is whatever stands for a held message (a delivery to ack
later); the machine only keeps it.

- ``arrive``: a tail set → DECLINE; no head → ACCEPT (it becomes the head, sent on); else BLOCK (it
  becomes the tail, held). The same task id again (a publisher's resend) is a DUPLICATE.
- ``release``: the head's task ended; the tail, if any, becomes the head (``Ended.promoted``).
- ``expired``: heads past their deadline (the safety timeout), ended as by a release.
- ``marker``: a head's marker came back; held with the head, or stale (ack it).

A key back in Init is forgotten, so memory follows the keys in use, not every key ever seen.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Ended", "GateCounts", "GateKeys", "Verdict", "Waiting"]

M = TypeVar("M")


class Verdict(enum.Enum):
    ACCEPT = "accepted"
    BLOCK = "blocked"
    DECLINE = "declined"
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class Waiting(Generic[M]):
    """A task the gate holds: the tail of its key."""

    task_id: str
    message: M
    timeout_s: float


@dataclass(slots=True)
class _Key(Generic[M]):
    head: str
    deadline: float
    marker: M | None = None  # the head's marker, once it came back to the gate
    tail: Waiting[M] | None = None


@dataclass(frozen=True, slots=True)
class Ended(Generic[M]):
    """A head that ended: its marker to ack (None if it never came back) and the promoted tail."""

    key: str
    task_id: str
    marker: M | None
    promoted: Waiting[M] | None
    deadline: float  # the promoted head's deadline (0 when none was promoted)


@dataclass(slots=True)
class GateCounts:
    """What the gate decided since it started (``inspect dedup``, events, metrics)."""

    accepted: int = 0
    blocked: int = 0
    declined: int = 0
    duplicate: int = 0
    released: int = 0
    evicted: int = 0
    promoted: int = 0
    stale: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class GateKeys(Generic[M]):
    """Every key with a head, and the counts."""

    counts: GateCounts = field(default_factory=GateCounts)
    _keys: dict[str, _Key[M]] = field(default_factory=dict)
    _deadlines: list[tuple[float, str, str]] = field(default_factory=list)  # (deadline, key, head)

    def __len__(self) -> int:
        return len(self._keys)

    def waiting(self) -> int:
        return sum(1 for entry in self._keys.values() if entry.tail is not None)

    def head_of(self, key: str) -> str | None:
        entry = self._keys.get(key)
        return entry.head if entry is not None else None

    def tail_of(self, key: str) -> str | None:
        entry = self._keys.get(key)
        return entry.tail.task_id if entry is not None and entry.tail is not None else None

    def arrive(self, key: str, task_id: str, message: M, *, timeout_s: float, now: float) -> Verdict:
        """What becomes of a task that arrives for ``key`` (see the module docstring)."""
        entry = self._keys.get(key)
        if entry is None:
            self._start(key, task_id, now + timeout_s)
            self.counts.accepted += 1
            return Verdict.ACCEPT
        if task_id == entry.head or (entry.tail is not None and task_id == entry.tail.task_id):
            self.counts.duplicate += 1
            return Verdict.DUPLICATE
        if entry.tail is not None:
            self.counts.declined += 1
            return Verdict.DECLINE
        entry.tail = Waiting(task_id, message, timeout_s)
        self.counts.blocked += 1
        return Verdict.BLOCK

    def marker(self, key: str, task_id: str, message: M, *, deadline: float) -> bool:
        """A head marker came back (or, on a takeover, was found): True if held, False if stale.

        A marker for a key without a head makes that head (a takeover learns the heads this way).
        """
        entry = self._keys.get(key)
        if entry is None:
            self._start(key, task_id, deadline)
            self._keys[key].marker = message
            return True
        if entry.head != task_id or entry.marker is not None:
            self.counts.stale += 1
            return False
        entry.marker = message
        return True

    def release(self, key: str, task_id: str, *, now: float) -> Ended[M] | None:
        """The head ``task_id`` of ``key`` ended; None if it is not the head (a stale release)."""
        entry = self._keys.get(key)
        if entry is None or entry.head != task_id:
            self.counts.stale += 1
            return None
        self.counts.released += 1
        return self._end(key, entry, now=now)

    def expired(self, now: float) -> list[Ended[M]]:
        """End every head whose deadline has passed (the safety timeout's forced eviction)."""
        ended: list[Ended[M]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, key, head = heapq.heappop(self._deadlines)
            entry = self._keys.get(key)
            if entry is None or entry.head != head or entry.deadline != deadline:
                continue  # ended before its deadline
            self.counts.evicted += 1
            ended.append(self._end(key, entry, now=now))
        return ended

    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, key, head = self._deadlines[0]
            entry = self._keys.get(key)
            if entry is not None and entry.head == head and entry.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def clear(self) -> None:
        self._keys.clear()
        self._deadlines.clear()

    def _start(self, key: str, task_id: str, deadline: float) -> None:
        self._keys[key] = _Key(head=task_id, deadline=deadline)
        heapq.heappush(self._deadlines, (deadline, key, task_id))

    def _end(self, key: str, entry: _Key[M], *, now: float) -> Ended[M]:
        promoted = entry.tail
        if promoted is None:
            del self._keys[key]
            return Ended(key, entry.head, entry.marker, None, 0.0)
        deadline = now + promoted.timeout_s
        self._keys[key] = _Key(head=promoted.task_id, deadline=deadline)
        heapq.heappush(self._deadlines, (deadline, key, promoted.task_id))
        self.counts.promoted += 1
        return Ended(key, entry.head, entry.marker, promoted, deadline)
