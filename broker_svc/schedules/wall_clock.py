"""Wall-clock times in a zone as UTC instants, across daylight-saving gaps and folds."""

from __future__ import annotations

import datetime as dt
import zoneinfo

__all__ = ["instants_of_wall", "load_zone", "naive_wall", "utc_offset_s"]

_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_EPOCH_UTC = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SECOND = dt.timedelta(seconds=1)


def load_zone(name: str | None) -> dt.tzinfo:
    """The zone called ``name`` (an IANA name such as ``"Europe/Berlin"``); None is UTC.

    Raises:
        ValueError: zoneinfo does not know the name (a typo, or no tz database on this machine:
            ``pip install tzdata``).
        TypeError: ``name`` is not a string.
    """
    if name is None:
        return dt.UTC
    if not isinstance(name, str):
        raise TypeError(f"timezone must be an IANA zone name such as 'Europe/Berlin', not {name!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(
            f"unknown timezone {name!r}: give an IANA name such as 'UTC', 'Europe/Berlin' or "
            "'America/New_York' (if the name is right, this machine lacks the tz database: "
            "pip install tzdata)"
        ) from exc


def utc_offset_s(zone: dt.tzinfo, instant: int | float) -> int:
    """The zone's UTC offset at ``instant`` (epoch seconds), in whole seconds."""
    offset = (_EPOCH_UTC + dt.timedelta(seconds=instant)).astimezone(zone).utcoffset()
    return 0 if offset is None else offset // _SECOND


def naive_wall(instant_s: int) -> dt.datetime:
    """The naive datetime ``instant_s`` seconds after 1970-01-01 00:00 (a wall time, no zone)."""
    return _EPOCH_NAIVE + dt.timedelta(seconds=instant_s)


def instants_of_wall(wall: dt.datetime, zone: dt.tzinfo, *, both_folds: bool) -> tuple[int, ...]:
    """The instants (epoch seconds, ascending) at which the naive wall time ``wall`` fires in ``zone``.

    - a wall time that happens once: that instant;
    - one in a gap (spring forward, it never happens): the first instant after the gap, which is
      the transition itself (02:30 on New York's spring-forward day fires at 03:00 EDT);
    - one in a fold (fall back, it happens twice): the first occurrence (fold=0), and also the
      second (fold=1) when ``both_folds``.
    """
    wall_s = (wall - _EPOCH_NAIVE) // _SECOND
    before = _offset_s(wall.replace(tzinfo=zone, fold=0))
    after = _offset_s(wall.replace(tzinfo=zone, fold=1))
    first = wall_s - before
    if before == after:
        return (first,)
    if before > after:  # the clock went back: fold=0 is the first occurrence (PEP 495)
        return (first, wall_s - after) if both_folds else (first,)
    # The clock went forward past this wall time. fold=1 reads it with the offset after the gap,
    # an instant before the transition; fold=0 with the offset before, one after it.
    return (_transition(zone, wall_s - after, first, before),)


def _offset_s(aware: dt.datetime) -> int:
    offset = aware.utcoffset()
    return 0 if offset is None else offset // _SECOND


def _transition(zone: dt.tzinfo, earlier: int, later: int, offset_before: int) -> int:
    """The first instant in ``(earlier, later]`` whose offset is no longer ``offset_before``."""
    # A gap lasts an hour or so: about a dozen lookups, and only for a slot that falls in one.
    while later - earlier > 1:
        middle = (earlier + later) // 2
        if utc_offset_s(zone, middle) == offset_before:
            earlier = middle
        else:
            later = middle
    return later
