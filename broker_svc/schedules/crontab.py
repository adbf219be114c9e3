"""``Crontab``: Celery's crontab schedule, as the next instant after a given one, in a time zone."""

from __future__ import annotations

import calendar
import datetime as dt
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any

from broker_svc.schedules.cron_fields import Cronspec, parse_field
from broker_svc.schedules.wall_clock import instants_of_wall, load_zone, naive_wall, utc_offset_s

__all__ = ["Crontab", "crontab"]

_FIELD_NAMES = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
# Days in each month of a leap year: a day_of_month that fits no chosen month never fires.
_LONGEST_MONTH = (0, 31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
# Feb 29 on a given weekday comes round within 28 years; this bounds a search that cannot fail.
_SEARCH_YEARS = 400
_MINUTE = dt.timedelta(minutes=1)
_ALL_HOURS = frozenset(range(24))


class Crontab:
    """A crontab schedule: Celery's ``crontab(minute, hour, day_of_week, day_of_month, month_of_year)``.

    Fields take what Celery's take (``cron_fields.parse_field``). day_of_week is 0 = Sunday to
    6 = Saturday (7 is Sunday too). A day fires only if it matches day_of_month **and** day_of_week
    (Celery's rule, not Vixie cron's "either when both are restricted"): day_of_week=1 with
    day_of_month="1-7" is the first Monday of the month.

    Times are wall-clock times in ``timezone`` (an IANA name; None is UTC). Across daylight saving:

    - **Spring forward** (wall times that do not exist): a slot in the gap fires at the first
      instant after it, the transition (a daily 02:30 in America/New_York fires at 03:00 EDT on
      the spring-forward day). Slots that land on the same instant fire once there (an hourly
      job's 02:00 and 03:00 are both 03:00 EDT: one fire).
    - **Fall back** (wall times that happen twice): if the hour field matches all 24 hours, both
      occurrences fire, each a different real hour (an hourly job is neither skipped nor doubled;
      every 15 minutes stays every 15 minutes). Otherwise only the first occurrence (fold=0)
      fires, so a daily 01:30 runs once.

    Instances are immutable, compare by the sets they match and their zone, and keep the fields as
    given (``to_json``). ``crontab`` is another name for this class, Celery's spelling.

    Raises:
        ValueError: a field out of range or malformed (the message names the field), a
            day_of_month that occurs in none of the months, or a zone zoneinfo does not know.
        TypeError: a field of a type no crontab takes.
    """

    __slots__ = (
        "_spec", "minute", "hour", "day_of_week", "day_of_month", "month_of_year", "timezone",
        "_zone", "_sorted", "_every_hour",
    )  # fmt: skip

    minute: frozenset[int]
    hour: frozenset[int]
    day_of_week: frozenset[int]
    day_of_month: frozenset[int]
    month_of_year: frozenset[int]
    timezone: str | None
    _spec: dict[str, Cronspec]
    _zone: dt.tzinfo
    _sorted: dict[str, tuple[int, ...]]
    _every_hour: bool

    def __init__(
        self,
        minute: Cronspec = "*",
        hour: Cronspec = "*",
        day_of_week: Cronspec = "*",
        day_of_month: Cronspec = "*",
        month_of_year: Cronspec = "*",
        *,
        timezone: str | None = None,
    ) -> None:
        given = dict(zip(_FIELD_NAMES, (minute, hour, day_of_week, day_of_month, month_of_year), strict=True))
        spec: dict[str, Cronspec] = {}
        for name, value in given.items():
            # What to_json keeps: the text or int as given; an iterable as its ints (sorted if a set),
            # read once, so a generator is not used up by the parse.
            if isinstance(value, set | frozenset):
                value = tuple(sorted(value))
            elif isinstance(value, Iterable) and not isinstance(value, str):
                value = tuple(value)
            object.__setattr__(self, name, parse_field(name, value))
            spec[name] = value
        if not any(day <= _LONGEST_MONTH[m] for m in self.month_of_year for day in self.day_of_month):
            dom, moy = spec["day_of_month"], spec["month_of_year"]
            raise ValueError(f"crontab: day_of_month {dom!r} never occurs in month_of_year {moy!r}")
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "timezone", timezone)
        object.__setattr__(self, "_zone", load_zone(timezone))
        object.__setattr__(self, "_every_hour", self.hour == _ALL_HOURS)
        ordered = {name: tuple(sorted(getattr(self, name))) for name in _FIELD_NAMES}
        object.__setattr__(self, "_sorted", ordered)

    @classmethod
    def from_string(cls, line: str, *, timezone: str | None = None) -> Crontab:
        """A crontab from a cron line, ``"minute hour day_of_month month_of_year day_of_week"``.

        Raises:
            ValueError: not five fields, or a field ``Crontab`` refuses.
        """
        parts = line.split()
        if len(parts) != 5:
            raise ValueError(f"crontab line {line!r} must have 5 fields: minute hour day month weekday")
        minute, hour, day_of_month, month_of_year, day_of_week = parts
        return cls(minute, hour, day_of_week, day_of_month, month_of_year, timezone=timezone)

    def with_timezone(self, timezone: str | None) -> Crontab:
        """The same fields in another zone.

        Raises:
            ValueError: a zone zoneinfo does not know.
        """
        return Crontab(**self._fields(), timezone=timezone)

    def next_after(self, t: float) -> float:
        """The first instant strictly after ``t`` (epoch seconds) at which this schedule fires.

        Raises:
            ValueError: ``t`` is not a finite number.
        """
        if not math.isfinite(t):
            raise ValueError(f"next_after needs a finite time in epoch seconds, not {t!r}")
        zone = self._zone
        floor_t = math.floor(t)
        # An instant after t has a wall time behind t's if the clock falls back soon after t:
        # start the walk from the wall time t would have under the smaller of the two offsets.
        offset = min(utc_offset_s(zone, floor_t), utc_offset_s(zone, floor_t + 86_400))
        wall = naive_wall(floor_t + offset).replace(second=0)
        best = math.inf
        while True:
            wall = self._first_wall_from(wall)
            instants = instants_of_wall(wall, zone, both_folds=self._every_hour)
            # The first instant of a wall time never decreases with the wall time, so the first one
            # after t ends the walk; a fold's second occurrence may come before it.
            if instants[0] > t:
                return float(min(best, instants[0]))
            best = min([best, *(i for i in instants[1:] if i > t)])
            wall += _MINUTE

    def to_json(self) -> dict[str, Any]:
        """The fields as given and the zone, for ``schedule_from_json``."""
        fields: dict[str, Any] = {
            name: list(value) if isinstance(value, tuple) else value for name, value in self._spec.items()
        }
        return {"type": "crontab", **fields, "timezone": self.timezone}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Crontab:
        """The crontab ``to_json`` described.

        Raises:
            ValueError: missing or unknown keys, or a field ``Crontab`` refuses.
        """
        known = {"type", "timezone", *_FIELD_NAMES}
        if data.get("type") != "crontab" or set(data) - known:
            raise ValueError(f"not a crontab's JSON (keys {sorted(known)}, type 'crontab'): {dict(data)!r}")
        fields = {name: data.get(name, "*") for name in _FIELD_NAMES}
        return cls(**fields, timezone=data.get("timezone"))

    def _fields(self) -> dict[str, Any]:
        return dict(self._spec)

    def _first_wall_from(self, start: dt.datetime) -> dt.datetime:
        """The first naive wall-clock minute at or after ``start`` that every field matches.

        Skips whole months, days and hours that cannot match, so a yearly entry costs a few
        steps, not a scan of every minute.
        """
        months, days = self._sorted["month_of_year"], self._sorted["day_of_month"]
        hours, minutes = self._sorted["hour"], self._sorted["minute"]
        year, month, day, hour, minute = start.year, start.month, start.day, start.hour, start.minute
        while year <= start.year + _SEARCH_YEARS:
            m = _at_or_after(months, month)
            if m is None:
                year, month, day, hour, minute = year + 1, months[0], 1, 0, 0
                continue
            if m != month:
                month, day, hour, minute = m, 1, 0, 0
            d = _at_or_after(days, day)
            if d is None or d > calendar.monthrange(year, month)[1]:
                year, month = (year + 1, 1) if month == 12 else (year, month + 1)
                day, hour, minute = 1, 0, 0
                continue
            if d != day:
                day, hour, minute = d, 0, 0
            if dt.date(year, month, day).isoweekday() % 7 not in self.day_of_week:
                day, hour, minute = day + 1, 0, 0
                continue
            h = _at_or_after(hours, hour)
            if h is None:
                day, hour, minute = day + 1, 0, 0
                continue
            if h != hour:
                hour, minute = h, 0
            mi = _at_or_after(minutes, minute)
            if mi is None:
                hour, minute = hour + 1, 0
                continue
            return dt.datetime(year, month, day, hour, mi)
        raise AssertionError(f"{self!r} matches no minute in {_SEARCH_YEARS} years")  # validated in __init__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Crontab):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        return (*(getattr(self, name) for name in _FIELD_NAMES), self.timezone)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its JSON: pickle and copy would otherwise set the slots one by one.
        return (Crontab.from_json, (self.to_json(),))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Crontab is immutable; make a new one (or use with_timezone) to change {name}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._spec.items())
        zone = f", timezone={self.timezone!r}" if self.timezone is not None else ""
        return f"Crontab({fields}{zone})"


def _at_or_after(values: tuple[int, ...], value: int) -> int | None:
    index = bisect_left(values, value)
    return values[index] if index < len(values) else None


# Celery's spelling: ``from broker_svc.schedules import crontab`` reads like ``celery.schedules``.
crontab = Crontab
