"""Children replaced after a number of tasks or past a memory limit (Celery's max-*-per-child)."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from tests.integration.test_pool import alive, make_job, run, until
from worker.pool.pool import JobStatus, ProcessPool

pytestmark = pytest.mark.timeout(90)

APP_SPEC = "tests.integration.pool_tasks:app"


async def test_a_child_is_replaced_after_max_tasks_per_child_and_no_task_is_lost() -> None:
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=1, max_tasks_per_child=2)
    await asyncio.wait_for(pool.start(), 30)
    try:
        with capture_logs() as logs:
            outcomes = [await run(pool, make_job("pid")) for _ in range(5)]
        assert all(o.status == JobStatus.SUCCESS for o in outcomes)
        pids = [o.value for o in outcomes]
        # Two tasks per child, then a fresh one: a, a, b, b, c.
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert len(set(pids)) == 3
        await until(lambda: not alive(pids[0]), "the first child did not exit")
        events = [e["event"] for e in logs]
        assert events.count("pool_child_recycled") == 2
        assert "pool_child_died_idle" not in events
        assert pool.size == 1
    finally:
        await asyncio.wait_for(pool.close(timeout_s=0), 30)


async def test_a_child_past_max_memory_is_replaced_after_its_task() -> None:
    probe = ProcessPool(app_spec=APP_SPEC, concurrency=1)
    await asyncio.wait_for(probe.start(), 30)
    try:
        [child] = probe._children.values()
        baseline_kib = child.resident_kib()
    finally:
        await asyncio.wait_for(probe.close(timeout_s=0), 30)
    assert baseline_kib is not None and baseline_kib > 0
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=1, max_memory_per_child_kib=baseline_kib + 64 * 1024)
    await asyncio.wait_for(pool.start(), 30)
    try:
        small = [await run(pool, make_job("grow_memory", 1)) for _ in range(3)]
        assert len({o.value for o in small}) == 1  # under the limit: the same child throughout
        big = await run(pool, make_job("grow_memory", 128))
        assert big.status == JobStatus.SUCCESS and big.value == small[0].value  # the task completed
        after = await run(pool, make_job("pid"))
        assert after.value != big.value
    finally:
        await asyncio.wait_for(pool.close(timeout_s=0), 30)


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="max_tasks_per_child"):
        ProcessPool(app_spec=APP_SPEC, concurrency=1, max_tasks_per_child=0)
