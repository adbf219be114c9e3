"""depends_on: a task released by the worker that sees its dependencies finish, after its sender left."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings, TaskError
from tests.integration import e2e_tasks
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

STATES_ON = {"CLOCKWORK_TASK_STATES": "1"}


@pytest.fixture
def observer(test_vhost_url: str) -> Iterator[App]:
    app = App("watcher", settings=Settings(broker_url=test_vhost_url, task_states=True))
    assert app.jobs.status("no-such-task") == "UNKNOWN"  # declares the stream (docs/design.md)
    yield app
    app.close(timeout=10)


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_dependent_runs_once_after_its_dependencies_across_a_killed_worker_and_a_gone_sender(
    test_vhost_url: str, queue: str, observer: App, tmp_path: Path
):
    ran = tmp_path / "ran.txt"
    first = WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON)
    with first:
        first.wait_ready()
        sender = App("sender", settings=Settings(broker_url=test_vhost_url, task_states=True))
        slow = sender.enqueue(e2e_tasks.sleep_then_record, str(ran), "slow", 3.0, queue=queue)
        quick = sender.enqueue(e2e_tasks.record, str(ran), "quick", queue=queue)
        last = sender.enqueue(e2e_tasks.record, str(ran), "last", queue=queue, depends_on=[slow, quick])
        assert last.get_status() == "WAITING"
        sender.close(timeout=10)  # the sender is gone: nobody polls for it
        wait_for(lambda: observer.jobs.status(slow.id) == "STARTED", timeout_s=30, message="slow started")
        first.first("dependent_held")  # this worker is the active joiner, holding `last`
        first.signal_tree(signal.SIGKILL)  # mid-run of `slow`; `quick` still queued
        first.proc.wait(timeout=30)
    assert _lines(ran) == []
    assert observer.jobs.status(last.id) == "WAITING"
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as second:
        second.wait_ready()
        wait_for(lambda: observer.jobs.status(last.id) == "SUCCESS", timeout_s=60, message="dependent ran")
        second.first("dependent_released")  # logged once the release committed, maybe after the run
        assert second.count("dependent_released") == 1
    lines = _lines(ran)
    assert sorted(lines[:2]) == ["quick", "slow"] and lines[2:] == ["last"]  # once, and after both
    states = [(r.state, r.hostname) for r in observer.jobs.history(slow.id)]
    assert states[0][0] == "QUEUED" and ("STARTED", first.name) in states
    assert states[-1] == ("SUCCESS", second.name)  # the killed run, then the redelivered one
    assert [r.state for r in observer.jobs.history(last.id)] == ["WAITING", "QUEUED", "STARTED", "SUCCESS"]


def test_a_failed_dependency_drops_the_dependent_unless_failure_is_allowed(
    test_vhost_url: str, queue: str, observer: App, tmp_path: Path
):
    ran = tmp_path / "ran.txt"
    sender = App("sender", settings=Settings(broker_url=test_vhost_url, task_states=True))
    try:
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as worker:
            worker.wait_ready()
            failing = sender.enqueue(e2e_tasks.boom, "no", queue=queue)
            strict = sender.enqueue(e2e_tasks.record, str(ran), "strict", queue=queue, depends_on=[failing])
            lenient = sender.enqueue(
                e2e_tasks.record, str(ran), "lenient", queue=queue, depends_on=failing, allow_failure=True
            )
            assert lenient.get(timeout=30) == "lenient"
            with pytest.raises(TaskError, match=f"dependency {failing.id} ended FAILURE"):
                strict.get(timeout=30)
            wait_for(lambda: strict.get_status() == "REVOKED", timeout_s=30, message="strict dropped")
    finally:
        sender.close(timeout=10)
    assert _lines(ran) == ["lenient"]
