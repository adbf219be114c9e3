"""Every (intervals anchored at the epoch) and schedules as JSON."""

from __future__ import annotations

import json
import math
import random

import pytest

from broker_svc.schedules import Crontab, Every, schedule_from_json


def test_every_fires_at_the_multiples_of_its_period_since_the_epoch():
    five_minutes = Every(300)
    assert five_minutes.next_after(0) == 300
    assert five_minutes.next_after(1_767_225_601.5) == 1_767_225_900  # 2026-01-01 00:05 UTC
    assert five_minutes.next_after(-1) == 0
    assert five_minutes.seconds == 300.0


def test_next_after_is_strictly_after_even_on_a_multiple():
    assert Every(5).next_after(10) == 15
    assert Every(5).next_after(9.999) == 10
    assert Every(5).next_after(math.nextafter(10, -math.inf)) == 10


def test_two_processes_started_apart_compute_the_same_instants():
    # Anchored at the epoch, not at a start time: any t inside the same period gives one answer.
    every_7 = Every(7.5)
    rnd = random.Random(5)
    for _ in range(1000):
        t = rnd.uniform(0, 2e9)
        nxt = every_7.next_after(t)
        assert t < nxt <= t + 7.5
        assert (nxt / 7.5) == round(nxt / 7.5)
        assert every_7.next_after(rnd.uniform(nxt - 7.5, math.nextafter(nxt, -math.inf))) == nxt


def test_walking_a_fractional_period_neither_stalls_nor_skips():
    tenth = Every(0.1)
    t, seen = 1_767_225_600.0, []
    for _ in range(100):
        t = tenth.next_after(t)
        seen.append(t)
    assert all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert seen[-1] == pytest.approx(1_767_225_610.0)


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_a_period_that_is_not_above_zero_is_refused(bad):
    with pytest.raises(ValueError, match="above 0"):
        Every(bad)


@pytest.mark.parametrize("bad", ["5", None, True])
def test_a_period_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="number of seconds"):
        Every(bad)


def test_a_time_that_is_not_finite_is_refused():
    with pytest.raises(ValueError, match="finite"):
        Every(5).next_after(math.nan)
    with pytest.raises(ValueError, match="finite"):
        Crontab().next_after(math.inf)


@pytest.mark.parametrize(
    "schedule",
    [
        Every(5),
        Every(0.25),
        Crontab(),
        Crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"),
        Crontab(minute=[0, 30], hour={1, 2}, day_of_month=(1, 15), month_of_year="jan", timezone="UTC"),
        Crontab(day_of_week=7, timezone="America/New_York"),
    ],
    ids=repr,
)
def test_a_schedule_survives_json_with_its_fields_as_written(schedule):
    data = json.loads(json.dumps(schedule.to_json()))
    again = schedule_from_json(data)
    assert again == schedule
    assert again.to_json() == schedule.to_json()
    assert type(again) is type(schedule)


def test_a_crontabs_json_keeps_the_text_it_was_given():
    data = Crontab(minute="*/15", hour="9-17", day_of_week="mon-fri", timezone="Europe/Berlin").to_json()
    assert data == {
        "type": "crontab",
        "minute": "*/15",
        "hour": "9-17",
        "day_of_week": "mon-fri",
        "day_of_month": "*",
        "month_of_year": "*",
        "timezone": "Europe/Berlin",
    }
    assert Crontab(minute={30, 0}).to_json()["minute"] == [0, 30]
    assert Every(60).to_json() == {"type": "every", "seconds": 60.0}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"type": "solar"}, "unknown schedule type 'solar'"),
        ({"seconds": 5}, "unknown schedule type None"),
        ({"type": "every"}, "not an interval's JSON"),
        ({"type": "every", "seconds": 5, "extra": 1}, "not an interval's JSON"),
        ({"type": "every", "seconds": 0}, "above 0"),
        ({"type": "crontab", "minute": "*", "second": "*"}, "not a crontab's JSON"),
        ({"type": "crontab", "hour": 25}, "crontab hour: 25"),
        ({"type": "crontab", "timezone": "Nowhere/Else"}, "unknown timezone"),
        ([], "is an object"),
    ],
)
def test_bad_schedule_json_is_refused_with_the_reason(data, message):
    with pytest.raises(ValueError, match=message):
        schedule_from_json(data)


def test_a_crontab_missing_fields_in_json_reads_them_as_every_value():
    assert schedule_from_json({"type": "crontab", "minute": 5}) == Crontab(minute=5)
