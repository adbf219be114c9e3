"""Crontab across daylight saving: the documented gap and fold rules, in real zones.

2026: America/New_York springs forward on 8 March at 02:00 EST (07:00 UTC) and falls back on
1 November at 02:00 EDT (06:00 UTC); Europe/Berlin on 29 March at 02:00 CET (01:00 UTC) and on
25 October at 03:00 CEST (01:00 UTC).
"""

from __future__ import annotations

import datetime as dt
import random
import zoneinfo

import pytest

from broker_svc.schedules import Crontab
from tests.support.cron_reference import Fields, zone_fires

NEW_YORK = "America/New_York"
BERLIN = "Europe/Berlin"
HOUR = 3600


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=dt.UTC).timestamp()


def local(
    zone: str, year: int, month: int, day: int, hour: int = 0, minute: int = 0, *, fold: int = 0
) -> float:
    wall = dt.datetime(year, month, day, hour, minute, tzinfo=zoneinfo.ZoneInfo(zone), fold=fold)
    return wall.timestamp()


def fires(schedule: Crontab, start: float, end: float) -> list[float]:
    found, t = [], start
    while (t := schedule.next_after(t)) < end:
        found.append(t)
    return found


# (zone, a day before the change, two days after it): spring forward, then fall back.
CHANGES = [
    (NEW_YORK, (2026, 3, 7), (2026, 3, 10)),
    (NEW_YORK, (2026, 10, 31), (2026, 11, 3)),
    (BERLIN, (2026, 3, 28), (2026, 3, 31)),
    (BERLIN, (2026, 10, 24), (2026, 10, 27)),
]


@pytest.mark.parametrize(("zone", "since", "until"), CHANGES)
def test_an_hourly_job_fires_every_real_hour_across_the_change(zone, since, until):
    hourly = Crontab(minute=0, timezone=zone)
    found = fires(hourly, local(zone, *since), local(zone, *until))
    assert len(found) > 60
    assert {b - a for a, b in zip(found, found[1:], strict=False)} == {HOUR}  # none skipped, none doubled


@pytest.mark.parametrize(("zone", "since", "until"), CHANGES)
def test_every_15_minutes_has_no_duplicate_and_no_gap_over_15_minutes(zone, since, until):
    quarterly = Crontab(minute="*/15", timezone=zone)
    found = fires(quarterly, local(zone, *since), local(zone, *until))
    assert len(found) == len(set(found))
    assert max(b - a for a, b in zip(found, found[1:], strict=False)) <= 900


def test_a_daily_0230_fires_at_0300_local_on_the_spring_forward_day():
    daily = Crontab(minute=30, hour=2, timezone=NEW_YORK)
    found = fires(daily, local(NEW_YORK, 2026, 3, 7), local(NEW_YORK, 2026, 3, 10))
    assert found == [
        local(NEW_YORK, 2026, 3, 7, 2, 30),
        utc(2026, 3, 8, 7, 0),  # 02:30 never happens: 03:00 EDT, the end of the gap
        local(NEW_YORK, 2026, 3, 9, 2, 30),
    ]
    berlin = Crontab(minute=30, hour=2, timezone=BERLIN)
    assert berlin.next_after(local(BERLIN, 2026, 3, 29)) == utc(2026, 3, 29, 1, 0)  # 03:00 CEST


def test_slots_in_the_gap_and_the_slot_after_it_fire_once_at_the_end_of_the_gap():
    # 02:00, 02:20, 02:40 never happen; they and 03:00 all land on 03:00 EDT, one fire.
    every_20 = Crontab(minute="*/20", hour="1-3", timezone=NEW_YORK)
    found = fires(every_20, local(NEW_YORK, 2026, 3, 8), local(NEW_YORK, 2026, 3, 8, 4))
    assert found == [
        utc(2026, 3, 8, 6, 0), utc(2026, 3, 8, 6, 20), utc(2026, 3, 8, 6, 40),  # 01:00-01:40 EST
        utc(2026, 3, 8, 7, 0), utc(2026, 3, 8, 7, 20), utc(2026, 3, 8, 7, 40),  # 03:00-03:40 EDT
    ]  # fmt: skip


@pytest.mark.parametrize(("zone", "day", "hour"), [(NEW_YORK, 1, 1), (BERLIN, 25, 2)])
def test_a_daily_job_in_the_repeated_hour_fires_once_at_the_first_occurrence(zone, day, hour):
    month = 11 if zone == NEW_YORK else 10
    daily = Crontab(minute=30, hour=hour, timezone=zone)
    midnight = local(zone, 2026, month, day)
    found = fires(daily, midnight - 86_400, midnight + 2 * 86_400)
    assert len(found) == 3
    assert found[1] == local(zone, 2026, month, day, hour, 30, fold=0)
    assert found[2] - found[1] == 86_400 + 3600  # the next day's, in standard time
    assert local(zone, 2026, month, day, hour, 30, fold=1) not in found


def test_an_entry_restricted_to_the_repeated_hour_runs_through_it_once():
    night = Crontab(minute="*/15", hour=1, timezone=NEW_YORK)
    found = fires(night, local(NEW_YORK, 2026, 11, 1), local(NEW_YORK, 2026, 11, 2))
    assert found == [utc(2026, 11, 1, 5, m) for m in (0, 15, 30, 45)]  # 01:00-01:45 EDT only


def test_an_every_hour_entry_fires_in_both_passes_of_the_repeated_hour():
    half_past = Crontab(minute=30, timezone=NEW_YORK)
    first_pass = local(NEW_YORK, 2026, 11, 1, 1, 40, fold=0)  # 01:40 EDT: 01:30 comes again in EST
    assert half_past.next_after(first_pass) == local(NEW_YORK, 2026, 11, 1, 1, 30, fold=1)
    assert half_past.next_after(first_pass) == utc(2026, 11, 1, 6, 30)


ZONES_AND_WINDOWS = [
    (NEW_YORK, (2026, 3, 7), (2026, 3, 9, 12)),
    (NEW_YORK, (2026, 10, 31), (2026, 11, 2, 12)),
    (BERLIN, (2026, 3, 28), (2026, 3, 30, 12)),
    (BERLIN, (2026, 10, 24), (2026, 10, 26, 12)),
    ("Australia/Lord_Howe", (2026, 4, 4), (2026, 4, 6)),  # half-hour fold, 02:00 -> 01:30
    ("Australia/Lord_Howe", (2026, 10, 3), (2026, 10, 5)),  # half-hour gap, 02:00 -> 02:30
    ("Pacific/Apia", (2011, 12, 29), (2012, 1, 1)),  # 30 December 2011 never happened there
]
DST_SPECS = [
    {"minute": 0},
    {"minute": "*/15"},
    {"minute": 30, "hour": 2},
    {"minute": 30, "hour": 1},
    {"minute": "*/20", "hour": "1-3"},
    {"minute": "10,50", "hour": "0-2"},
    {"minute": 45, "hour": 12},
]


@pytest.mark.parametrize(("zone", "since", "until"), ZONES_AND_WINDOWS)
@pytest.mark.parametrize("spec", DST_SPECS, ids=[repr(s) for s in DST_SPECS])
def test_next_after_agrees_with_a_reference_that_looks_at_every_real_minute(zone, since, until, spec):
    schedule = Crontab(**spec, timezone=zone)
    start, end = int(local(zone, *since)), int(local(zone, *until))
    expected = zone_fires(Fields.of(schedule), zoneinfo.ZoneInfo(zone), start, end)
    assert expected  # the window holds fires
    assert fires(schedule, start - 0.5, expected[-1] + 1) == expected
    rnd = random.Random(f"{zone} {since}")
    for _ in range(40):
        t = rnd.uniform(start, expected[-1] - 1)
        assert schedule.next_after(t) == min(f for f in expected if f > t), (spec, zone, t)
