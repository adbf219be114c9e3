"""Our crontab against Celery's own (a test-only import): same fields, same next run, and
Celery's crontab and schedule objects read from a beat_schedule."""

from __future__ import annotations

import datetime as dt
import random

import pytest
from celery.schedules import crontab as celery_crontab
from celery.schedules import schedule as celery_schedule

from broker_svc.schedules import Crontab, Every, parse_beat_schedule
from tests.support.cron_reference import Fields, utc_fires_after

SPECS = [
    {"minute": "*/15"},
    {"minute": 0, "hour": "*/3"},
    {"minute": "1,13,30-45,50-59/2"},
    {"minute": 0, "hour": "0,8-17/2"},
    {"minute": 30, "hour": 9, "day_of_week": "mon-fri"},
    {"minute": 0, "hour": 22, "day_of_week": "fri-mon"},
    {"minute": 0, "hour": 0, "day_of_month": 1},
    {"minute": 5, "hour": 4, "day_of_month": "1-7", "day_of_week": "mon"},
    {"minute": 0, "hour": 12, "day_of_month": 15, "month_of_year": "*/3"},
    {"minute": 0, "hour": 0, "day_of_month": "2-30/2", "month_of_year": "2-12/2"},
    {"minute": [0, 30], "hour": {6, 18}, "day_of_week": (0, 6)},
]
IDS = [repr(s) for s in SPECS]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_our_fields_are_celerys_sets(spec):
    assert Fields.of(Crontab(**spec)) == Fields.of(celery_crontab(**spec))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_our_next_run_is_celerys_in_utc(spec):
    # Celery's remaining_delta: from a last run, the delta to the next one (its own arithmetic).
    theirs, ours = celery_crontab(**spec), Crontab(**spec)
    rnd = random.Random(1)
    for _ in range(60):
        t = rnd.randrange(1_700_000_000, 1_900_000_000) // 60 * 60 + rnd.choice([0, 17])
        last_run, delta, _now = theirs.remaining_delta(dt.datetime.fromtimestamp(t, dt.UTC))
        assert ours.next_after(t) == (last_run + delta).timestamp(), (spec, t)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_our_next_run_is_the_first_minute_celerys_sets_match(spec):
    fields = Fields.of(celery_crontab(**spec))
    ours = Crontab(**spec)
    rnd = random.Random(2)
    for _ in range(30):
        t = rnd.uniform(1_700_000_000, 1_900_000_000)
        assert ours.next_after(t) == next(utc_fires_after(fields, t))


def test_day_of_week_7_is_sunday_here_though_celery_refuses_it():
    with pytest.raises(ValueError, match="0-6"):
        celery_crontab(day_of_week=7)
    assert Crontab(day_of_week=7).day_of_week == celery_crontab(day_of_week=0).day_of_week


def test_celerys_crontab_and_schedule_objects_read_as_ours():
    entries = parse_beat_schedule(
        {
            "weekday-mornings": {
                "task": "tasks.mail",
                "schedule": celery_crontab(minute="*/30", hour="7-9", day_of_week="mon-fri"),
                "args": ("team",),
            },
            "first-of-quarter": {
                "task": "tasks.report",
                "schedule": celery_crontab(minute=0, hour=0, day_of_month=1, month_of_year="*/3"),
            },
            "every-10s": {"task": "tasks.ping", "schedule": celery_schedule(dt.timedelta(seconds=10))},
            "every-2.5s": {"task": "tasks.ping", "schedule": celery_schedule(2.5)},
        },
        timezone="Europe/Berlin",
    )
    mornings, quarterly, ten, fraction = (e.schedule for e in entries)
    assert mornings == Crontab(minute="*/30", hour="7-9", day_of_week="mon-fri", timezone="Europe/Berlin")
    assert isinstance(mornings, Crontab) and mornings.to_json()["day_of_week"] == "mon-fri"
    assert quarterly == Crontab(0, 0, day_of_month=1, month_of_year="*/3", timezone="Europe/Berlin")
    assert ten == Every(10)
    assert fraction == Every(2.5)
    assert entries[0].args == ("team",)


def test_a_celery_schedule_marked_relative_is_refused():
    with pytest.raises(ValueError, match="relative=True is not supported"):
        parse_beat_schedule({"r": {"task": "t", "schedule": celery_schedule(60, relative=True)}})
