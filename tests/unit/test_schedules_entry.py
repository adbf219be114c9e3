"""Entry (validation, JSON) and parse_beat_schedule (Celery's beat_schedule and our keys)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from broker_svc.schedules import Crontab, Entry, Every, crontab, parse_beat_schedule


def entry(**overrides) -> Entry:
    fields: dict[str, Any] = {"name": "tick", "task": "tasks.tick", "schedule": Every(60)}
    fields.update(overrides)
    return Entry(**fields)


def test_an_entry_has_celerys_defaults_and_ours():
    e = entry()
    assert (e.args, e.kwargs, e.options) == ((), {}, {})
    assert (e.catch_up, e.catch_up_window_s, e.overlap, e.paused) == ("once", None, "allow", False)
    assert e.window_s == 86_400
    assert entry(catch_up="all", catch_up_window_s=600).window_s == 600


def test_entries_do_not_share_their_default_dicts():
    assert entry().kwargs is not entry().kwargs
    assert entry().options is not entry().options


def test_args_given_as_a_list_are_kept_as_a_tuple():
    assert entry(args=[1, 2]).args == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"name": ""}, ValueError, "name must be a non-empty string"),
        ({"task": ""}, ValueError, "entry 'tick': task must be the task's registered name"),
        ({"schedule": 60}, TypeError, "schedule must be an Every or a Crontab.*parse_beat_schedule"),
        ({"args": "ab"}, TypeError, "args must be a tuple or a list"),
        ({"kwargs": {1: 2}}, TypeError, "kwargs must be a dict with string keys"),
        ({"options": [("queue", "q")]}, TypeError, "options must be a dict"),
        ({"options": {"queu": "q"}}, ValueError, r"unknown option\(s\) \['queu'\]; apply_async takes"),
        ({"catch_up": "latest"}, ValueError, "catch_up must be one of .*'skip', 'once', 'all'"),
        (
            {"catch_up": "all", "catch_up_window_s": 0},
            ValueError,
            "catch_up_window_s must be finite and above 0",
        ),
        ({"catch_up": "all", "catch_up_window_s": "1h"}, TypeError, "catch_up_window_s must be a number"),
        ({"catch_up_window_s": 60}, ValueError, "only applies to catch_up='all'.*set catch_up='all'"),
        ({"overlap": "queue"}, ValueError, "overlap must be one of .*'allow', 'skip'"),
        ({"paused": "yes"}, TypeError, "paused must be True or False"),
    ],
)
def test_a_bad_field_is_refused_with_a_fix(overrides, error, message):
    with pytest.raises(error, match=message):
        entry(**overrides)


def test_an_entry_survives_json():
    original = entry(
        schedule=Crontab(minute="*/5", hour="9-17", day_of_week="mon-fri", timezone="Europe/Berlin"),
        args=(1, "two", [3]),
        kwargs={"x": {"y": None}},
        options={"queue": "reports", "priority": 5, "expires": 30, "headers": {"h": "v"}},
        catch_up="all",
        catch_up_window_s=3600.0,
        overlap="skip",
        paused=True,
    )
    data = json.loads(json.dumps(original.to_json()))
    assert Entry.from_json(data) == original
    assert Entry.from_json(data).to_json() == original.to_json()
    assert Entry.from_json(entry().to_json()) == entry()


def test_an_entry_json_cannot_carry_is_refused_when_written():
    with pytest.raises(ValueError, match="entry 'tick' cannot be stored as JSON"):
        entry(args=(dt.datetime(2026, 1, 1),)).to_json()


@pytest.mark.parametrize(
    "data",
    [
        {"name": "tick", "task": "tasks.tick"},
        {"name": "tick", "task": "tasks.tick", "schedule": {"type": "every", "seconds": 1}, "color": "red"},
        "tick",
    ],
)
def test_entry_json_with_missing_or_unknown_keys_is_refused(data):
    with pytest.raises(ValueError, match="not an entry's JSON"):
        Entry.from_json(data)


def test_a_beat_schedule_reads_as_entries_in_its_order():
    entries = parse_beat_schedule(
        {
            "add-every-5s": {
                "task": "tasks.add",
                "schedule": dt.timedelta(seconds=5),
                "args": (1, 2),
                "kwargs": {},
                "options": {"queue": "q"},
            },
            "every-90s": {"task": "tasks.ping", "schedule": 90},
            "quarter-hour": {"task": "tasks.report", "schedule": 0.25},
            "mornings": {"task": "tasks.mail", "schedule": crontab(minute=0, hour=7), "kwargs": {"to": "me"}},
            "ours": {"task": "tasks.tick", "schedule": Every(10), "args": [3]},
        }
    )
    assert [e.name for e in entries] == ["add-every-5s", "every-90s", "quarter-hour", "mornings", "ours"]
    add, ping, report, mail, tick = entries
    assert add == Entry("add-every-5s", "tasks.add", Every(5), args=(1, 2), options={"queue": "q"})
    assert ping.schedule == Every(90)
    assert report.schedule == Every(0.25)
    assert mail.schedule == Crontab(minute=0, hour=7) and mail.kwargs == {"to": "me"}
    assert tick.args == (3,)


def test_our_keys_set_the_policies():
    (e,) = parse_beat_schedule(
        {
            "backfill": {
                "task": "tasks.backfill",
                "schedule": 60,
                "catch_up": "all",
                "catch_up_window": dt.timedelta(hours=2),
                "overlap": "skip",
                "paused": True,
                "relative": False,
            }
        }
    )
    assert (e.catch_up, e.catch_up_window_s, e.overlap, e.paused) == ("all", 7200.0, "skip", True)
    (e,) = parse_beat_schedule({"b": {"task": "t", "schedule": 60, "catch_up": "all", "catch_up_window": 90}})
    assert e.catch_up_window_s == 90


def test_crontabs_without_a_zone_take_the_timezone_setting():
    entries = parse_beat_schedule(
        {
            "plain": {"task": "t", "schedule": crontab(minute=0, hour=9)},
            "own": {"task": "t", "schedule": crontab(minute=0, hour=9, timezone="Asia/Tokyo")},
            "interval": {"task": "t", "schedule": 60},
        },
        timezone="Europe/Berlin",
    )
    plain, own, interval = (e.schedule for e in entries)
    assert isinstance(plain, Crontab) and plain.timezone == "Europe/Berlin"
    assert isinstance(own, Crontab) and own.timezone == "Asia/Tokyo"
    assert interval == Every(60)
    (utc,) = parse_beat_schedule({"plain": {"task": "t", "schedule": crontab(minute=0)}})
    assert isinstance(utc.schedule, Crontab) and utc.schedule.timezone is None


def test_an_unknown_timezone_is_refused_even_with_no_crontab():
    with pytest.raises(ValueError, match="unknown timezone 'Europe/Nowhere'"):
        parse_beat_schedule({"a": {"task": "t", "schedule": 5}}, timezone="Europe/Nowhere")
    with pytest.raises(ValueError, match="unknown timezone"):
        parse_beat_schedule({}, timezone="Not a zone")


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (
            {"task": "t", "schedule": 5, "queue": "q"},
            ValueError,
            r"beat_schedule\['e'\]: unknown key\(s\) \['queue'\] \(put \['queue'\] in 'options'\)",
        ),
        (
            {"task": "t", "schedule": 5, "relative": True},
            ValueError,
            "relative=True is not supported.*anchored",
        ),
        ({"task": "t"}, ValueError, r"beat_schedule\['e'\]: missing \['schedule'\]"),
        ({"schedule": 5}, ValueError, r"missing \['task'\]"),
        ({"task": "t", "schedule": 0}, ValueError, r"beat_schedule\['e'\]: Every\(seconds\) must be"),
        ({"task": "t", "schedule": dt.timedelta(0)}, ValueError, "above 0"),
        ({"task": "t", "schedule": "*/5 * * * *"}, TypeError, r"beat_schedule\['e'\]: schedule '\*/5"),
        ({"task": "t", "schedule": True}, TypeError, "is not a timedelta"),
        (
            {"task": "t", "schedule": 5, "catch_up": "sometimes"},
            ValueError,
            r"beat_schedule\['e'\]: .*catch_up",
        ),
        ({"task": "t", "schedule": 5, "options": {"countdwon": 1}}, ValueError, r"\['e'\]: unknown option"),
        (
            {"task": "t", "schedule": 5, "colour": 1},
            ValueError,
            r"unknown key\(s\) \['colour'\]; an entry takes",
        ),
        ({"task": "t", "schedule": 5, "args": 7}, TypeError, "args must be a tuple or a list"),
        ("tasks.t", TypeError, r"beat_schedule\['e'\] must be a dict"),
    ],
)
def test_a_bad_beat_entry_is_refused_naming_it(spec, error, message):
    with pytest.raises(error, match=message):
        parse_beat_schedule({"e": spec})
