"""Task rate limits: parsing Celery's rate strings, and per-task token buckets reserved ahead."""

from __future__ import annotations

import ast
import math
import pathlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_svc import App, Task
from broker_svc.wire.rates import parse_rate
from worker.consume.rate_limits import RateLimits

ROOT = pathlib.Path(__file__).resolve().parents[2]
EPS = 1e-9


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- parse_rate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "per_second"),
    [
        ("10/s", 10.0), ("10/m", 10 / 60), ("2/h", 2 / 3600), ("0.5/s", 0.5), ("10", 10.0), ("10/", 10.0),
        (" 10 / m ", 10 / 60), (10, 10.0), (2.5, 2.5), ("1e3/s", 1000.0),
    ],
)  # fmt: skip
def test_parse_rate_reads_celery_rate_strings_and_numbers_as_tokens_per_second(value, per_second):
    assert parse_rate(value) == pytest.approx(per_second)


@pytest.mark.parametrize("value", [None, "", "   ", 0, 0.0, "0", "0/m", "0.0/h"])
def test_parse_rate_reads_none_empty_and_zero_as_no_limit(value):
    assert parse_rate(value) is None


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("10/x", "unknown unit 'x'"), ("10/S", "unknown unit"), ("10/s/m", "unknown unit 's/m'"),
        ("ten/s", "'ten' is not a number"), ("/s", "'' is not a number"), ("abc", "not a number"),
        ("-1/s", "must not be negative"), (-5, "must not be negative"), ("inf/s", "finite"),
        ("nan", "finite"), (math.inf, "finite"), (True, "expected a string or a number"),
        ([10], "expected a string or a number"), ("5e-324/h", "too small"),
    ],
)  # fmt: skip
def test_parse_rate_refuses_garbage_with_a_clear_message(value, reason):
    with pytest.raises(ValueError, match="invalid rate limit") as info:
        parse_rate(value)
    assert reason in str(info.value)
    assert '"10/s"' in str(info.value)  # the fix-it hint


# -- reserve ------------------------------------------------------------------------------------


def test_a_task_without_a_limit_is_always_due_now():
    limits = RateLimits(FakeClock())
    assert [limits.reserve("free") for _ in range(100)] == [0.0] * 100
    assert limits.get("free") is None


def test_reservations_of_a_limited_task_are_due_one_interval_apart_after_the_first():
    limits = RateLimits(FakeClock())
    limits.set("t", "10/s")
    delays = [limits.reserve("t") for _ in range(5)]
    assert delays == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_fifty_reservations_at_ten_per_second_spread_over_five_seconds():
    limits = RateLimits(FakeClock())
    limits.set("t", "10/s")
    delays = [limits.reserve("t") for _ in range(50)]
    assert delays[-1] == pytest.approx(4.9)
    assert sum(delays) == pytest.approx(sum(i * 0.1 for i in range(50)))
    assert limits.reserve("t") == pytest.approx(5.0)


def test_the_bucket_refills_with_time_but_holds_one_token_at_most():
    clock = FakeClock()
    limits = RateLimits(clock)
    limits.set("t", "2/s")
    assert limits.reserve("t") == 0.0
    assert limits.reserve("t") == pytest.approx(0.5)
    clock.advance(0.75)  # the second token is due 0.25 s ago; the third at +0.25 s
    assert limits.reserve("t") == pytest.approx(0.25)
    clock.advance(60)  # a long idle time refills one token only: no burst of 120
    assert limits.reserve("t") == 0.0
    assert limits.reserve("t") == pytest.approx(0.5)


def test_limits_are_per_task():
    limits = RateLimits(FakeClock())
    limits.set("a", "1/s")
    limits.set("b", "1/m")
    assert [limits.reserve("a"), limits.reserve("b"), limits.reserve("a"), limits.reserve("b")] == (
        pytest.approx([0.0, 0.0, 1.0, 60.0])
    )
    assert limits.reserve("c") == 0.0


def test_set_get_and_unset():
    limits = RateLimits(FakeClock())
    limits.set("t", "120/m")
    assert limits.get("t") == pytest.approx(2.0)
    for off in (None, 0, "", "0/s"):
        limits.set("t", "5/s")
        limits.set("t", off)
        assert limits.get("t") is None
        assert limits.reserve("t") == 0.0
    limits.set("never-limited", None)  # removing an absent limit is fine
    with pytest.raises(ValueError, match="unknown unit"):
        limits.set("t", "5/x")
    assert limits.get("t") is None  # a refused rate changes nothing


def test_a_limit_set_again_after_removal_starts_full():
    limits = RateLimits(FakeClock())
    limits.set("t", "1/h")
    limits.reserve("t")
    assert limits.reserve("t") == pytest.approx(3600.0)
    limits.set("t", None)
    limits.set("t", "1/h")
    assert limits.reserve("t") == 0.0


def test_setting_the_same_rate_again_changes_nothing():
    limits = RateLimits(FakeClock())
    limits.set("t", "1/s")
    limits.reserve("t")
    limits.reserve("t")
    limits.set("t", 1)
    assert limits.reserve("t") == pytest.approx(2.0)


def test_changing_a_rate_keeps_the_debt_in_tokens_and_refills_at_the_new_rate():
    clock = FakeClock()
    limits = RateLimits(clock)
    limits.set("t", "10/s")
    for _ in range(10):
        limits.reserve("t")  # the next token is due in 1 s: 10 tokens of debt at 10/s
    limits.set("t", "100/s")
    assert limits.reserve("t") == pytest.approx(0.1)  # 10 tokens at 100/s
    assert limits.reserve("t") == pytest.approx(0.11)
    limits.set("t", "100/s")
    limits.set("t", "1/s")
    limits.set("t", "100/s")  # and back: the same schedule
    assert limits.reserve("t") == pytest.approx(0.12)


def test_changing_the_rate_of_an_idle_task_leaves_it_full():
    clock = FakeClock()
    limits = RateLimits(clock)
    limits.set("t", "1/m")
    limits.reserve("t")
    clock.advance(120)
    limits.set("t", "1/h")
    assert limits.reserve("t") == 0.0
    assert limits.reserve("t") == pytest.approx(3600.0)


def test_for_tasks_reads_the_rate_limit_option_of_each_task():
    app = App("t")

    @app.task(name="slow", rate_limit="6/m")
    def slow() -> None: ...

    @app.task(name="fast")
    def fast() -> None: ...

    limits = RateLimits.for_tasks(app.tasks, FakeClock())
    assert limits.get("slow") == pytest.approx(0.1)
    assert limits.get("fast") is None


@given(
    rate=st.floats(min_value=0.01, max_value=10_000),
    count=st.integers(min_value=1, max_value=200),
)
def test_with_a_still_clock_delays_never_decrease_and_are_one_interval_apart(rate, count):
    limits = RateLimits(FakeClock())
    limits.set("t", rate)
    delays = [limits.reserve("t") for _ in range(count)]
    assert delays[0] == 0.0
    for earlier, later in zip(delays, delays[1:], strict=False):
        assert later >= earlier
        assert later - earlier >= 1 / rate - EPS * max(1.0, later)


@given(
    rate=st.floats(min_value=0.01, max_value=10_000),
    steps=st.lists(st.floats(min_value=0, max_value=100), min_size=1, max_size=100),
)
def test_with_a_moving_clock_starts_are_one_interval_apart_and_never_later_than_needed(rate, steps):
    clock = FakeClock()
    limits = RateLimits(clock)
    limits.set("t", rate)
    starts: list[float] = []
    for step in steps:
        clock.advance(step)
        delay = limits.reserve("t")
        assert delay >= 0.0
        start = clock.now + delay
        if starts:
            gap = start - starts[-1]
            assert gap >= 1 / rate - EPS * max(1.0, start)
            # It waits only for its turn: when it is not due now, it is due right after the previous one.
            assert delay == 0.0 or gap == pytest.approx(1 / rate)
        starts.append(start)


# -- the task option ----------------------------------------------------------------------------


def test_the_rate_limit_task_option_is_stored_on_the_task():
    app = App("t")

    @app.task(rate_limit="10/s")
    def limited() -> None: ...

    @app.task
    def unlimited() -> None: ...

    assert limited.rate_limit == "10/s"
    assert unlimited.rate_limit is None
    assert "rate_limit" not in limited.s().options  # not a send option


def test_a_bad_rate_limit_option_fails_at_decoration_with_the_task_name():
    app = App("t")
    with pytest.raises(ValueError, match=r"task 'bad': invalid rate limit 'bad'.*not a number"):

        @app.task(name="bad", rate_limit="bad")
        def bad() -> None: ...

    assert "bad" not in app.tasks


def test_a_bad_rate_limit_on_a_base_class_fails_at_decoration():
    class Limited(Task):
        rate_limit = "10/fortnight"

    app = App("t")
    with pytest.raises(ValueError, match="unknown unit 'fortnight'"):

        @app.task(base=Limited)
        def job() -> None: ...


# -- the rate_limit control command -------------------------------------------------------------


async def test_the_rate_limit_command_answers_as_celery_does():
    from control.protocol.commands import CommandRegistry
    from tests.unit.test_worker_commands import commands_of

    app = App("t")

    @app.task(name="job")
    def job() -> None: ...

    limits = RateLimits(FakeClock())
    registry = commands_of(app=app, limits=limits).register(CommandRegistry())

    async def command(**arguments: object) -> Any:
        return await registry.dispatch("rate_limit", arguments)

    assert await command(task_name="job", rate_limit="10/m") == {"ok": "new rate limit set successfully"}
    assert limits.get("job") == pytest.approx(10 / 60)
    assert job.rate_limit == "10/m"
    assert await command(task_name="job", rate_limit=5) == {"ok": "new rate limit set successfully"}
    assert limits.get("job") == 5.0
    for off in (None, 0, ""):
        assert await command(task_name="job", rate_limit=off) == {"ok": "rate limit disabled successfully"}
        assert limits.get("job") is None
    assert await command(task_name="nope", rate_limit="1/s") == {"error": "unknown task"}
    assert limits.get("nope") is None

    reply = await command(task_name="job", rate_limit="10/x")
    assert reply["error"].startswith("Invalid rate limit string: ValueError(")
    # Celery checks the rate before the task name.
    reply = await command(task_name="nope", rate_limit="10/x")
    assert reply["error"].startswith("Invalid rate limit string: ")
    assert "error" in await command(task_name="job")  # rate_limit is required


def test_the_rate_modules_do_no_io():
    for path in ("broker_svc/wire/rates.py", "worker/consume/rate_limits.py"):
        tree = ast.parse((ROOT / path).read_text())
        tops = {
            name.split(".")[0]
            for node in ast.walk(tree)
            for name in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
        }
        assert not tops & {"pika", "aio_pika", "aiormq", "socket", "asyncio"}, path
