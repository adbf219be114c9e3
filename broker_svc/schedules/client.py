"""Schedule changes at runtime, from any process: ``app.control.schedules()`` and ``ctl schedule``.

A change is a record in the scheduler's journal, confirmed by the broker before the call
returns: durable, whichever scheduler instance leads (or none), and applied by the leader
within a fraction of a second. Listing reads the journal back as a new leader would.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from broker_svc.schedules import Crontab, Entry, Every, next_due
from broker_svc.schedules.journal_record import Change, ChangeOp, TermOpened
from broker_svc.schedules.state import BeatState
from broker_svc.settings import Settings

__all__ = ["ScheduleClient", "ScheduledEntry"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledEntry:
    """An entry in force, as the journal says."""

    entry: Entry
    source: str  # "configured" (beat_schedule) or "added" (at runtime)
    last_fired: float | None  # the scheduled instant of its latest fire
    next_fire: float | None  # None while paused
    running: str | None  # the task id of its latest run, until that answers

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.entry.name, "task": self.entry.task, "schedule": self.entry.schedule.to_json(),
            "paused": self.entry.paused, "source": self.source, "last_fired": _iso(self.last_fired),
            "next_fire": _iso(self.next_fire), "running": self.running, "catch_up": self.entry.catch_up,
            "overlap": self.entry.overlap, "args": list(self.entry.args), "kwargs": self.entry.kwargs,
            "options": self.entry.options,
        }  # fmt: skip


class ScheduleClient:
    """The schedule of the scheduler ``name``: list it, and change it while it runs.

    Raises (every method):
        BrokerUnavailable: the broker could not be reached.
    """

    def __init__(self, settings: Settings, name: str = "default") -> None:
        from broker_svc.connection.beat_journal import Journal

        self.name = name
        self._journal = Journal(settings, name)

    def state(self) -> BeatState:
        state, _ = self._journal.read_state()
        return state

    def leader(self, *, state: BeatState | None = None) -> TermOpened | None:
        """The latest term a leader opened: its ``leader`` (host, pid, a suffix), ``epoch`` and
        since when (``at``); None before any instance has led.

        The leader writes it to the journal when it takes over, so it names the instance that
        leads now, or, while none does (the last one died and the next has not taken over yet,
        within the lease), the one that led last.
        """
        return (state or self.state()).term

    def list(self, *, now: float | None = None, state: BeatState | None = None) -> list[ScheduledEntry]:
        """The entries in force, by name: the configured ones as of the leader's latest snapshot
        (none before a leader has run), with every change since (``state``: one read already)."""
        state = state or self.state()
        configured = [Entry.from_json(value) for value in state.configured.values()]
        at = now if now is not None else dt.datetime.now(dt.UTC).timestamp()
        shown = []
        for name, entry in sorted(state.entries(configured).items()):
            last = state.last_fired.get(name)
            run = state.open_runs.get(name)
            shown.append(
                ScheduledEntry(
                    entry=entry,
                    source="added" if name in state.added else "configured",
                    last_fired=last,
                    next_fire=None if entry.paused else next_due(entry, max(at, last or at)),
                    running=run[0] if run else None,
                )
            )
        return shown

    def add(
        self,
        name: str,
        task: str,
        schedule: Every | Crontab | float,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        **policy: Any,
    ) -> Entry:
        """Add an entry (or replace the one of that name); ``policy``: ``catch_up``,
        ``catch_up_window_s``, ``overlap``, ``paused``, as ``Entry`` takes them.

        Raises:
            ValueError, TypeError: the entry is invalid.
        """
        every = Every(float(schedule)) if isinstance(schedule, int | float) else schedule
        entry = Entry(
            name=name, task=task, schedule=every, args=tuple(args), kwargs=dict(kwargs or {}),
            options=dict(options or {}), **policy,
        )  # fmt: skip
        self._journal.append(Change(op="add", name=name, entry=entry.to_json()))
        return entry

    def remove(self, name: str) -> None:
        """Remove an entry (a configured one stays removed until it is added again).

        Raises:
            KeyError: no entry of that name is in force.
        """
        self._change("remove", name)

    def pause(self, name: str) -> None:
        """Stop firing an entry until :meth:`resume`. Raises KeyError: no such entry."""
        self._change("pause", name)

    def resume(self, name: str) -> None:
        """Fire a paused entry again. Raises KeyError: no such entry."""
        self._change("resume", name)

    def run_now(self, name: str) -> str:
        """Fire an entry once now, besides its schedule (paused or not); returns the change id.

        Raises:
            KeyError: no such entry.
        """
        return self._change("run-now", name)

    def _change(self, op: ChangeOp, name: str) -> str:
        state = self.state()
        configured = [Entry.from_json(value) for value in state.configured.values()]
        if name not in state.entries(configured):
            raise KeyError(f"scheduler {self.name!r} has no entry {name!r} (see `ctl schedule list`)")
        change = Change(op=op, name=name)
        self._journal.append(change)
        return change.id


def _iso(at: float | None) -> str | None:
    return None if at is None else dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds")
