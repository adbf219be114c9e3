"""The process pool with real child processes: outcomes, fair dispatch, limits, deaths and shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import async_wait_for, wait_for
from worker.pool.child import send_update
from worker.pool.pool import Job, JobOutcome, JobStatus, PoolClosedError, ProcessPool

pytestmark = pytest.mark.timeout(60)

APP_SPEC = "tests.integration.pool_tasks:app"
TASKS = "tests.integration.pool_tasks"
REPO_ROOT = Path(__file__).resolve().parents[2]


def make_job(name: str, *args: Any, **limits: float) -> Job:
    return Job(
        task_id=str(uuid.uuid4()),
        task_name=f"{TASKS}.{name}",
        args=list(args),
        kwargs={},
        request={},
        **limits,
    )


async def run(pool: ProcessPool, job: Job, *, timeout_s: float = 20.0) -> JobOutcome:
    return await asyncio.wait_for(pool.run(job), timeout_s)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody has reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while we read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(predicate: Any, message: str, timeout_s: float = 10.0) -> None:
    async def check() -> bool:
        return bool(predicate())

    await async_wait_for(check, timeout_s=timeout_s, message=message)


@pytest.fixture
def updates() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture
async def pool(updates: list[tuple[str, dict[str, Any]]]) -> AsyncIterator[ProcessPool]:
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=2, on_update=lambda tid, p: updates.append((tid, p)))
    await asyncio.wait_for(pool.start(), 30)
    yield pool
    await asyncio.wait_for(pool.close(timeout_s=0), 30)


async def test_results_and_errors_come_back_as_celery_maps(pool: ProcessPool) -> None:
    ok = await run(pool, make_job("add", 2, 3))
    assert (ok.status, ok.value, ok.error) == (JobStatus.SUCCESS, 5, None)
    assert ok.pid > 0 and ok.runtime_s >= 0

    failed = await run(pool, make_job("boom"))
    assert failed.status == JobStatus.FAILURE
    assert failed.error == {"exc_type": "ValueError", "exc_message": ["boom"], "exc_module": "builtins"}
    assert failed.traceback is not None and 'raise ValueError("boom")' in failed.traceback

    unknown = await run(pool, make_job("no_such_task"))
    assert unknown.status == JobStatus.FAILURE
    assert unknown.error == {
        "exc_type": "NotRegistered",
        "exc_message": [f"{TASKS}.no_such_task"],
        "exc_module": "celery.exceptions",
    }


async def test_an_unencodable_return_value_is_a_failure_and_the_child_lives_on(pool: ProcessPool) -> None:
    outcome = await run(pool, make_job("returns_unencodable"))
    assert outcome.status == JobStatus.FAILURE and outcome.error is not None
    assert (outcome.error["exc_type"], outcome.error["exc_module"]) == ("EncodeError", "kombu.exceptions")
    assert "returns_unencodable" in outcome.error["exc_message"][0]
    assert alive(outcome.pid) and pool.size == 2
    pids = {(await run(pool, make_job("pid"))).value for _ in range(2)}
    assert outcome.pid in pids


async def test_short_tasks_never_wait_behind_a_long_one(pool: ProcessPool) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def timed(job: Job) -> tuple[JobOutcome, float]:
        outcome = await run(pool, job)
        return outcome, loop.time() - started

    long = asyncio.create_task(timed(make_job("sleep_s", 3.0)))
    shorts = [asyncio.create_task(timed(make_job("add", i, i))) for i in range(50)]
    short_results = await asyncio.gather(*shorts)
    long_outcome, long_done_s = await long

    assert [o.value for o, _ in short_results] == [2 * i for i in range(50)]
    assert long_outcome.status == JobStatus.SUCCESS and long_done_s >= 3.0
    last_short_s = max(t for _, t in short_results)
    # All 50 ran on the other child while the long one slept: done long before its 3 s.
    assert last_short_s < 1.5, f"short tasks took {last_short_s:.2f} s"
    assert {o.pid for o, _ in short_results} == {short_results[0][0].pid} != {long_outcome.pid}


async def test_the_hard_time_limit_kills_and_replaces_the_child(pool: ProcessPool) -> None:
    outcome = await run(pool, make_job("sleep_s", 30, hard_time_limit_s=0.5))
    assert outcome.status == JobStatus.TIME_LIMIT
    assert outcome.error == {
        "exc_type": "TimeLimitExceeded",
        "exc_message": [0.5],
        "exc_module": "celery.exceptions",
    }
    assert 0.5 <= outcome.runtime_s < 5
    assert not alive(outcome.pid)
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "the pool is back to 2 idle children")
    after = await run(pool, make_job("add", 1, 1))
    assert after.status == JobStatus.SUCCESS and after.value == 2


async def test_a_task_can_catch_its_soft_time_limit(pool: ProcessPool) -> None:
    outcome = await run(pool, make_job("soft_limited", 30, soft_time_limit_s=0.3))
    assert (outcome.status, outcome.value) == (JobStatus.SUCCESS, "caught")
    assert outcome.runtime_s < 5
    assert alive(outcome.pid)


async def test_an_uncaught_soft_time_limit_fails_the_task_with_celerys_error(pool: ProcessPool) -> None:
    outcome = await run(pool, make_job("sleep_s", 30, soft_time_limit_s=0.3, hard_time_limit_s=10))
    assert outcome.status == JobStatus.FAILURE and outcome.error is not None
    assert (outcome.error["exc_type"], outcome.error["exc_module"]) == (
        "SoftTimeLimitExceeded",
        "celery.exceptions",
    )
    assert alive(outcome.pid) and pool.size == 2


async def test_a_dying_child_gives_lost_and_the_pool_is_refilled(pool: ProcessPool) -> None:
    outcome = await run(pool, make_job("die"))
    assert outcome.status == JobStatus.LOST
    assert outcome.error == {
        "exc_type": "WorkerLostError",
        "exc_message": ["Worker exited prematurely: exitcode 3."],
        "exc_module": "billiard.exceptions",
    }
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "the pool is back to 2 idle children", 5)
    pids = {(await run(pool, make_job("pid"))).value for _ in range(2)}
    assert len(pids) == 2 and outcome.pid not in pids


async def test_a_child_killed_while_idle_is_replaced(pool: ProcessPool) -> None:
    victim = (await run(pool, make_job("pid"))).value
    assert victim in pool.pids()
    os.kill(victim, signal.SIGKILL)
    await until(
        lambda: victim not in pool.pids() and pool.size == 2 and pool.idle_count == 2,
        "the dead child is replaced and the pool is back to 2 idle children",
    )
    assert not alive(victim)
    pids = {(await run(pool, make_job("pid"))).value for _ in range(2)}
    assert len(pids) == 2 and victim not in pids


async def test_children_ignore_sigint(pool: ProcessPool) -> None:
    first = (await run(pool, make_job("pid"))).value
    os.kill(first, signal.SIGINT)
    pids = {(await run(pool, make_job("pid"))).value for _ in range(2)}
    assert first in pids and alive(first)


async def test_terminate_kills_the_running_task(pool: ProcessPool) -> None:
    job = make_job("sleep_s", 30)
    running = asyncio.create_task(run(pool, job))
    await until(lambda: job.task_id in pool.running(), "the job is running")
    pid = pool.running()[job.task_id]
    assert await pool.terminate(job.task_id) is True
    outcome = await running
    assert outcome.status == JobStatus.TERMINATED and outcome.pid == pid
    assert outcome.error == {
        "exc_type": "TaskRevokedError",
        "exc_message": ["terminated"],
        "exc_module": "celery.exceptions",
    }
    assert await pool.terminate("not-running-here") is False
    await until(lambda: pool.size == 2 and pool.idle_count == 2, "the pool is back to 2 idle children")


async def test_updates_reach_on_update_in_order(
    pool: ProcessPool, updates: list[tuple[str, dict[str, Any]]]
) -> None:
    job = make_job("progress")
    outcome = await run(pool, job)
    assert (outcome.status, outcome.value) == (JobStatus.SUCCESS, "finished")
    assert updates == [
        (job.task_id, {"state": "PROGRESS", "meta": {"done": 1}}),
        (job.task_id, {"state": "PROGRESS", "meta": {"done": 2}}),
    ]


async def test_a_task_sees_its_request_context(pool: ProcessPool) -> None:
    job = Job(
        task_id="t-1",
        task_name=f"{TASKS}.request_info",
        args=[],
        kwargs={},
        request={"retries": 2, "hostname": "w1"},
    )
    outcome = await run(pool, job)
    assert outcome.value == {"id": "t-1", "task": f"{TASKS}.request_info", "retries": 2, "hostname": "w1"}


def test_send_update_outside_a_task_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="only inside a task"):
        send_update({"state": "PROGRESS"})


async def test_a_cancelled_wait_for_a_child_leaks_nothing(pool: ProcessPool) -> None:
    busy = [asyncio.create_task(run(pool, make_job("sleep_s", 0.5))) for _ in range(2)]
    await until(lambda: pool.busy_count == 2, "both children are busy")
    waiting = asyncio.create_task(pool.run(make_job("add", 1, 2)))
    await until(lambda: pool.idle_count == 0 and not waiting.done(), "the third job waits")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.gather(*busy)
    await until(lambda: pool.idle_count == 2 and pool.busy_count == 0, "both children are idle again")


async def test_a_child_handed_to_a_cancelled_waiter_goes_back_to_the_pool(pool: ProcessPool) -> None:
    # Cancel the waiting caller in the very step its child is handed over, before it can resume.
    busy = [asyncio.create_task(run(pool, make_job("sleep_s", 0.3))) for _ in range(2)]
    await until(lambda: pool.busy_count == 2, "both children are busy")
    waiting = asyncio.create_task(pool.run(make_job("add", 1, 2)))
    await until(lambda: not waiting.done() and pool.idle_count == 0, "the third job waits")
    release = pool._release

    def release_then_cancel(child: Any) -> None:
        pool._release = release  # type: ignore[method-assign]
        release(child)
        waiting.cancel()

    pool._release = release_then_cancel  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.gather(*busy)
    await until(lambda: pool.idle_count == 2 and pool.busy_count == 0, "both children are idle again")
    assert (await run(pool, make_job("add", 2, 2))).value == 4


async def test_close_waits_for_a_running_job_that_fits_in_the_timeout(pool: ProcessPool) -> None:
    job = make_job("sleep_s", 1.0)
    running = asyncio.create_task(run(pool, job))
    await until(lambda: job.task_id in pool.running(), "the job is running")
    pids = [pool.running()[job.task_id]]
    await asyncio.wait_for(pool.close(timeout_s=10), 20)
    outcome = await running
    assert (outcome.status, outcome.value) == (JobStatus.SUCCESS, 1.0)
    assert pool.size == 0
    await until(lambda: not any(alive(p) for p in pids), "the children are gone")
    with pytest.raises(PoolClosedError):
        await pool.run(make_job("add", 1, 1))


async def test_close_kills_a_job_that_does_not_fit_and_reports_it_lost(pool: ProcessPool) -> None:
    job = make_job("sleep_s", 30)
    running = asyncio.create_task(run(pool, job))
    await until(lambda: job.task_id in pool.running(), "the job is running")
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(pool.close(timeout_s=0.3), 20)
    assert asyncio.get_running_loop().time() - started < 5
    outcome = await running
    assert outcome.status == JobStatus.LOST and outcome.error is not None
    assert outcome.error["exc_type"] == "WorkerLostError"
    assert not alive(outcome.pid)


async def test_start_reports_an_app_that_cannot_be_loaded() -> None:
    with pytest.raises(ImportError, match="no module named 'tests.integration.nope'"):
        await ProcessPool(app_spec="tests.integration.nope:app", concurrency=1).start()
    with pytest.raises(ImportError, match=f"App objects in it: {APP_SPEC}"):
        await ProcessPool(app_spec=f"{TASKS}:missing", concurrency=1).start()
    with pytest.raises(ValueError, match="not a broker_svc.App"):
        await ProcessPool(app_spec=f"{TASKS}:add", concurrency=1).start()
    with pytest.raises(ValueError, match="bad app spec"):
        ProcessPool(app_spec=f"{TASKS}:", concurrency=1)


_ORPHAN_SCRIPT = f"""
import asyncio, multiprocessing
from worker.pool.pool import Job, ProcessPool

async def main():
    sleeping = asyncio.Event()
    pool = ProcessPool(app_spec={APP_SPEC!r}, concurrency=2, on_update=lambda t, p: sleeping.set())
    await pool.start()
    name = {TASKS + ".report_then_sleep"!r}
    job = Job(task_id="long", task_name=name, args=[60], kwargs={{}}, request={{}})
    task = asyncio.create_task(pool.run(job))
    await asyncio.wait_for(sleeping.wait(), 20)
    print("PIDS", *[p.pid for p in multiprocessing.active_children()], flush=True)
    await task

asyncio.run(main())
"""


def test_children_exit_when_the_worker_is_killed() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        line = ""
        while not line.startswith("PIDS"):  # the test's timeout bounds this
            line = worker.stdout.readline()
            assert line, "the worker script ended before reporting its children"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 2 and all(alive(p) for p in pids)
        worker.kill()
        worker.wait(timeout=10)
        # One child is idle (its socket closes), the other is busy in a 60 s task (it notices
        # that its parent, the forkserver, is gone).
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s=10, message="the children exited")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        if worker.stdout is not None:
            worker.stdout.close()
