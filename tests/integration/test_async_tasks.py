"""``async def`` tasks in the pool children: results, failures, one loop per child thread, time
limits, revoke and terminate, in both consuming designs and under ``--threads``.

Before these, an async task's coroutine was never awaited: its result failed to encode.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings, State, TaskError, TaskRevokedError
from tests.support.amqp import delete_queues
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

TASKS = "tests.integration.async_tasks"


# What asyncio writes when a loop is misused: none of it may appear in a worker's log.
_LOOP_COMPLAINTS = (
    "was never awaited", "Task was destroyed but it is pending", "Exception in callback",
    "Event loop is closed", "task_loop_close_failed", "soft_time_limit_interrupt_failed",
)  # fmt: skip


def _assert_clean(worker: WorkerProcess) -> None:
    text = worker.log_text()
    assert not [c for c in _LOOP_COMPLAINTS if c in text], text[-4000:]


def _worker(url: str, queue: str, *extra: str) -> WorkerProcess:
    return WorkerProcess(
        url, app=f"{TASKS}:app", queues=[queue], concurrency=1, extra_args=["--without-mingle", *extra]
    )


@pytest.fixture(scope="module")
def async_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("async")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.fixture(scope="module")
def async_worker(test_vhost_url: str, async_queue: str) -> Iterator[WorkerProcess]:
    with _worker(test_vhost_url, async_queue) as proc:
        yield proc.wait_ready()
        _assert_clean(proc)


@pytest.fixture
def app(test_vhost_url: str) -> Iterator[App]:
    client = App("async-client", settings=Settings(broker_url=test_vhost_url))
    yield client
    client.close(timeout=10)


def _send(app: App, queue: str, name: str, *args: Any, **options: Any) -> Any:
    return app.send_task(f"{TASKS}.{name}", args, queue=queue, **options)


def _active(url: str, worker: WorkerProcess) -> list[dict]:
    replies = call(url, "active", destination=[worker.name], expect=1)
    return list(replies[0][1][worker.name]) if replies else []


def _running(url: str, worker: WorkerProcess, task_id: str) -> None:
    wait_for(
        lambda: any(t["id"] == task_id for t in _active(url, worker)),
        timeout_s=20, message=f"task {task_id} running",
    )  # fmt: skip


def test_an_async_task_returns_its_value(async_queue: str, async_worker: WorkerProcess, app: App):
    assert _send(app, async_queue, "double", 21).get(timeout=30) == 42


def test_an_async_task_that_raises_fails_with_its_traceback(
    async_queue: str, async_worker: WorkerProcess, app: App
):
    result = _send(app, async_queue, "fails", "boom")
    with pytest.raises(TaskError) as info:
        result.get(timeout=30)
    assert info.value.exc_type == "ValueError"
    assert "boom" in str(info.value)
    assert result.state == State.FAILURE
    assert result.traceback is not None
    assert "in fails" in result.traceback and "ValueError: boom" in result.traceback


def test_a_child_runs_every_async_task_on_one_loop(async_queue: str, async_worker: WorkerProcess, app: App):
    # The second task awaits an asyncio.Event the first one made and cached: it works only on the
    # loop the first ran on.
    first = _send(app, async_queue, "loop_id").get(timeout=30)
    second = _send(app, async_queue, "loop_id").get(timeout=30)
    assert first[0] == second[0]  # one child (-c 1, nothing replaced it)
    assert first[1] == second[1]


def test_retry_and_autoretry_in_bound_async_tasks(async_queue: str, async_worker: WorkerProcess, app: App):
    retried = _send(app, async_queue, "retried")
    assert retried.get(timeout=30) == [retried.id, 2]
    assert _send(app, async_queue, "autoretried").get(timeout=30) == 1


def test_hooks_and_signals_see_the_awaited_outcome(
    async_queue: str, async_worker: WorkerProcess, app: App, tmp_path: Path
):
    ok, failed = tmp_path / "ok.jsonl", tmp_path / "failed.jsonl"
    assert _send(app, async_queue, "hooked", str(ok), False).get(timeout=30) == "hooked ok"
    with pytest.raises(TaskError):
        _send(app, async_queue, "hooked", str(failed), True).get(timeout=30)
    assert ok.read_text().splitlines() == [
        '{"signal": "task_prerun"}',
        '{"hook": "on_success", "retval": "hooked ok"}',
        '{"signal": "task_postrun", "state": "SUCCESS"}',
    ]
    assert failed.read_text().splitlines() == [
        '{"signal": "task_prerun"}',
        '{"hook": "on_failure", "exc": "KeyError"}',
        '{"signal": "task_postrun", "state": "FAILURE"}',
    ]


def test_an_async_new_style_errback_is_awaited_in_the_child(
    async_queue: str, async_worker: WorkerProcess, app: App, tmp_path: Path
):
    notes = tmp_path / "errback.jsonl"
    errback = app.signature(f"{TASKS}.async_on_error", (str(notes),))
    failed = _send(app, async_queue, "fails", "for the errback", link_error=errback)
    with pytest.raises(TaskError):
        failed.get(timeout=30)
    wait_for(notes.exists, timeout_s=10, message="the errback ran")
    assert notes.read_text().splitlines() == [f'{{"errback": "{failed.id}", "exc": "ValueError"}}']


def test_a_plain_task_that_returns_a_coroutine_fails_clearly(
    async_queue: str, async_worker: WorkerProcess, app: App
):
    with pytest.raises(TaskError) as info:
        _send(app, async_queue, "forgot_async").get(timeout=30)
    assert info.value.exc_type == "TypeError"
    assert "not `async def`" in str(info.value)


def _soft_limits(app: App, queue: str, tmp_path: Path) -> None:
    marker = tmp_path / f"finally-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    assert _send(app, queue, "soft_caught", str(marker)).get(timeout=30) == (
        "caught: soft time limit (0.3 s) exceeded"
    )
    assert marker.read_text() == "finally ran"
    with pytest.raises(TaskError) as info:
        _send(app, queue, "soft_uncaught").get(timeout=30)
    assert info.value.exc_type == "SoftTimeLimitExceeded"
    assert "soft time limit (0.3 s) exceeded" in str(info.value)
    assert time.monotonic() - started < 4  # not the 5 s each body would sleep
    # The loop survived both: later tasks (several, within their own limits) still run on it.
    assert [_send(app, queue, "double", i).get(timeout=30) for i in range(5)] == [0, 2, 4, 6, 8]


def test_the_soft_limit_reaches_the_coroutine_at_its_await(
    async_queue: str, async_worker: WorkerProcess, app: App, tmp_path: Path
):
    _soft_limits(app, async_queue, tmp_path)


def test_a_hard_limit_ends_the_child_and_the_next_task_runs(
    async_queue: str, async_worker: WorkerProcess, app: App
):
    before, _ = _send(app, async_queue, "loop_id").get(timeout=30)
    with pytest.raises(TaskError) as info:
        _send(app, async_queue, "hard_limited").get(timeout=30)
    assert info.value.exc_type == "TimeLimitExceeded"
    after, _ = _send(app, async_queue, "loop_id").get(timeout=30)
    assert after != before  # a new child, with a new loop


def test_a_revoked_async_task_never_starts(
    test_vhost_url: str, async_queue: str, async_worker: WorkerProcess, app: App, tmp_path: Path
):
    record = tmp_path / "revoked.jsonl"
    blocker = _send(app, async_queue, "sleeps", 1.5)
    _running(test_vhost_url, async_worker, blocker.id)
    revoked = _send(app, async_queue, "hooked", str(record), False)
    app.flush()
    replies = call(test_vhost_url, "revoke", arguments={"task_id": revoked.id}, expect=1)
    assert replies[0][1][async_worker.name]["ok"].endswith("flagged as revoked")
    assert blocker.get(timeout=30) == "slept"
    with pytest.raises(TaskRevokedError):
        revoked.get(timeout=30)
    assert not record.exists()  # not even task_prerun


def test_terminate_ends_a_running_async_task(
    test_vhost_url: str, async_queue: str, async_worker: WorkerProcess, app: App
):
    long = _send(app, async_queue, "sleeps", 60)
    _running(test_vhost_url, async_worker, long.id)
    replies = call(test_vhost_url, "revoke", arguments={"task_id": long.id, "terminate": True}, expect=1)
    assert replies[0][1] == {async_worker.name: {"ok": f"terminate: {long.id}"}}
    with pytest.raises(TaskRevokedError, match="terminated"):
        long.get(timeout=30)
    assert _send(app, async_queue, "double", 4).get(timeout=30) == 8  # the replaced child runs


@pytest.fixture(scope="module")
def threads_worker(test_vhost_url: str) -> Iterator[tuple[str, WorkerProcess]]:
    queue = unique_queue("async-threads")
    with _worker(test_vhost_url, queue, "--threads", "2") as proc:
        yield queue, proc.wait_ready()
        _assert_clean(proc)
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_threads_run_async_tasks_at_once_each_on_its_own_loop(
    threads_worker: tuple[str, WorkerProcess], app: App, tmp_path: Path
):
    queue, _ = threads_worker
    started = time.monotonic()
    results = [_send(app, queue, "where", 1.0) for _ in range(2)]
    ran = [r.get(timeout=30) for r in results]
    assert time.monotonic() - started < 1.9  # one after the other would take 2 s
    assert len({pid for pid, _, _ in ran}) == 1  # one child
    assert len({thread for _, thread, _ in ran}) == 2
    assert len({loop for _, _, loop in ran}) == 2  # a loop per thread
    # The soft limit reaches a coroutine in a thread too (the timer thread cancels it).
    _soft_limits(app, queue, tmp_path)


def test_terminate_under_threads_cancels_the_coroutine_and_spares_the_child(
    test_vhost_url: str, threads_worker: tuple[str, WorkerProcess], app: App
):
    queue, worker = threads_worker
    long = _send(app, queue, "sleeps", 60)
    neighbour = _send(app, queue, "where", 1.5)
    _running(test_vhost_url, worker, long.id)
    _running(test_vhost_url, worker, neighbour.id)
    [pid] = {t["worker_pid"] for t in _active(test_vhost_url, worker)}
    replies = call(
        test_vhost_url, "revoke", arguments={"task_id": long.id, "terminate": True},
        destination=[worker.name], expect=1,
    )  # fmt: skip
    assert replies[0][1] == {worker.name: {"ok": f"terminate: {long.id}"}}
    with pytest.raises(TaskRevokedError, match="terminated"):
        long.get(timeout=30)
    assert long.state == State.REVOKED
    assert neighbour.get(timeout=30)[0] == pid  # its thread's task went on, in the same child
    assert worker.count("feed_task_cancel_sent") == 1  # once, though the revoke log echoes the request
    assert worker.count("feed_child_signalled") == 0


def test_terminate_under_threads_ends_the_child_of_a_coroutine_that_ignores_the_cancel(
    test_vhost_url: str, threads_worker: tuple[str, WorkerProcess], app: App
):
    queue, worker = threads_worker
    stubborn = _send(app, queue, "stubborn", 60)
    _running(test_vhost_url, worker, stubborn.id)
    call(
        test_vhost_url, "revoke", arguments={"task_id": stubborn.id, "terminate": True},
        destination=[worker.name], expect=1,
    )  # fmt: skip
    with pytest.raises(TaskRevokedError, match="terminated"):
        stubborn.get(timeout=30)  # after CANCEL_GRACE_S, by the signal, as for a plain task
    assert worker.count("feed_task_cancel_ignored") >= 1
    assert _send(app, queue, "double", 5).get(timeout=30) == 10  # the replaced child runs
