"""What an entry fires now (by its catch-up policy), when it fires next, and each fire's task id."""

from __future__ import annotations

import math
import uuid
from typing import Final

from broker_svc.schedules.crontab import Crontab
from broker_svc.schedules.entry import Entry
from broker_svc.schedules.interval import Every

__all__ = ["FIRE_ID_NAMESPACE", "MAX_CATCH_UP", "due_times", "fire_id", "next_due"]

# Fixed for good: every fire id ever issued depends on it, so changing it changes every id.
FIRE_ID_NAMESPACE: Final = uuid.UUID("cdb08255-a3ce-4074-a1d2-32f82924d7a7")

# At most this many instants from one due_times call under catch_up="all" (the oldest first):
# a one-second entry down for a day would otherwise ask for 86,400 tasks at once. The runtime
# records the last one it fired as last_fired, so the next call returns the following ones.
MAX_CATCH_UP: Final = 10_000


def fire_id(entry_name: str, scheduled: float) -> str:
    """The task id of the fire of ``entry_name`` scheduled at ``scheduled``: the same in every process.

    A UUID 5 over ``"<entry_name>@<scheduled in whole milliseconds>"``, so two schedulers (an old
    leader and a new one) that fire the same instant send the same task id.

    Raises:
        ValueError: ``scheduled`` is not a finite number.
    """
    if not math.isfinite(scheduled):
        raise ValueError(f"a fire's scheduled time must be finite epoch seconds, not {scheduled!r}")
    return str(uuid.uuid5(FIRE_ID_NAMESPACE, f"{entry_name}@{round(scheduled * 1000)}"))


def next_due(entry: Entry, after: float) -> float:
    """The entry's first scheduled instant strictly after ``after`` (paused or not).

    Raises:
        ValueError: ``after`` is not a finite number.
    """
    return entry.schedule.next_after(after)


def due_times(entry: Entry, *, last_fired: float | None, now: float, grace_s: float = 1.0) -> list[float]:
    """The scheduled instants to fire now, oldest first, by the entry's catch-up policy.

    The candidates are the instants ``s`` with ``last_fired < s <= now``; ``last_fired`` is the
    scheduled instant of the entry's last fire, None if it never fired (then it counts as
    ``now - grace_s``: nothing was missed, only what is due now fires).

    - ``"skip"``: the candidates on time, ``now - s <= grace_s``; missed ones are dropped.
    - ``"once"``: the latest candidate.
    - ``"all"``: the candidates with ``now - s <= entry.window_s``, at most ``MAX_CATCH_UP``,
      the oldest first.

    A paused entry fires nothing.

    Raises:
        ValueError: ``now``, ``last_fired`` or ``grace_s`` is not finite, or ``grace_s`` is negative.
    """
    if not math.isfinite(now) or not math.isfinite(grace_s) or grace_s < 0:
        raise ValueError(f"due_times needs a finite now and a finite grace_s >= 0, not {now!r}, {grace_s!r}")
    if last_fired is not None and not math.isfinite(last_fired):
        raise ValueError(f"last_fired must be finite epoch seconds or None, not {last_fired!r}")
    if entry.paused:
        return []
    after = now - grace_s if last_fired is None else last_fired
    schedule = entry.schedule
    first = schedule.next_after(after)
    if first > now:  # the usual answer: nothing yet
        return []
    if entry.catch_up == "once":
        return [_latest(schedule, after, now, first)]
    limit = grace_s if entry.catch_up == "skip" else entry.window_s
    # Instants at exactly now - limit count: start just below it (next_after is strict).
    start = max(after, math.nextafter(now - limit, -math.inf))
    return _between(schedule, start, now)


def _between(schedule: Every | Crontab, after: float, now: float) -> list[float]:
    """Instants in ``(after, now]``, oldest first, at most ``MAX_CATCH_UP``."""
    found: list[float] = []
    instant = schedule.next_after(after)
    while instant <= now and len(found) < MAX_CATCH_UP:
        found.append(instant)
        instant = schedule.next_after(instant)
    return found


def _latest(schedule: Every | Crontab, after: float, now: float, first: float) -> float:
    """The last instant in ``(after, now]``, given ``first``, the first one there.

    Looks back from ``now`` over spans growing eightfold, so an entry down for a year costs a few
    steps, not a walk through a year of its instants.
    """
    if isinstance(schedule, Every):  # a multiple of its period: straight to the last one
        latest = schedule.next_after(now) - schedule.seconds
        return latest if latest > after else first
    span = 60.0
    while True:
        start = max(after, now - span)
        instant = first if start == after else schedule.next_after(start)
        if instant <= now:
            while (following := schedule.next_after(instant)) <= now:
                instant = following
            return instant
        span *= 8
