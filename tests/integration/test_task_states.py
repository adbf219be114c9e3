"""The task-state stream: QUEUED from the client, STARTED and outcomes from workers, read anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from broker_svc import App, Settings
from tests.support.cli import run_ctl
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess

ADD = "tests.integration.e2e_tasks.add"
BOOM = "tests.integration.e2e_tasks.boom"
SLEEP = "tests.integration.e2e_tasks.sleep_s"
STATES_ON = {"CLOCKWORK_TASK_STATES": "1"}

# Another process: what it reads of tasks it did not send (history, and result.status).
_OBSERVER = """
import json, sys
from broker_svc import App, Settings
app = App("observer", settings=Settings(broker_url=sys.argv[1], task_states=True))
out = {}
for task_id in sys.argv[2:]:
    out[task_id] = {
        "history": [r.state for r in app.jobs.history(task_id)],
        "status": app.AsyncResult(task_id).status,
    }
print(json.dumps(out))
app.close()
"""


def _observe(url: str, *task_ids: str) -> dict[str, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", _OBSERVER, url, *task_ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def sender(test_vhost_url: str) -> Iterator[App]:
    app = App("sender", settings=Settings(broker_url=test_vhost_url, task_states=True))
    yield app
    app.close(timeout=10)


@pytest.fixture
def observer(test_vhost_url: str) -> Iterator[App]:
    app = App("watcher", settings=Settings(broker_url=test_vhost_url, task_states=True))
    # Its reader declares the stream and reads up to now: RabbitMQ 3.10 may drop a record written
    # in a stream's first moments (docs/design.md, "Task states"), which no test is about.
    assert app.jobs.status("no-such-task") == "UNKNOWN"
    yield app
    app.close(timeout=10)


def test_another_process_reads_queued_started_and_success_of_tasks_it_did_not_send(
    test_vhost_url: str, queue: str, sender: App, observer: App
):
    never_sent = str(uuid.uuid4())
    assert observer.jobs.status(never_sent) == "UNKNOWN"
    assert observer.AsyncResult(never_sent).status == "UNKNOWN"  # not PENDING: nobody ever sent it
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as worker:
        worker.wait_ready()
        blocker = sender.send_task(SLEEP, args=(1.5,), queue=queue)
        added = sender.send_task(ADD, args=(1, 2), queue=queue)
        failed = sender.send_task(BOOM, args=("no",), queue=queue)
        sender.flush()
        wait_for(
            lambda: observer.jobs.status(blocker.id) == "STARTED", timeout_s=30, message="blocker started"
        )
        # The one child runs the blocker: the others wait in the queue, and the stream says so.
        assert observer.jobs.status(added.id) == "QUEUED"
        assert observer.AsyncResult(added.id).status == "QUEUED"
        assert added.get(timeout=30) == 3
        with pytest.raises(ValueError):
            failed.get(timeout=30)
        wait_for(
            lambda: observer.jobs.status(failed.id) == "FAILURE", timeout_s=30, message="failure recorded"
        )
    seen = _observe(test_vhost_url, added.id, failed.id, never_sent)
    assert seen[added.id] == {"history": ["QUEUED", "STARTED", "SUCCESS"], "status": "SUCCESS"}
    assert seen[failed.id] == {"history": ["QUEUED", "STARTED", "FAILURE"], "status": "FAILURE"}
    assert seen[never_sent] == {"history": [], "status": "UNKNOWN"}
    [failure] = [r for r in observer.jobs.history(failed.id) if r.state == "FAILURE"]
    assert failure.info["exc_type"] == "ValueError" and failure.hostname == worker.name
    [queued] = [r for r in observer.jobs.history(added.id) if r.state == "QUEUED"]
    assert queued.name == ADD and queued.queue == queue


def test_without_task_states_nothing_is_written_and_status_stays_pending(
    test_vhost_url: str, queue: str, client: App, observer: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        added = client.send_task(ADD, args=(1, 1), queue=queue)
        assert added.get(timeout=30) == 2
    assert observer.jobs.history(added.id) == []
    assert client.AsyncResult(str(uuid.uuid4())).status == "PENDING"


def test_ctl_task_prints_a_tasks_history_from_the_stream(
    test_vhost_url: str, queue: str, sender: App, observer: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, env=STATES_ON) as worker:
        worker.wait_ready()
        added = sender.send_task(ADD, args=(3, 4), queue=queue)
        assert added.get(timeout=30) == 7
        wait_for(lambda: observer.jobs.status(added.id) == "SUCCESS", timeout_s=30, message="succeeded")
    unknown = str(uuid.uuid4())
    proc, _ = run_ctl("task", added.id, unknown, "--json", "-b", test_vhost_url)
    assert proc.returncode == 1, proc.stderr  # one of them has no record
    assert unknown in proc.stderr
    shown = json.loads(proc.stdout)
    assert shown[unknown] == {"state": "UNKNOWN", "history": []}
    assert shown[added.id]["state"] == "SUCCESS"
    history = shown[added.id]["history"]
    assert [r["state"] for r in history] == ["QUEUED", "STARTED", "SUCCESS"]
    assert [r["hostname"] for r in history][1:] == [worker.name, worker.name]
    proc, _ = run_ctl("task", added.id, "-b", test_vhost_url)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{added.id}: SUCCESS"
    assert [line.split()[1] for line in lines[1:]] == ["QUEUED", "STARTED", "SUCCESS"]
