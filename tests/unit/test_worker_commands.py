"""The worker's control commands, one handler at a time (no broker: collaborators are plain stand-ins)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from broker_svc import App, Settings
from control.protocol.commands import COMMANDS, CommandRegistry
from worker.child.channel import ChildChannel
from worker.child.spec import FeedSpec
from worker.pool.feeding import Feeding
from worker.remote.commands import COMMAND_NAMES, WorkerCommands


def commands_of(**collaborators: Any) -> WorkerCommands:
    """A WorkerCommands whose collaborators are the ones given, the rest None (unused by the test)."""
    names = (
        "app", "config", "clock", "state", "queues", "pool", "sizer", "autoscaler", "revoker",
        "revocation_log", "events", "heart",
    )  # fmt: skip
    given = {name: collaborators.get(name, cast(Any, None)) for name in names}
    return WorkerCommands(**given, request_stop=collaborators.get("request_stop", lambda: None))


@pytest.fixture
def pool() -> Iterator[Any]:
    """A pool as the commands see it: its children's side (``feeding``), real, with no child yet."""
    feeding = Feeding(FeedSpec(settings=Settings(), queues=("q",), prefetch=1, hostname="w@h"), slots=1)
    yield SimpleNamespace(feeding=feeding)
    feeding.close()


async def told(pool: Any, op: str) -> dict[str, Any]:
    """What a child that joins now is told of ``op`` before it may consume."""
    ours, theirs = socket.socketpair()
    _reader, writer = await asyncio.open_connection(sock=ours)
    pool.feeding.start(list)
    pool.feeding.joined(0, writer)
    child = ChildChannel(theirs)
    try:
        while (frame := await asyncio.to_thread(child.receive)) is not None and frame["op"] != "consume":
            if frame["op"] == op:
                return frame
    finally:
        writer.close()
        theirs.close()
    raise AssertionError(f"no {op!r} frame before consume")


def test_every_command_of_the_vocabulary_has_exactly_one_handler() -> None:
    assert len(COMMAND_NAMES) == len(set(COMMAND_NAMES))
    registry = commands_of().register(CommandRegistry())
    assert registry.names == sorted(COMMANDS)


async def test_ping_answers_pong() -> None:
    assert await commands_of().ping() == {"ok": "pong"}


async def test_hello_from_this_node_is_not_answered() -> None:
    config = SimpleNamespace(hostname="w1@host")
    assert await commands_of(config=config).hello("w1@host", revoked=[]) is None


async def test_time_limit_is_set_for_a_known_task_only(pool: Any) -> None:
    app = App("t")

    @app.task(name="job")
    def job() -> None: ...

    commands = commands_of(app=app, pool=pool)
    assert await commands.time_limit("job", soft=1.0, hard=2.0) == {"ok": "time limits set successfully"}
    assert await commands.time_limit("nope", soft=1.0, hard=None) == {"error": "unknown task"}
    # Every child, a new one too, is told the limits of the known task only.
    frame = await told(pool, "time_limit")
    assert (frame["task"], frame["hard"], frame["soft"]) == ("job", 2.0, 1.0)


async def test_task_events_are_switched_and_a_repeat_says_so(pool: Any) -> None:
    events = SimpleNamespace(task_events=False)
    commands = commands_of(events=events, pool=pool)
    assert await commands.enable_events() == {"ok": "task events enabled"}
    assert events.task_events is True
    assert await commands.enable_events() == {"ok": "task events already enabled"}
    assert await commands.disable_events() == {"ok": "task events disabled"}
    assert events.task_events is False
    assert await commands.disable_events() == {"ok": "task events already disabled"}
    assert (await told(pool, "events"))["on"] is False  # the children send their own events


async def test_pool_size_commands_are_refused_under_autoscale_and_autoscale_without_it() -> None:
    adjust = "is not supported with autoscale. Adjust autoscale range instead."
    autoscaled = commands_of(autoscaler=object())
    assert await autoscaled.pool_grow(1) == {"error": f"pool_grow {adjust}"}
    assert await autoscaled.pool_shrink(1) == {"error": f"pool_shrink {adjust}"}
    fixed = commands_of(sizer=SimpleNamespace(size=1))
    assert await fixed.pool_shrink(1) == {"error": 'ValueError("Can\'t shrink the pool below one process")'}
    assert await fixed.pool_grow(-1) == {"error": "ValueError('n must not be negative, got -1')"}
    assert await fixed.autoscale(max=4, min=1) == {"error": "ValueError('Autoscale not enabled')"}


async def test_shutdown_requests_a_graceful_stop() -> None:
    stopped: list[bool] = []
    await commands_of(request_stop=lambda: stopped.append(True)).shutdown(msg=None)
    assert stopped == [True]
