"""ProcessPool.grow/shrink with real children: idle children retire at once, busy ones after their job."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.integration.test_pool import alive, make_job, run, until
from worker.pool.pool import JobStatus, PoolClosedError, ProcessPool

pytestmark = pytest.mark.timeout(60)

APP_SPEC = "tests.integration.pool_tasks:app"


@pytest.fixture
async def pool() -> AsyncIterator[ProcessPool]:
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=1)
    await asyncio.wait_for(pool.start(), 30)
    yield pool
    await asyncio.wait_for(pool.close(timeout_s=0), 30)


async def test_grow_adds_children_that_take_jobs_side_by_side(pool: ProcessPool) -> None:
    pool.grow(2)
    assert pool.target == 3
    await until(lambda: pool.size == 3 and pool.idle_count == 3, "three idle children")
    outcomes = await asyncio.gather(*(run(pool, make_job("report_then_sleep", 0.5)) for _ in range(3)))
    assert all(o.status == JobStatus.SUCCESS for o in outcomes)
    assert len({o.pid for o in outcomes}) == 3  # side by side, one per child


async def test_shrink_retires_idle_children_at_once(pool: ProcessPool) -> None:
    pool.grow(2)
    await until(lambda: pool.size == 3 and pool.idle_count == 3, "three idle children")
    before = pool.pids()
    assert pool.shrink(2) == 2 and pool.target == 1
    assert pool.size == 1 and len(pool.pids()) == 1
    gone = set(before) - set(pool.pids())
    await until(lambda: not any(alive(p) for p in gone), "the retired children exited")
    assert (await run(pool, make_job("add", 1, 2))).value == 3


async def test_a_busy_child_finishes_its_task_before_it_retires(pool: ProcessPool) -> None:
    pool.grow(1)
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "two idle children")
    busy = [asyncio.create_task(run(pool, make_job("sleep_s", 0.6))) for _ in range(2)]
    await until(lambda: pool.busy_count == 2, "both children are busy")
    pids = set(pool.running().values())
    assert pool.shrink(1) == 1 and pool.target == 1
    assert pool.size == 2  # nobody is killed while running
    outcomes = await asyncio.gather(*busy)
    assert [(o.status, o.value) for o in outcomes] == [(JobStatus.SUCCESS, 0.6)] * 2
    await until(lambda: pool.size == 1, "one child retired after its task")
    [survivor] = pool.pids()
    assert survivor in pids
    await until(lambda: not alive(next(iter(pids - {survivor}))), "the retired child exited")


async def test_growing_while_a_child_waits_to_retire_keeps_it(pool: ProcessPool) -> None:
    pool.grow(1)
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "two idle children")
    busy = [asyncio.create_task(run(pool, make_job("sleep_s", 0.4))) for _ in range(2)]
    await until(lambda: pool.busy_count == 2, "both children are busy")
    pids = set(pool.running().values())
    pool.shrink(1)
    pool.grow(1)  # cancels the pending retirement: no child goes, none starts
    assert pool.target == 2
    await asyncio.gather(*busy)
    await until(lambda: pool.idle_count == 2, "both children idle again")
    assert set(pool.pids()) == pids


async def test_shrink_keeps_one_child_and_refuses_bad_arguments(pool: ProcessPool) -> None:
    assert pool.shrink(5) == 0 and pool.target == 1 and pool.size == 1
    with pytest.raises(ValueError, match="negative"):
        pool.grow(-1)
    with pytest.raises(ValueError, match="negative"):
        pool.shrink(-1)


async def test_a_child_that_dies_while_a_retirement_is_due_is_not_replaced(pool: ProcessPool) -> None:
    pool.grow(1)
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "two idle children")
    dying = [
        asyncio.create_task(run(pool, make_job("die"))),
        asyncio.create_task(run(pool, make_job("sleep_s", 1))),
    ]
    await until(lambda: pool.busy_count >= 1, "a child is busy")
    pool.shrink(1)
    outcomes = await asyncio.gather(*dying)
    assert sorted(o.status for o in outcomes) == sorted([JobStatus.LOST, JobStatus.SUCCESS])
    await until(lambda: pool.size == 1 and pool.idle_count == 1, "one child left, idle")
    assert (await run(pool, make_job("add", 2, 2))).value == 4


async def test_close_after_resizing_stops_every_child(pool: ProcessPool) -> None:
    pool.grow(3)
    await until(lambda: pool.size == 4, "four children")
    pool.shrink(2)
    pids = pool.pids()
    await asyncio.wait_for(pool.close(timeout_s=0), 20)
    assert pool.size == 0
    await until(lambda: not any(alive(p) for p in pids), "the children are gone")
    with pytest.raises(PoolClosedError):
        pool.grow(1)
    with pytest.raises(PoolClosedError):
        pool.shrink(1)
