"""What is due now under each catch-up policy, the next fire, and fire ids the same everywhere."""

from __future__ import annotations

import datetime as dt
import math
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from broker_svc.schedules import MAX_CATCH_UP, Crontab, Entry, Every, due_times, fire_id, next_due

ROOT = pathlib.Path(__file__).resolve().parents[2]
T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC, a multiple of every period below


def entry(schedule=None, **policies) -> Entry:
    return Entry("e", "tasks.t", schedule or Every(60), **policies)


def test_fire_ids_are_uuids_that_depend_only_on_the_entry_and_the_instant():
    a = fire_id("report", T0)
    assert uuid.UUID(a).version == 5
    assert fire_id("report", T0) == a
    assert fire_id("report", T0 + 0.0001) == a  # the same millisecond
    assert fire_id("report", T0 + 60) != a
    assert fire_id("report", T0 + 0.001) != a
    assert fire_id("other", T0) != a
    assert fire_id("report", int(T0)) == a  # an int and a float of one instant agree


def test_another_process_computes_the_same_fire_id():
    probe = "from broker_svc.schedules import fire_id; print(fire_id('nightly-report', 1767225600.0))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fire_id("nightly-report", T0)


def test_the_fire_id_namespace_never_changes():
    # Changing the namespace would change every id a running deployment has issued.
    assert fire_id("nightly-report", T0) == str(
        uuid.uuid5(uuid.UUID("cdb08255-a3ce-4074-a1d2-32f82924d7a7"), "nightly-report@1767225600000")
    )


def test_a_fire_id_needs_a_finite_instant():
    with pytest.raises(ValueError, match="finite"):
        fire_id("e", math.nan)


def test_next_due_is_the_schedules_next_instant():
    assert next_due(entry(Every(60)), T0 + 1) == T0 + 60
    assert next_due(entry(Crontab(minute=30)), T0) == T0 + 1800


@pytest.mark.parametrize("policy", ["skip", "once", "all"])
def test_nothing_is_due_before_the_next_instant(policy):
    assert due_times(entry(catch_up=policy), last_fired=T0, now=T0 + 59.9) == []


@pytest.mark.parametrize("policy", ["skip", "once", "all"])
def test_an_instant_on_time_is_due_under_every_policy(policy):
    assert due_times(entry(catch_up=policy), last_fired=T0, now=T0 + 60) == [T0 + 60]
    assert due_times(entry(catch_up=policy), last_fired=T0, now=T0 + 60.5) == [T0 + 60]


@pytest.mark.parametrize("policy", ["skip", "once", "all"])
def test_a_never_fired_entry_fires_only_what_is_due_now(policy):
    assert due_times(entry(catch_up=policy), last_fired=None, now=T0 + 3600.2) == [T0 + 3600]
    assert due_times(entry(catch_up=policy), last_fired=None, now=T0 + 3601.5) == []  # over the grace
    assert due_times(entry(catch_up=policy), last_fired=None, now=T0 + 3601.5, grace_s=2) == [T0 + 3600]


def test_skip_drops_missed_instants_and_keeps_the_one_on_time():
    e = entry(catch_up="skip")
    assert due_times(e, last_fired=T0, now=T0 + 600.5) == [T0 + 600]  # 60..540 were missed
    assert due_times(e, last_fired=T0, now=T0 + 630) == []  # 600 is 30 s late
    assert due_times(e, last_fired=T0, now=T0 + 630, grace_s=30) == [T0 + 600]  # exactly the grace
    assert due_times(e, last_fired=T0, now=T0 + 630, grace_s=90) == [T0 + 540, T0 + 600]


def test_once_fires_the_latest_missed_instant_only():
    e = entry(catch_up="once")
    assert due_times(e, last_fired=T0, now=T0 + 630) == [T0 + 600]
    assert due_times(e, last_fired=T0, now=T0 + 600) == [T0 + 600]
    # A year down: the latest instant, found without walking half a million of them.
    assert due_times(e, last_fired=T0, now=T0 + 365 * 86_400 + 7) == [T0 + 365 * 86_400]


def test_once_finds_the_latest_crontab_instant_long_ago():
    yearly = entry(Crontab(minute=0, hour=0, day_of_month=1, month_of_year=1), catch_up="once")
    last = dt.datetime(2020, 1, 1, tzinfo=dt.UTC).timestamp()
    now = dt.datetime(2026, 6, 1, tzinfo=dt.UTC).timestamp()
    assert due_times(yearly, last_fired=last, now=now) == [T0]
    minutely = entry(Crontab(minute="*", hour=9), catch_up="once")  # every minute of 09:xx
    last_minute = dt.datetime(2026, 5, 31, 9, 59, tzinfo=dt.UTC).timestamp()
    assert due_times(minutely, last_fired=last, now=now) == [last_minute]


def test_all_fires_every_missed_instant_oldest_first():
    e = entry(catch_up="all")
    assert due_times(e, last_fired=T0, now=T0 + 300) == [T0 + 60, T0 + 120, T0 + 180, T0 + 240, T0 + 300]


def test_all_fires_only_inside_its_window():
    windowed = entry(catch_up="all", catch_up_window_s=150)
    assert due_times(windowed, last_fired=T0, now=T0 + 600) == [T0 + 480, T0 + 540, T0 + 600]
    assert due_times(windowed, last_fired=T0, now=T0 + 630) == [T0 + 480, T0 + 540, T0 + 600]  # 630-480=150
    one_day = entry(catch_up="all")
    due = due_times(one_day, last_fired=T0 - 5 * 86_400, now=T0)
    assert due[0] == T0 - 86_400 and due[-1] == T0 and len(due) == 1441


def test_all_returns_at_most_the_cap_and_the_next_call_continues():
    every_second = entry(Every(1), catch_up="all")
    now = T0 + 25_000
    first = due_times(every_second, last_fired=T0, now=now)
    assert len(first) == MAX_CATCH_UP == 10_000
    assert first[0] == T0 + 1 and first[-1] == T0 + 10_000
    second = due_times(every_second, last_fired=first[-1], now=now)
    assert second[0] == T0 + 10_001 and len(second) == 10_000
    third = due_times(every_second, last_fired=second[-1], now=now)
    assert third == [T0 + s for s in range(20_001, 25_001)]


def test_a_paused_entry_fires_nothing():
    for policy in ("skip", "once", "all"):
        assert due_times(entry(catch_up=policy, paused=True), last_fired=T0, now=T0 + 600) == []


def test_a_last_fire_ahead_of_now_fires_nothing():
    # Another scheduler's clock ran ahead: what it fired is not due again here.
    assert due_times(entry(catch_up="all"), last_fired=T0 + 600, now=T0 + 300) == []


def test_crontab_instants_are_due_like_intervals():
    quarter = entry(Crontab(minute="*/15"), catch_up="all")
    assert due_times(quarter, last_fired=T0, now=T0 + 3600) == [T0 + 900, T0 + 1800, T0 + 2700, T0 + 3600]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"now": math.nan, "last_fired": T0}, "finite now"),
        ({"now": T0, "last_fired": T0, "grace_s": -1}, "grace_s >= 0"),
        ({"now": T0, "last_fired": math.inf}, "last_fired must be finite"),
    ],
)
def test_bad_times_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        due_times(entry(), **kwargs)
