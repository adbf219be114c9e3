"""Celery's signals, sent by a real worker and its pool children to receivers in the app module."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from broker_svc import App, Settings, TaskRevokedError
from broker_svc.signals import after_task_publish, before_task_publish
from tests.support.amqp import delete_queues
from tests.support.workers import WorkerProcess, unique_queue


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_worker_and_task_signals_reach_the_apps_receivers(test_vhost_url: str, tmp_path: Path):
    queue = unique_queue("signals")
    log = tmp_path / "signals.jsonl"
    client = App("signals-client", settings=Settings(broker_url=test_vhost_url))
    worker = WorkerProcess(
        test_vhost_url, app="tests.integration.signal_tasks:app", queues=[queue], concurrency=2,
        env={"SIGNAL_LOG": str(log)},
    )  # fmt: skip
    try:
        worker.wait_ready()
        ok = client.send_task("signals.double", (21,), queue=queue)
        assert ok.get(timeout=30) == 42
        failed = client.send_task("signals.fail", queue=queue)
        with pytest.raises(KeyError):
            failed.get(timeout=30)
        retried = client.send_task("signals.retry_once", queue=queue)
        assert retried.get(timeout=30) == "second time"
        assert client.send_task("signals.only_for_double", (7,), queue=queue).get(timeout=30) == 7
        expired = client.send_task("signals.double", (1,), queue=queue, expires=dt.datetime(2020, 1, 1))
        with pytest.raises(TaskRevokedError):
            expired.get(timeout=30)
        assert worker.terminate() == 0
    finally:
        worker.close()
        client.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")

    records = _records(log)
    names = [r["signal"] for r in records]
    assert names.count("worker_process_init") >= 2  # one per child
    assert names.count("worker_ready") == 1 and names.count("worker_shutdown") == 1
    ready_pid = next(r["pid"] for r in records if r["signal"] == "worker_ready")
    init_pids = {r["pid"] for r in records if r["signal"] == "worker_process_init"}
    assert ready_pid == worker.pid and ready_pid not in init_pids  # main process vs children

    def of(task_id: str) -> list[tuple[str, dict]]:
        return [(r["signal"], r) for r in records if r.get("task_id") == task_id]

    assert [s for s, _ in of(ok.id)] == ["task_received", "task_prerun", "task_postrun"]
    assert of(ok.id)[2][1]["state"] == "SUCCESS"
    assert {"signal": "task_success", "task": "signals.double", "result": 42}.items() <= next(
        r for r in records if r["signal"] == "task_success" and r["task"] == "signals.double"
    ).items()
    assert [s for s, _ in of(failed.id)] == ["task_received", "task_prerun", "task_failure", "task_postrun"]
    assert "KeyError" in of(failed.id)[2][1]["exception"]
    assert [s for s, _ in of(retried.id)] == [
        "task_received", "task_prerun", "task_retry", "task_postrun",
        "task_received", "task_prerun", "task_postrun",
    ]  # fmt: skip
    assert of(retried.id)[3][1]["state"] == "RETRY"
    assert {"signal": "task_received", "task_id": ok.id}.items() <= next(
        r for r in records if r["signal"] == "task_received" and r.get("task_id") == ok.id
    ).items()
    [revoked] = [r for r in records if r["signal"] == "task_revoked"]
    assert (revoked["task_id"], revoked["expired"], revoked["terminated"]) == (expired.id, True, False)
    # A receiver connected with sender= hears only that task.
    assert [r["result"] for r in records if r["signal"] == "filtered_success"] == [7]


def test_publish_signals_let_the_client_add_headers(test_vhost_url: str):
    queue = unique_queue("publish-signals")
    client = App("publish-signals", settings=Settings(broker_url=test_vhost_url))
    published: list[tuple[str, str]] = []

    def stamp(headers: dict, **_: object) -> None:
        headers["tenant"] = "acme"

    def note(sender: str, headers: dict, **_: object) -> None:
        published.append((sender, headers["tenant"]))

    before_task_publish.connect(stamp, weak=False)
    after_task_publish.connect(note, weak=False)
    try:
        with WorkerProcess(test_vhost_url, app="tests.integration.signal_tasks:app", queues=[queue],
                           env={"SIGNAL_LOG": "/dev/null"}) as worker:  # fmt: skip
            worker.wait_ready()
            assert client.send_task("signals.headers", queue=queue).get(timeout=30) == {"tenant": "acme"}
        assert published == [("signals.headers", "acme")]
    finally:
        before_task_publish.disconnect(stamp)
        after_task_publish.disconnect(note)
        client.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")
