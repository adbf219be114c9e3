"""What ctl prints for a person: a layout per inspect method, units, colour only on a terminal."""

from __future__ import annotations

import contextlib
import io
import time

import pytest

from broker_svc.wire.records.dead_letter import DeadLetter, Requeued, RequeueResult
from control.blocking.client import QueueDepth
from control.cli.dead import format_letter, format_letters, format_requeued
from control.cli.main import build_parser
from control.cli.render import Style, format_event, human_bytes, human_seconds, queue_table, show, top_screen


def _shown(by_node: dict, method: str | None, style: Style | None = None) -> str:
    out = io.StringIO()
    show(by_node, False, out, method=method, style=style or Style(False))
    return out.getvalue()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (9.24e-05, "92 µs"),
        (0.012, "12 ms"),
        (3.21, "3.2 s"),
        (245, "4m 05s"),
        (3720, "1h 02m"),
        (183600, "2d 03h"),
    ],
)
def test_durations_have_units(seconds: float, text: str):
    assert human_seconds(seconds) == text


@pytest.mark.parametrize(
    ("runtime", "text"),
    [
        (0.0123456789, "12.3ms"),
        (0.00004567, "0.0457ms"),
        (0.99996, "1s"),
        (3.14159265, "3.14s"),
        (245.5, "4m05s"),
    ],
)
def test_an_event_runtime_has_three_significant_digits_and_a_unit(runtime: float, text: str):
    event = {"type": "task-succeeded", "hostname": "w@h", "clock": 3, "uuid": "id-1", "runtime": runtime}
    assert f" runtime={text}" in format_event(event)


def test_sizes_have_units():
    assert [human_bytes(n) for n in (512, 1536, 50_540_000)] == ["512 B", "1.5 KiB", "48.2 MiB"]


def test_active_tasks_are_a_table_with_how_long_each_has_run():
    task = {
        "id": "6f1c-task", "name": "proj.resize", "args": [1, 2], "argsrepr": "(1, 2)", "kwargs": {},
        "time_start": time.time() - 125, "worker_pid": 4242, "hostname": "w1@box",
    }  # fmt: skip
    text = _shown({"w1@box": [task]}, "active")
    head, row = text.splitlines()
    assert head.startswith("w1@box") and "1 task" in head
    assert "6f1c-task" in row and "proj.resize" in row and "(1, 2)" in row and "pid 4242" in row
    assert "running 2m 0" in row  # 2m 05s, give or take the test's own time
    assert "{" not in text  # no JSON blob


@pytest.mark.parametrize(
    ("args", "kwargs", "shown"),
    [
        ([3.0], {"tag": "hello"}, "(3.0,) {'tag': 'hello'}"),  # the values (inspect active)
        ("[3.0]", "{'tag': 'hello'}", "[3.0] {'tag': 'hello'}"),  # their reprs (inspect active --safe)
        ([], {"tag": "hello"}, "() {'tag': 'hello'}"),
        ([1, 2], {}, "(1, 2)"),
    ],
)
def test_active_tasks_show_their_keyword_arguments_too(args: object, kwargs: object, shown: str):
    task = {"id": "t-1", "name": "proj.resize", "args": args, "kwargs": kwargs, "time_start": time.time()}
    [row] = _shown({"w1@box": [task]}, "active").splitlines()[1:]
    assert f" {shown} " in row


def test_stats_show_uptime_tasks_pool_and_cpu_with_units():
    stats = {
        "total": {"proj.add": 1200, "proj.mul": 30}, "pid": 77, "uptime": 3725,
        "pool": {"max-concurrency": 4, "processes": [1, 2, 3, 4]}, "prefetch_count": 4,
        "rusage": {"utime": 12.5, "stime": 0.25, "maxrss": 51200},
        "broker": {"hostname": "rabbit", "port": 5672, "virtual_host": "/"},
        "unknown_tasks": {"other.app.task": 3},
    }  # fmt: skip
    text = _shown({"w1@box": stats}, "stats")
    assert "up 1h 02m, 1230 tasks done, pid 77" in text
    assert "pool: 4 processes (max 4), prefetch 4" in text
    assert "1200  proj.add" in text
    assert "cpu: user 12.5 s, system 250 ms, max RSS 50.0 MiB" in text
    assert "unknown tasks (dead-lettered): other.app.task ×3" in text


def test_active_queues_one_line_each():
    queue = {
        "name": "emails", "exchange": {"name": "emails", "type": "direct"}, "routing_key": "emails",
        "queue_arguments": {"x-queue-type": "quorum"}, "durable": True,
    }  # fmt: skip
    text = _shown({"w1@box": [queue]}, "active_queues")
    assert "emails  quorum  durable  exchange 'emails' (direct)  key 'emails'" in text


def test_errors_stand_out_and_colour_is_only_for_a_terminal():
    replies = {"w1@box": {"error": "unknown task"}, "w2@box": {"ok": "rate limit set"}}
    plain = _shown(replies, None)
    assert "ERROR unknown task" in plain and "OK rate limit set" in plain and "\x1b[" not in plain
    coloured = _shown(replies, None, Style(True))
    assert "\x1b[31;1mERROR\x1b[0m" in coloured and "\x1b[32mOK\x1b[0m" in coloured
    assert not Style.for_stream(io.StringIO()).enabled  # not a terminal


def test_a_report_is_printed_line_by_line_under_its_node():
    text = _shown({"w1@h": {"ok": "\nsoftware -> clockwork:1.0\nloader   -> m:app\n"}}, "report")
    assert text.splitlines() == ["w1@h  OK", "        software -> clockwork:1.0", "        loader   -> m:app"]
    assert _shown({"w1@h": {"error": "unknown command 'report'"}}, "report").startswith("w1@h  ERROR")


def test_control_commands_have_help_that_says_what_they_do():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["control", "--help"])
    text = out.getvalue()
    assert "rate-limit" in text and "set a task's rate limit" in text
    assert "pool-grow" in text and "add N pool children" in text
    assert '{"ok"' not in text  # the reply's shape is not the help


def test_dead_letters_print_without_letting_a_control_character_reach_the_terminal():
    headers = {
        "id": "t\x1b[2J1", "task": "app.add", "x-clockwork-reason": "rejected",
        "x-clockwork-error": "boom\x1b]0;owned\x07", "x-clockwork-dead-at": "2025-01-02T03:04:05.5+00:00",
        "x-custom": "\x1b[31mred",
    }  # fmt: skip
    letter = DeadLetter.read(
        "orders.dead", headers, {"content_type": "application/json"}, b'[["\\u001b"], {}, {}]'
    )
    table = format_letters([letter], Style(False))
    assert "2025-01-02 03:04:05" in table and "1 dead letter\n" in table and "\x1b" not in table
    full = format_letter(letter, Style(False))
    assert "\x1b" not in full and "\x07" not in full
    assert 'args: ["\\u001b"]' in full and "boom\\x1b]0;owned\\x07" in full
    done = format_requeued(
        RequeueResult((Requeued(letter, "orders"), Requeued(letter, "orders", earlier=True)))
    )
    assert "1 requeued" in done and "cut short" in done and "\x1b" not in done
    assert format_letters([], Style(False)) == "no dead letters\n"


def test_a_queue_with_waiting_tasks_and_no_consumer_is_marked():
    row = {"exists": True, "ready": 3, "held_by_workers": 0, "consumers": 0, "dead": 0, "rate_per_s": 0.0}
    marked = queue_table(
        {"orphan": {**row, "no_consumer": True}, "fine": {**row, "consumers": 1}}, Style(False)
    )
    [orphan] = [line for line in marked.splitlines() if line.startswith("orphan")]
    [fine] = [line for line in marked.splitlines() if line.startswith("fine")]
    assert "no consumer" in orphan and "no consumer" not in fine
    depths = {"orphan": QueueDepth(ready=3, consumers=0), "empty": QueueDepth(ready=0, consumers=0)}
    screen = top_screen({}, {}, depths, {}, style=Style(False), clock="12:00:00")
    [orphan] = [line for line in screen.splitlines() if line.startswith("orphan")]
    [empty] = [line for line in screen.splitlines() if line.startswith("empty")]
    assert "no consumer" in orphan and "no consumer" not in empty  # nothing waits for one
