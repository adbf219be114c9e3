"""The worker's connect loop stops its attempt with the caller: a cancelled wait leaves nothing running."""

from __future__ import annotations

import asyncio

import pytest

from worker.amqp.connection import _Stopped, _until_stopped


async def test_a_cancelled_caller_cancels_the_attempt_it_was_waiting_for():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def attempt() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # a connect that hangs
        except asyncio.CancelledError:
            cancelled.set()
            raise

    caller = asyncio.create_task(_until_stopped(attempt(), asyncio.Event()))
    await asyncio.wait_for(started.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(cancelled.wait(), 5)


async def test_a_stop_cancels_the_attempt_and_says_so():
    stop, cancelled = asyncio.Event(), asyncio.Event()

    async def attempt() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    caller = asyncio.create_task(_until_stopped(attempt(), stop))
    await asyncio.sleep(0)  # let the attempt start
    stop.set()
    with pytest.raises(_Stopped):
        await asyncio.wait_for(caller, 5)
    assert cancelled.is_set()


async def test_an_attempt_that_finishes_first_gives_its_result_or_error():
    async def failing() -> None:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        await asyncio.wait_for(_until_stopped(failing(), asyncio.Event()), 5)
