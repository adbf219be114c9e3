"""Crontab fields read as Celery's crontab reads them: numbers, names, ranges, steps, lists, errors."""

from __future__ import annotations

import copy
import pickle

import pytest

from broker_svc.schedules import Crontab, crontab
from broker_svc.schedules.cron_fields import parse_field


@pytest.mark.parametrize(
    ("field", "spec", "expected"),
    [
        ("minute", "*", set(range(60))),
        ("minute", "*/15", {0, 15, 30, 45}),
        ("minute", "0-59/10", {0, 10, 20, 30, 40, 50}),
        ("minute", "1,2,10-12", {1, 2, 10, 11, 12}),
        ("minute", 7, {7}),
        ("minute", [0, 30], {0, 30}),
        ("minute", {5, 6}, {5, 6}),
        ("minute", (m for m in (1, 2)), {1, 2}),
        ("minute", " 1 , 2 ", {1, 2}),
        ("hour", "*/3", {0, 3, 6, 9, 12, 15, 18, 21}),
        ("hour", "1-5", {1, 2, 3, 4, 5}),
        ("hour", "22-2", {22, 23, 0, 1, 2}),  # wraps round, as Celery's
        ("hour", "22-2/2", {22, 0, 2}),
        ("hour", "0,8-17/2", {0, 8, 10, 12, 14, 16}),
        ("day_of_week", "*", set(range(7))),
        ("day_of_week", "mon-fri", {1, 2, 3, 4, 5}),
        ("day_of_week", "sun,sat", {0, 6}),
        ("day_of_week", "fri-mon", {5, 6, 0, 1}),
        ("day_of_week", "Monday", {1}),
        ("day_of_week", "tues,THURS", {2, 4}),
        ("day_of_week", 7, {0}),  # cron's second Sunday
        ("day_of_week", "5-7", {5, 6, 0}),
        ("day_of_week", "1-7/2", {1, 3, 5, 0}),
        ("day_of_week", "*/2", {0, 2, 4, 6}),
        ("day_of_month", "*", set(range(1, 32))),
        ("day_of_month", "*/3", {1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31}),
        ("day_of_month", "2-30/2", set(range(2, 31, 2))),
        ("day_of_month", "1-7,15-21", set(range(1, 8)) | set(range(15, 22))),
        ("month_of_year", "*/3", {1, 4, 7, 10}),
        ("month_of_year", "2-12/2", {2, 4, 6, 8, 10, 12}),
        ("month_of_year", "jan,jul", {1, 7}),
        ("month_of_year", "sept-dec", {9, 10, 11, 12}),
        ("month_of_year", 12, {12}),
    ],
)
def test_a_field_expands_to_the_values_it_matches(field, spec, expected):
    assert parse_field(field, spec) == expected


@pytest.mark.parametrize(
    ("field", "spec", "message"),
    [
        ("minute", 60, "minute: 60 .* out of range 0-59"),
        ("minute", "0-60", "minute: 60 .* out of range 0-59"),
        ("minute", [1, 99], "minute: 99 .* out of range"),
        ("minute", "", "minute: .* empty part"),
        ("minute", "1,,2", "minute: .* empty part"),
        ("minute", "*/0", "minute: step '0'"),
        ("minute", "*/x", "minute: step 'x'"),
        ("minute", "*/", "minute: step ''"),
        ("minute", "5/15", "minute: '5/15' .* single value; write a range such as '5-59/15'"),
        ("minute", "-5", "minute: '-5' .* not a number 0-59"),
        ("minute", "mon", "minute: 'mon' .* not a number"),
        ("minute", [], "minute: .* matches nothing"),
        ("hour", 24, "hour: 24 .* out of range 0-23"),
        ("day_of_week", 8, "day_of_week: 8 .* out of range 0-7"),
        ("day_of_week", "funday", "day_of_week: 'funday' .* not a number or a name"),
        ("day_of_week", "su", "day_of_week: 'su'"),  # two letters name nothing
        ("day_of_month", 0, "day_of_month: 0 .* out of range 1-31"),
        ("day_of_month", "32", "day_of_month: 32"),
        ("month_of_year", "13", "month_of_year: 13 .* out of range 1-12"),
        ("month_of_year", "janvier", "month_of_year: 'janvier'"),
    ],
)
def test_a_bad_field_is_a_value_error_that_names_the_field(field, spec, message):
    with pytest.raises(ValueError, match=message):
        parse_field(field, spec)


@pytest.mark.parametrize("spec", [1.5, None, True, ["1"], [True]])
def test_a_field_of_another_type_is_a_type_error(spec):
    with pytest.raises(TypeError, match="crontab minute"):
        parse_field("minute", spec)


def test_the_constructor_takes_celerys_fields_in_celerys_order_and_exposes_sets():
    c = Crontab("*/30", "9-17", "mon-fri", "1-7", "*/6")
    assert c.minute == {0, 30}
    assert c.hour == set(range(9, 18))
    assert c.day_of_week == {1, 2, 3, 4, 5}
    assert c.day_of_month == set(range(1, 8))
    assert c.month_of_year == {1, 7}
    assert c.timezone is None
    assert crontab is Crontab


def test_a_day_of_month_no_chosen_month_has_is_refused():
    with pytest.raises(ValueError, match="day_of_month 30 never occurs in month_of_year 2"):
        Crontab(day_of_month=30, month_of_year=2)
    with pytest.raises(ValueError, match="never occurs"):
        Crontab(day_of_month=31, month_of_year="apr,jun,sep,nov")
    assert Crontab(day_of_month=29, month_of_year=2).day_of_month == {29}  # leap years have it


def test_an_unknown_zone_is_a_value_error():
    with pytest.raises(ValueError, match="unknown timezone 'Mars/Olympus'"):
        Crontab(timezone="Mars/Olympus")
    with pytest.raises(ValueError, match="unknown timezone"):
        Crontab(timezone="../etc/passwd")


def test_a_cron_line_reads_minute_hour_day_month_weekday():
    assert Crontab.from_string("*/15 9-17 1 jan-mar mon-fri") == Crontab(
        minute="*/15", hour="9-17", day_of_month=1, month_of_year="1-3", day_of_week="1-5"
    )
    with pytest.raises(ValueError, match="5 fields"):
        Crontab.from_string("* * *")


def test_crontabs_compare_by_what_they_match_and_their_zone():
    assert Crontab(minute="0,30") == Crontab(minute=[30, 0])
    assert hash(Crontab(minute="0,30")) == hash(Crontab(minute=[30, 0]))
    assert Crontab(day_of_week=7) == Crontab(day_of_week="sun")
    assert Crontab(minute=0) != Crontab(minute=0, timezone="Europe/Berlin")
    assert Crontab(minute=0) != Crontab(minute=1)


def test_a_crontab_is_immutable():
    c = Crontab(minute=0)
    with pytest.raises(AttributeError, match="immutable"):
        c.minute = frozenset({1})


def test_a_crontab_pickles_and_copies_as_an_equal_one():
    c = Crontab(minute="*/15", hour=[1, 2], day_of_week="mon-fri", timezone="Europe/Berlin")
    for again in (pickle.loads(pickle.dumps(c)), copy.copy(c), copy.deepcopy(c)):
        assert again == c
        assert again.to_json() == c.to_json()
        assert again.next_after(1_767_225_600) == c.next_after(1_767_225_600)
