"""``TaskLoop``: one loop per thread, kept; the soft limit as a cancellation the body sees as
``SoftTimeLimitExceeded`` at its await, through the real signal and timer-thread mechanisms."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc.errors import SoftTimeLimitExceeded, TaskRevokedError
from worker.child.soft_limits import SoftLimit, ThreadSoftLimits
from worker.child.task_loop import TaskLoop


@pytest.fixture
def task_loop() -> Iterator[TaskLoop]:
    loop = TaskLoop()
    yield loop
    loop.close()


@pytest.fixture
def alarm_limit() -> Iterator[SoftLimit]:
    # As a single-threaded consuming child: the soft limit is a SIGALRM to this (the main) thread.
    limit = SoftLimit()
    previous = signal.signal(signal.SIGALRM, limit.on_signal)
    yield limit
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def _limited(limit: SoftLimit, limit_s: float, task_loop: TaskLoop, body: Any) -> Any:
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with limit.guarding(limit_s):
            return task_loop.run(body, limit)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


async def _loop_id() -> int:
    await asyncio.sleep(0)
    return id(asyncio.get_running_loop())


def test_the_loop_is_made_once_and_kept(task_loop: TaskLoop):
    limit = SoftLimit()
    assert not task_loop.started
    first = task_loop.run(_loop_id(), limit)
    assert task_loop.started
    assert task_loop.run(_loop_id(), limit) == first


def test_a_task_left_running_goes_on_and_is_cancelled_at_close():
    task_loop, limit, seen = TaskLoop(), SoftLimit(), []

    async def background() -> None:
        try:
            while True:
                await asyncio.sleep(0.001)
                seen.append("tick")
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def spawn() -> None:
        spawn.task = asyncio.get_running_loop().create_task(background())  # type: ignore[attr-defined]

    task_loop.run(spawn(), limit)
    task_loop.run(asyncio.sleep(0.02), limit)  # the next task's run drives it too
    assert "tick" in seen
    task_loop.close()
    assert seen[-1] == "cancelled"


def test_the_soft_limit_is_raised_at_the_await_and_finally_runs(task_loop: TaskLoop, alarm_limit: SoftLimit):
    ran: list[str] = []

    async def body() -> str:
        try:
            try:
                await asyncio.sleep(5)
            finally:
                ran.append("finally")
        except SoftTimeLimitExceeded as exc:
            await asyncio.sleep(0)  # the body may go on awaiting after it
            return str(exc)
        return "not interrupted"

    assert _limited(alarm_limit, 0.05, task_loop, body()) == "soft time limit (0.05 s) exceeded"
    assert ran == ["finally"]
    assert task_loop.run(_loop_id(), alarm_limit)  # the loop is fine afterwards


def test_an_uncaught_soft_limit_ends_the_run_with_it(task_loop: TaskLoop, alarm_limit: SoftLimit):
    with pytest.raises(SoftTimeLimitExceeded, match=r"soft time limit \(0.05 s\) exceeded"):
        _limited(alarm_limit, 0.05, task_loop, asyncio.sleep(5))


def test_asyncio_timeout_in_the_body_still_counts_after_a_soft_limit(
    task_loop: TaskLoop, alarm_limit: SoftLimit
):
    async def body() -> str:
        try:
            await asyncio.sleep(5)
        except SoftTimeLimitExceeded:
            pass
        try:
            async with asyncio.timeout(0.01):  # the limit's cancel was consumed: this one is its own
                await asyncio.sleep(5)
        except TimeoutError:
            return "timed out"
        return "not timed out"

    assert _limited(alarm_limit, 0.05, task_loop, body()) == "timed out"


def test_a_limit_that_reaches_the_loop_after_the_body_ended_is_ignored(task_loop: TaskLoop):
    limit = SoftLimit()

    async def body() -> str:
        await asyncio.sleep(0)
        # The deadline passes in the body's last step: the cancel is scheduled, but the body
        # ends before the loop runs it.
        limit.on_signal(signal.SIGALRM, None)
        return "ended"

    with limit.guarding(10):
        assert task_loop.run(body(), limit) == "ended"
    assert task_loop.run(asyncio.sleep(0.01, "next"), limit) == "next"  # nothing left for the next


def test_a_cancelled_body_is_a_failure_not_a_base_exception(task_loop: TaskLoop):
    async def body() -> None:
        raise asyncio.CancelledError("by itself")

    with pytest.raises(RuntimeError, match="cancelled"):
        task_loop.run(body(), SoftLimit())


def test_the_timer_thread_cancels_a_coroutine_in_a_thread():
    # --threads: the deadline is kept by ThreadSoftLimits' timer thread, which must not raise an
    # async exception into the thread (it would land in the loop), but cancel the coroutine.
    limits, out = ThreadSoftLimits(), {}

    def consumer() -> None:
        task_loop, limit = TaskLoop(), limits.for_thread()

        async def body() -> str:
            try:
                await asyncio.sleep(5)
            except SoftTimeLimitExceeded as exc:
                return f"caught: {exc}"
            return "not interrupted"

        try:
            with limit.guarding(0.05):
                out["caught"] = task_loop.run(body(), limit)
            with limit.guarding(0.5):  # within its limit: nothing reaches it, or the next
                out["quick"] = task_loop.run(_loop_id(), limit)
            out["after"] = task_loop.run(asyncio.sleep(0.6, "after"), limit)
        finally:
            task_loop.close()

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(10)
    assert out == {
        "caught": "caught: soft time limit (0.05 s) exceeded",
        "quick": out["quick"],
        "after": "after",
    }


def test_cancel_ends_only_the_run_of_that_id_as_terminated(task_loop: TaskLoop):
    # --threads' terminate: the child's control thread cancels the body of one task id.
    limit, ran = SoftLimit(), []

    async def body() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(threading.Thread(target=task_loop.cancel, args=("other",)).start)
        loop.call_later(0.05, threading.Thread(target=task_loop.cancel, args=("mine",)).start)
        try:
            await asyncio.sleep(5)
        finally:
            ran.append("finally")

    with pytest.raises(TaskRevokedError, match="terminated"):
        task_loop.run(body(), limit, task_id="mine")
    assert ran == ["finally"]
    task_loop.cancel("mine")  # too late: never reaches the next run
    assert task_loop.run(asyncio.sleep(0.01, "next"), limit, task_id="next") == "next"
