"""Task rate limits: parsing Celery's rate strings, the task option, and the ``rate_limit`` command."""

from __future__ import annotations

import ast
import math
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest

from broker_svc import App, Settings, Task
from broker_svc.wire.task.rates import parse_rate
from worker.child.spec import FeedSpec
from worker.pool.feeding import Feeding

ROOT = pathlib.Path(__file__).resolve().parents[2]
EPS = 1e-9


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

    spec = FeedSpec(settings=Settings(), queues=("q",), prefetch=1, hostname="w@h", task_names=("job",))
    feeding = Feeding(spec, slots=1)
    limits = feeding.rates  # the buckets every child takes from
    registry = commands_of(app=app, pool=SimpleNamespace(feeding=feeding)).register(CommandRegistry())

    async def command(**arguments: object) -> Any:
        return await registry.dispatch("rate_limit", arguments)

    assert await command(task_name="job", rate_limit="10/m") == {"ok": "new rate limit set successfully"}
    assert limits.rate("job") == pytest.approx(10 / 60)
    assert job.rate_limit == "10/m"
    assert await command(task_name="job", rate_limit=5) == {"ok": "new rate limit set successfully"}
    assert limits.rate("job") == 5.0
    for off in (None, 0, ""):
        assert await command(task_name="job", rate_limit=off) == {"ok": "rate limit disabled successfully"}
        assert limits.rate("job") is None
    assert await command(task_name="nope", rate_limit="1/s") == {"error": "unknown task"}
    assert limits.rate("nope") is None

    reply = await command(task_name="job", rate_limit="10/x")
    assert reply["error"].startswith("Invalid rate limit string: ValueError(")
    # Celery checks the rate before the task name.
    reply = await command(task_name="nope", rate_limit="10/x")
    assert reply["error"].startswith("Invalid rate limit string: ")
    assert "error" in await command(task_name="job")  # rate_limit is required
    feeding.close()


def test_the_rate_modules_do_no_io():
    for path in ("broker_svc/wire/task/rates.py", "worker/rules/rate_limits.py"):
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
