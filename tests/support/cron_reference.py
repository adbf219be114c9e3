"""A slow, obvious crontab matcher for the schedule tests: it looks at every minute.

It shares no code with ``broker_svc.schedules.crontab``: a fire is a minute whose date, hour and
minute are in the field sets, and the DST rules are restated over real minutes (a fold's second
pass fires only for every-hour entries; a minute right after a gap fires if a skipped wall minute
matched).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass

MINUTE = dt.timedelta(minutes=1)


@dataclass(frozen=True)
class Fields:
    minute: frozenset[int]
    hour: frozenset[int]
    day_of_week: frozenset[int]  # 0 = Sunday
    day_of_month: frozenset[int]
    month_of_year: frozenset[int]

    @classmethod
    def of(cls, schedule) -> Fields:
        """The sets of an object with Celery's attributes (ours or celery.schedules.crontab)."""
        return cls(*(frozenset(getattr(schedule, name)) for name in cls.__dataclass_fields__))

    def date_matches(self, day: dt.date) -> bool:
        return (
            day.month in self.month_of_year
            and day.day in self.day_of_month
            and day.isoweekday() % 7 in self.day_of_week
        )

    def matches(self, wall: dt.datetime) -> bool:
        return self.date_matches(wall.date()) and wall.hour in self.hour and wall.minute in self.minute


def utc_fires_after(fields: Fields, t: float) -> Iterator[float]:
    """Fires in UTC strictly after ``t``, in order: each day's 1,440 minutes tried one by one
    (days whose date cannot match are passed over whole)."""
    day = dt.datetime.fromtimestamp(t, dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    while True:
        if fields.date_matches(day.date()):
            for index in range(24 * 60):
                wall = day + index * MINUTE
                if fields.matches(wall) and wall.timestamp() > t:
                    yield wall.timestamp()
        day += dt.timedelta(days=1)


def zone_fires(fields: Fields, zone: dt.tzinfo, start: int, end: int) -> list[int]:
    """Fires in ``[start, end)`` (epoch seconds on minute boundaries), looking at each real minute."""
    every_hour = fields.hour == frozenset(range(24))
    fires = []
    previous = None
    for instant in range(start, end, 60):
        local = dt.datetime.fromtimestamp(instant, zone)
        wall = local.replace(tzinfo=None, fold=0)
        skipped = False
        if previous is not None and wall - previous > MINUTE:  # the clock jumped: walls never shown
            skipped_wall = previous + MINUTE
            while skipped_wall < wall and not skipped:
                skipped = fields.matches(skipped_wall)
                skipped_wall += MINUTE
        on_time = fields.matches(wall) and (local.fold == 0 or every_hour)
        if on_time or skipped:
            fires.append(instant)
        previous = wall
    return fires
