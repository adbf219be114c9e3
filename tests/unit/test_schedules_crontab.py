"""Crontab.next_after against a minute-by-minute reference, in UTC, over random times."""

from __future__ import annotations

import datetime as dt
import itertools
import random
import time

import pytest

from broker_svc.schedules import Crontab
from tests.support.cron_reference import Fields, utc_fires_after

START = int(dt.datetime(2025, 1, 1, tzinfo=dt.UTC).timestamp())
END = int(dt.datetime(2031, 1, 1, tzinfo=dt.UTC).timestamp())


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=dt.UTC).timestamp()


SPECS = [
    {},
    {"minute": "*/15"},
    {"minute": 7},
    {"minute": "0-59/10", "hour": "9-17"},
    {"minute": 0, "hour": "*/6"},
    {"minute": 30, "hour": 2},
    {"minute": "5,35", "hour": "22-2"},
    {"minute": 0, "hour": 9, "day_of_week": "mon-fri"},
    {"minute": 0, "hour": 0, "day_of_week": "sat,sun"},
    {"minute": 0, "hour": 0, "day_of_month": 1},
    {"minute": 45, "hour": 23, "day_of_month": 31},
    {"minute": 0, "hour": 12, "day_of_month": "1-7", "day_of_week": "mon"},  # first Monday
    {"minute": 0, "hour": 0, "day_of_month": 13, "day_of_week": "fri"},  # Friday the 13th
    {"minute": 0, "hour": 0, "day_of_month": 1, "month_of_year": "*/3"},
    {"minute": 15, "hour": 4, "day_of_month": 29, "month_of_year": 2},  # leap days only
    {"minute": "*/20", "hour": 3, "month_of_year": "jun-aug", "day_of_week": 7},
]


@pytest.mark.parametrize("spec", SPECS, ids=[repr(s) for s in SPECS])
def test_next_after_is_the_first_matching_minute_after_any_time(spec):
    schedule = Crontab(**spec)
    rnd = random.Random(20260308)
    fields = Fields.of(schedule)
    for _ in range(25):
        t = rnd.uniform(START, END)
        if rnd.random() < 0.3:
            t = float(int(t) // 60 * 60)  # on a minute boundary, which is itself maybe a fire
        expected = next(utc_fires_after(fields, t))
        assert schedule.next_after(t) == expected, (spec, t)


@pytest.mark.parametrize("spec", SPECS[:9], ids=[repr(s) for s in SPECS[:9]])
def test_walking_next_after_from_fire_to_fire_lists_every_fire(spec):
    schedule = Crontab(**spec)
    t = utc(2026, 2, 27, 21, 0)
    expected = list(itertools.islice(utc_fires_after(Fields.of(schedule), t), 200))
    walked = []
    for _ in range(200):
        t = schedule.next_after(t)
        walked.append(t)
    assert walked == expected


def test_next_after_is_strictly_after_a_fire():
    every_5 = Crontab(minute="*/5")
    assert every_5.next_after(utc(2026, 1, 1, 10, 0)) == utc(2026, 1, 1, 10, 5)
    assert every_5.next_after(utc(2026, 1, 1, 10, 0) - 0.001) == utc(2026, 1, 1, 10, 0)
    assert every_5.next_after(utc(2026, 1, 1, 10, 4, 59)) == utc(2026, 1, 1, 10, 5)


def test_day_of_month_and_day_of_week_must_both_match_as_in_celery():
    first_monday = Crontab(minute=0, hour=12, day_of_month="1-7", day_of_week="mon")
    t = utc(2026, 1, 1)
    fires = []
    for _ in range(4):
        t = first_monday.next_after(t)
        fires.append(dt.datetime.fromtimestamp(t, dt.UTC).date())
    assert fires == [dt.date(2026, 1, 5), dt.date(2026, 2, 2), dt.date(2026, 3, 2), dt.date(2026, 4, 6)]


def test_month_ends_and_leap_days():
    thirty_first = Crontab(minute=0, hour=0, day_of_month=31)
    assert thirty_first.next_after(utc(2026, 4, 1)) == utc(2026, 5, 31)
    leap_day = Crontab(minute=0, hour=0, day_of_month=29, month_of_year=2)
    assert leap_day.next_after(utc(2026, 1, 1)) == utc(2028, 2, 29)
    # Feb 29 on a Monday: 2044 is the next; the search crosses 18 years in steps, not minutes.
    leap_monday = Crontab(minute=0, hour=0, day_of_month=29, month_of_year=2, day_of_week="mon")
    assert leap_monday.next_after(utc(2026, 1, 1)) == utc(2044, 2, 29)


def test_the_year_rolls_over():
    new_year = Crontab(minute=0, hour=0, day_of_month=1, month_of_year=1)
    assert new_year.next_after(utc(2026, 12, 31, 23, 59, 59)) == utc(2027, 1, 1)
    assert new_year.next_after(utc(2027, 1, 1)) == utc(2028, 1, 1)


def test_a_zone_with_a_fixed_offset_shifts_every_fire():
    tokyo = Crontab(minute=0, hour=9, timezone="Asia/Tokyo")  # UTC+9, no daylight saving
    assert tokyo.next_after(utc(2026, 6, 30, 12, 0)) == utc(2026, 7, 1, 0, 0)  # 09:00 in Tokyo
    assert tokyo.next_after(utc(2026, 7, 1, 0, 0)) == utc(2026, 7, 2, 0, 0)


def test_ten_thousand_sparse_entries_are_computed_in_steps_not_minute_scans():
    # A minute-by-minute scan to a yearly fire is ~500,000 steps per call: 10,000 of them would
    # take hours. Skipping months, days and hours takes well under a second on any machine.
    specs = [
        Crontab(minute=0, hour=0, day_of_month=1, month_of_year=1),
        Crontab(minute=15, hour=4, day_of_month=29, month_of_year=2),
        Crontab(minute=0, hour=12, day_of_month="1-7", day_of_week="mon", timezone="Europe/Berlin"),
        Crontab(minute="*/5", timezone="America/New_York"),
    ]
    rnd = random.Random(7)
    started = time.process_time()
    for index in range(10_000):
        specs[index % len(specs)].next_after(rnd.uniform(START, END))
    assert time.process_time() - started < 20
