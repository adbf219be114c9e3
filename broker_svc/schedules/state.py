"""A scheduler's state, rebuilt from its journal: what fired last, what still runs, what changed.

The leader keeps one in memory, applies each journal record to it (``apply``), and saves it
with the journal offset it covers (``to_json``) so a new leader reads only what came after.
Applying a record twice changes nothing, so a new leader may replay records its snapshot
already covers. Pure: no sockets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from broker_svc.schedules import Entry
from broker_svc.schedules.journal_record import Change, Done, Fire, JournalItem, Marker, TermOpened
from broker_svc.wire.task.states import READY_STATES

__all__ = ["BeatState", "OpenRun"]

OpenRun = tuple[str, float]  # (task id, wall-clock time it was fired)


class BeatState:
    """The journal's meaning for one scheduler. Not thread-safe: one thread applies and reads."""

    def __init__(self) -> None:
        self.last_fired: dict[str, float] = {}  # entry -> latest scheduled instant fired
        self.open_runs: dict[str, OpenRun] = {}  # entry -> its latest run, until it finishes
        self.configured: dict[str, dict[str, Any]] = {}  # the leader's beat_schedule, as JSON (to list)
        self.added: dict[str, dict[str, Any]] = {}  # entries added at runtime, as JSON
        self.removed: set[str] = set()  # configured entries removed at runtime
        self.paused: dict[str, bool] = {}  # pause/resume at runtime, over the entry's own flag
        self.run_now: dict[str, str] = {}  # run-now change id -> entry, not fired yet
        self._open_ids: dict[str, str] = {}  # task id -> entry, for the answers
        self.terms: set[int] = set()  # terms whose exchange may still exist (to delete: the fence)
        self.term: TermOpened | None = None  # the latest term opened: who leads (or led last)
        self.fires = 0  # fire records applied (for stats)

    # -- records -------------------------------------------------------------------------------

    def apply(self, item: JournalItem, *, fired_at: float | None = None) -> bool:
        """Apply one record; True when it changed the set of entries (an add, remove, pause...)."""
        if isinstance(item, Fire):
            self._fired(item, fired_at)
            return False
        if isinstance(item, Done):
            if item.status in READY_STATES:
                entry = self._open_ids.pop(item.task_id, None)
                if entry is not None and self.open_runs.get(entry, ("",))[0] == item.task_id:
                    del self.open_runs[entry]
            return False
        if isinstance(item, Change):
            return self._changed(item)
        if isinstance(item, TermOpened):
            self.terms.add(item.epoch)
            if self.term is None or item.epoch >= self.term.epoch:
                self.term = item
            return False
        assert isinstance(item, Marker)
        return False

    def _fired(self, item: Fire, fired_at: float | None) -> None:
        mark = item.mark
        self.fires += 1
        if mark.run_now is not None:
            self.run_now.pop(mark.run_now, None)
        else:
            self.last_fired[mark.entry] = max(self.last_fired.get(mark.entry, mark.scheduled), mark.scheduled)
        previous = self.open_runs.get(mark.entry)
        if previous is not None and previous[0] == item.task_id:
            return  # the same fire read again
        if previous is not None:
            self._open_ids.pop(previous[0], None)
        self.open_runs[mark.entry] = (item.task_id, fired_at if fired_at is not None else mark.scheduled)
        self._open_ids[item.task_id] = mark.entry

    def _changed(self, change: Change) -> bool:
        name = change.name
        if change.op == "add":
            assert change.entry is not None
            self.added[name] = change.entry
            self.removed.discard(name)
            self.paused.pop(name, None)
        elif change.op == "remove":
            self.added.pop(name, None)
            self.removed.add(name)
            self.paused.pop(name, None)
        elif change.op in ("pause", "resume"):
            self.paused[name] = change.op == "pause"
        else:  # run-now
            self.run_now[change.id] = name
            return False
        return True

    # -- questions -----------------------------------------------------------------------------

    def entries(self, configured: Iterable[Entry]) -> dict[str, Entry]:
        """The entries in force: the configured ones, less those removed, plus those added (an
        added entry replaces a configured one of its name), with runtime pauses applied.

        An added entry that no longer parses (JSON from an older version) is left out.
        """
        result = {entry.name: entry for entry in configured if entry.name not in self.removed}
        for name, value in self.added.items():
            try:
                result[name] = Entry.from_json(value)
            except (ValueError, TypeError, KeyError):
                result.pop(name, None)
        for name, paused in self.paused.items():
            entry = result.get(name)
            if entry is not None and entry.paused != paused:
                result[name] = dataclasses.replace(entry, paused=paused)
        return result

    def running(self, entry: str, *, now: float, timeout_s: float) -> bool:
        """Whether the entry's latest run has not answered yet, and was fired within ``timeout_s``."""
        run = self.open_runs.get(entry)
        return run is not None and now - run[1] < timeout_s

    # -- snapshots ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "last_fired": self.last_fired,
            "open_runs": {name: list(run) for name, run in self.open_runs.items()},
            "configured": self.configured,
            "added": self.added,
            "removed": sorted(self.removed),
            "paused": self.paused,
            "run_now": self.run_now,
            "fires": self.fires,
            "terms": sorted(self.terms),
            "term": self.term.to_json() if self.term is not None else None,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> BeatState:
        """Raises: KeyError, TypeError, ValueError: not a snapshot of this version."""
        state = cls()
        state.last_fired = {str(k): float(v) for k, v in value["last_fired"].items()}
        state.open_runs = {str(k): (str(v[0]), float(v[1])) for k, v in value["open_runs"].items()}
        state._open_ids = {run[0]: name for name, run in state.open_runs.items()}
        state.configured = {str(k): dict(v) for k, v in value.get("configured", {}).items()}
        state.added = {str(k): dict(v) for k, v in value["added"].items()}
        state.removed = {str(name) for name in value["removed"]}
        state.paused = {str(k): bool(v) for k, v in value["paused"].items()}
        state.run_now = {str(k): str(v) for k, v in value["run_now"].items()}
        state.fires = int(value.get("fires", 0))
        state.terms = {int(epoch) for epoch in value.get("terms", ())}
        term = value.get("term")
        state.term = TermOpened.from_json(term) if term else None
        return state
