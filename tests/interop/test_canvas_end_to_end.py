"""Our client's canvas, run by our worker and by a real Celery worker: the same answers from both."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings, Signature, chain, group
from broker_svc.errors import TaskError
from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def notes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("canvas-e2e") / "notes.jsonl"


@pytest.fixture(scope="module")
def our_queue(test_vhost_url: str, notes_path: Path) -> Iterator[str]:
    queue = unique_queue("e2e-canvas")
    env = {"CANVAS_NOTES": str(notes_path)}
    app = "tests.integration.canvas_tasks:app"
    with WorkerProcess(test_vhost_url, app=app, queues=[queue], concurrency=2, env=env) as worker:
        worker.wait_ready()
        yield queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.fixture
def client(test_vhost_url: str) -> Iterator[App]:
    app = App("e2e-canvas-client", settings=Settings(broker_url=test_vhost_url, serializer="json"))
    yield app
    app.close()


def _run_canvas(client: App, queue: str, notes_path: Path) -> dict[str, object]:
    def s(name: str, *args: Any, **options: Any) -> Signature:
        return client.signature(f"canvas.{name}", args, queue=queue, **options)

    got: dict[str, object] = {}
    got["chain"] = chain(s("add", 1, 2), s("add", 3), s("mul", 10)).apply_async().get(timeout=30)
    fixed = client.signature("canvas.add", (7, 7), queue=queue, immutable=True)
    got["pipe"] = (s("add", 2, 2) | s("mul", 3) | fixed).apply_async().get(timeout=30)
    got["group"] = group(s("add", i, i) for i in range(4)).apply_async().get(timeout=30)
    # A group closing a chain: each member gets the step before's value; the call is its GroupResult.
    closing = chain(s("add", 1, 1), group(s("add", 10), s("mul", 10))).apply_async()
    got["chain_to_group"] = closing.get(timeout=30)
    callback = s("mul", 5)
    callback_result = callback.freeze()  # its id and our reply queue, before it is sent
    client.send_task("canvas.add", (2, 2), queue=queue, link=callback).get(timeout=30)
    got["link"] = callback_result.get(timeout=30)
    failing = chain(s("add", 1, 1), s("fail"), s("add", 100)).apply_async()
    with pytest.raises(TaskError, match=r"failed with \[2\]"):
        failing.get(timeout=30)
    got["failed_chain"] = "raised"
    errback = s("note")
    failed = client.send_task("canvas.fail", ("x",), queue=queue, link_error=errback)
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    wait_for(lambda: notes_path.exists() and json.dumps(["note", [failed.id]]) in notes_path.read_text(),
             timeout_s=30, message="the errback did not run")  # fmt: skip
    got["errback"] = "ran"
    return got


EXPECTED = {
    "chain": 60, "pipe": 14, "group": [0, 2, 4, 6], "chain_to_group": [12, 20], "link": 20,
    "failed_chain": "raised", "errback": "ran",
}  # fmt: skip


def test_our_canvas_on_our_worker(client: App, our_queue: str, notes_path: Path):
    assert _run_canvas(client, our_queue, notes_path) == EXPECTED


def test_our_canvas_on_a_celery_worker(
    client: App, start_celery_worker, test_vhost_url: str, notes_path: Path, monkeypatch: pytest.MonkeyPatch
):
    queue = unique_queue("e2e-celery-canvas")
    monkeypatch.setenv("CANVAS_NOTES", str(notes_path))
    start_celery_worker(queue)
    try:
        assert _run_canvas(client, queue, notes_path) == EXPECTED
    finally:
        delete_queues(test_vhost_url, queue)
