"""The process pool's supervision of its children, with real child processes: start, replace, resize, stop.

What the children run is tested with a worker (test_children_*.py); here the pool is never told
to let them consume, so each child loads the app, reports ready and waits, and nothing needs a
broker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc.settings import Settings
from tests.support.waiting import async_wait_for, wait_for
from worker.child.spec import FeedSpec
from worker.pool.pool import PoolClosedError, ProcessPool

pytestmark = pytest.mark.timeout(60)

APP_SPEC = "tests.integration.pool_tasks:app"
TASKS = "tests.integration.pool_tasks"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Never connected to: the pool is not told to let its children consume.
SPEC = FeedSpec(settings=Settings(), queues=("pooltests",), prefetch=1, hostname="pooltests@test")


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
async def pool() -> AsyncIterator[ProcessPool]:
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=2, feed=SPEC, exit_grace_s=2.0)
    await asyncio.wait_for(pool.start(), 30)
    yield pool
    await asyncio.wait_for(pool.close(), 30)


async def test_a_child_killed_is_replaced_in_its_slot(pool: ProcessPool) -> None:
    first = pool.pids()
    assert len(first) == 2 and all(alive(pid) for pid in first)
    victim = first[0]
    os.kill(victim, signal.SIGKILL)
    await until(
        lambda: victim not in pool.pids() and pool.size == 2, "the dead child is replaced: 2 children again"
    )
    assert not alive(victim) and first[1] in pool.pids()


async def test_children_ignore_sigint(pool: ProcessPool) -> None:
    # Ctrl-C reaches the whole process group: the worker alone decides when its children stop.
    for pid in pool.pids():
        ignored = int(_status(pid)["SigIgn"], 16)
        assert ignored & (1 << (signal.SIGINT - 1)), f"child {pid} does not ignore SIGINT"
        os.kill(pid, signal.SIGINT)
    assert all(alive(pid) for pid in pool.pids()) and pool.size == 2


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


async def test_grow_and_shrink_change_the_children_and_keep_at_least_one(pool: ProcessPool) -> None:
    pool.grow(2)
    await until(lambda: pool.size == 4, "the pool grew to 4 children")
    assert pool.target == 4
    before = set(pool.pids())
    assert pool.shrink(2) == 2 and pool.target == 2
    await until(lambda: pool.size == 2, "two children retired")
    await until(lambda: sum(alive(pid) for pid in before) == 2, "the retired children exited")
    assert set(pool.pids()) <= before  # retired, not replaced
    assert pool.shrink(5) == 1 and pool.target == 1  # never below one
    with pytest.raises(ValueError, match="must not be negative"):
        pool.shrink(-1)
    with pytest.raises(ValueError, match="must not be negative"):
        pool.grow(-1)


async def test_close_stops_every_child_and_refuses_a_resize_after() -> None:
    pool = ProcessPool(app_spec=APP_SPEC, concurrency=2, feed=SPEC, exit_grace_s=2.0)
    await asyncio.wait_for(pool.start(), 30)
    pool.grow(1)
    await until(lambda: pool.size == 3, "the pool grew to 3 children")
    pids = pool.pids()
    await asyncio.wait_for(pool.close(), 30)
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(PoolClosedError):
        pool.grow(1)
    await asyncio.wait_for(pool.close(), 10)  # closing twice is fine


async def test_start_reports_an_app_that_cannot_be_loaded() -> None:
    with pytest.raises(ImportError, match="no module named 'tests.integration.nope'"):
        await ProcessPool(app_spec="tests.integration.nope:app", concurrency=1, feed=SPEC).start()
    with pytest.raises(ImportError, match=f"App objects in it: {APP_SPEC}"):
        await ProcessPool(app_spec=f"{TASKS}:missing", concurrency=1, feed=SPEC).start()
    with pytest.raises(ValueError, match="not a broker_svc.App"):
        await ProcessPool(app_spec=f"{TASKS}:add", concurrency=1, feed=SPEC).start()
    with pytest.raises(ValueError, match="bad app spec"):
        ProcessPool(app_spec=f"{TASKS}:", concurrency=1, feed=SPEC)
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        ProcessPool(app_spec=APP_SPEC, concurrency=0, feed=SPEC)


_ORPHAN_SCRIPT = f"""
import asyncio, multiprocessing
from broker_svc.settings import Settings
from worker.child.spec import FeedSpec
from worker.pool.pool import ProcessPool

async def main():
    spec = FeedSpec(settings=Settings(), queues=("pooltests",), prefetch=1, hostname="orphan@test")
    pool = ProcessPool(app_spec={APP_SPEC!r}, concurrency=2, feed=spec)
    await pool.start()
    print("PIDS", *[p.pid for p in multiprocessing.active_children()], flush=True)
    await asyncio.sleep(60)

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
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s=10, message="the children exited")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        if worker.stdout is not None:
            worker.stdout.close()
