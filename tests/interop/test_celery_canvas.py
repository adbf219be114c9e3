"""A real Celery client's canvas on our worker, beside a real Celery worker: chains, links, errbacks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import chain, group
from celery import exceptions as celery_exceptions

from tests.support.amqp import delete_queues, drain
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

APP = "tests.integration.canvas_tasks:app"


@pytest.fixture(scope="module")
def notes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("canvas") / "notes.jsonl"


@pytest.fixture(scope="module")
def ours(test_vhost_url: str, notes_path: Path) -> Iterator[str]:
    queue = unique_queue("canvas")
    env = {"CANVAS_NOTES": str(notes_path)}
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=2, env=env) as worker:
        worker.wait_ready()
        yield queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def sig(client, name: str, *args, queue: str, **options):
    return client.signature(f"canvas.{name}", args=args, queue=queue, **options)


def notes(path: Path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_chain_runs_every_step_in_order_with_the_previous_result(celery_client, ours: str):
    c = chain(sig(celery_client, "add", 1, 2, queue=ours), sig(celery_client, "add", 3, queue=ours),
              sig(celery_client, "mul", 10, queue=ours))  # fmt: skip
    result = c.apply_async()
    assert result.get(timeout=30) == 60
    assert result.parent.get(timeout=5) == 6 and result.parent.parent.get(timeout=5) == 3


def test_pipes_and_immutable_steps(celery_client, ours: str):
    piped = sig(celery_client, "add", 2, 2, queue=ours) | sig(celery_client, "mul", 3, queue=ours)
    assert piped.apply_async().get(timeout=30) == 12
    immutable = celery_client.signature("canvas.add", args=(5, 5), queue=ours, immutable=True)
    assert (sig(celery_client, "add", 1, 1, queue=ours) | immutable).apply_async().get(timeout=30) == 10


def test_a_group_of_chains(celery_client, ours: str):
    g = group(
        chain(sig(celery_client, "add", 1, 1, queue=ours), sig(celery_client, "mul", 2, queue=ours)),
        chain(sig(celery_client, "add", 2, 2, queue=ours), sig(celery_client, "mul", 3, queue=ours)),
    )
    assert g.apply_async().get(timeout=30) == [4, 12]


def test_link_runs_the_callback_with_the_result(celery_client, ours: str):
    callback = sig(celery_client, "mul", 5, queue=ours, task_id="cb-" + unique_queue("id"))
    parent = celery_client.send_task("canvas.add", (2, 2), queue=ours, link=callback)
    assert parent.get(timeout=30) == 4
    assert celery_client.AsyncResult(callback.id).get(timeout=30) == 20
    assert [child.id for child in parent.children] == [callback.id]  # Celery's result.children


def test_a_failed_step_stops_the_chain_and_its_errbacks_run(celery_client, ours: str, notes_path: Path):
    last = sig(celery_client, "add", 100, queue=ours)
    c = chain(sig(celery_client, "add", 1, 1, queue=ours), sig(celery_client, "fail", queue=ours), last)
    result = c.apply_async()
    with pytest.raises(ValueError, match=r"failed with \[2\]"):
        result.get(timeout=30)
    old_style = sig(celery_client, "note", queue=ours)
    new_style = sig(celery_client, "on_error", queue=ours)
    failed = celery_client.send_task("canvas.fail", ("x",), queue=ours, link_error=[old_style, new_style])
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    wait_for(lambda: ["note", [failed.id]] in notes(notes_path), timeout_s=30, message="no old-style errback")
    wait_for(lambda: any(n[0] == "on_error" and n[1][0] == failed.id for n in notes(notes_path)),
             timeout_s=30, message="no new-style errback")  # fmt: skip
    [(_, (task_id, exc, has_traceback))] = [n for n in notes(notes_path) if n[0] == "on_error"]
    assert "ValueError" in exc and has_traceback
    # The chain's last step never ran: its result never comes.
    with pytest.raises(celery_exceptions.TimeoutError):
        celery_client.AsyncResult(result.id).get(timeout=1)


def test_a_chord_is_refused_whole_with_a_failure_and_a_dead_letter(
    celery_client, ours: str, test_vhost_url: str
):
    body = sig(celery_client, "xsum", queue=ours)
    refused = celery_client.send_task("canvas.add", (1, 1), queue=ours, chord=body, group_id="g-1")
    with pytest.raises(NotImplementedError, match="chord"):
        refused.get(timeout=30)
    dead = wait_for(lambda: drain(test_vhost_url, f"{ours}.dead"), timeout_s=10, message="no dead letter")
    assert [d.headers["x-clockwork-reason"] for d in dead] == ["unsupported_canvas"]


def test_the_same_canvas_gives_the_same_results_on_a_celery_worker(
    celery_client, start_celery_worker, test_vhost_url: str, notes_path: Path, monkeypatch: pytest.MonkeyPatch
):
    queue = unique_queue("celery-canvas")
    monkeypatch.setenv("CANVAS_NOTES", str(notes_path))
    start_celery_worker(queue)
    try:
        c = chain(sig(celery_client, "add", 1, 2, queue=queue), sig(celery_client, "add", 3, queue=queue),
                  sig(celery_client, "mul", 10, queue=queue))  # fmt: skip
        assert c.apply_async().get(timeout=30) == 60
        callback = sig(celery_client, "mul", 5, queue=queue, task_id="cb-" + unique_queue("id"))
        callback.freeze()  # its reply_to: a Celery worker otherwise sends the result to itself
        assert celery_client.send_task("canvas.add", (2, 2), queue=queue, link=callback).get(timeout=30) == 4
        assert celery_client.AsyncResult(callback.id).get(timeout=30) == 20
    finally:
        delete_queues(test_vhost_url, queue)
