"""The worker's background work: one owner that cancels it all on exit, where a failure stays local."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from worker.background import Background


async def _forever(ended: list[str], name: str) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        ended.append(name)


async def test_leaving_cancels_and_awaits_every_piece_of_work() -> None:
    ended: list[str] = []
    async with Background() as background:
        background.spawn(_forever(ended, "a"), name="a")
        background.spawn(_forever(ended, "b"), name="b")
        await asyncio.sleep(0)  # let both start
    assert sorted(ended) == ["a", "b"]


async def test_stop_ends_only_the_named_work_and_waits_for_it() -> None:
    ended: list[str] = []
    async with Background() as background:
        background.spawn(_forever(ended, "heartbeat"), name="heartbeat")
        background.spawn(_forever(ended, "watch"), name="watch")
        await asyncio.sleep(0)
        await background.stop("heartbeat")
        assert ended == ["heartbeat"]
        await background.stop("nothing-by-that-name")
    assert ended == ["heartbeat", "watch"]


async def test_a_failure_is_logged_and_leaves_the_rest_running() -> None:
    ended: list[str] = []

    async def fail() -> None:
        raise RuntimeError("mingle failed")

    with capture_logs() as logs:
        async with Background() as background:
            background.spawn(_forever(ended, "watch"), name="watch")
            background.spawn(fail(), name="mingle")
            await asyncio.sleep(0)  # one step each: the failure is raised and logged within it
            assert [entry["event"] for entry in logs] == ["background_step_failed"]
            assert ended == []
    assert logs[0]["event"] == "background_step_failed"
    assert logs[0]["task"] == "mingle"
    assert ended == ["watch"]


async def test_an_error_in_the_owners_body_propagates_as_it_is() -> None:
    ended: list[str] = []
    with pytest.raises(ValueError, match="start failed"):
        async with Background() as background:
            background.spawn(_forever(ended, "a"), name="a")
            await asyncio.sleep(0)
            raise ValueError("start failed")
    assert ended == ["a"]


async def test_work_spawned_after_exit_is_dropped_without_running() -> None:
    ran: list[bool] = []

    async def step() -> None:
        ran.append(True)

    async with Background() as background:
        pass
    background.spawn(step(), name="worker-online")
    await asyncio.sleep(0)
    assert ran == []
