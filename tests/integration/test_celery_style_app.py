"""A Celery project whose only change is its import lines runs on our worker and our client."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc import App, ResultTimeout, TaskError
from tests.support.amqp import delete_queues, drain
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

TASKS = "tests.integration.proj.tasks"


@pytest.fixture(scope="module")
def project(test_vhost_url: str) -> Iterator[tuple[App, Any, WorkerProcess, str, str]]:
    queue, slow = unique_queue("proj"), unique_queue("proj-slow")
    env = {"PROJ_BROKER_URL": test_vhost_url, "PROJ_QUEUE": queue, "PROJ_SLOW_QUEUE": slow}
    monkeypatch = pytest.MonkeyPatch()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    module = importlib.reload(importlib.import_module("tests.integration.proj.celery"))
    tasks = importlib.import_module(TASKS)
    app: App = module.app
    app.set_current()
    # The app module does not import its tasks: the worker finds them through include=.
    worker = WorkerProcess(
        test_vhost_url, app="tests.integration.proj.celery:app", queues=[queue, slow], concurrency=1, env=env
    )
    try:
        worker.wait_ready()
        yield app, tasks, worker, queue, slow
    finally:
        worker.close()
        app.close()
        monkeypatch.undo()
        delete_queues(test_vhost_url, queue, slow, f"{queue}.dead", f"{slow}.dead")


def test_shared_tasks_run_through_the_current_app_with_its_conf(project):
    app, tasks, _worker, queue, slow = project
    assert app.settings.serializer == "json"
    assert tasks.add.delay(2, 3).get(timeout=30) == 5
    assert tasks.whoami.delay().get(timeout=30) == {"task": f"{TASKS}.whoami", "queue": queue}
    # task_routes sends slow_* to its own queue.
    assert tasks.slow_echo.delay("routed").get(timeout=30) == ["routed", slow]
    # An explicit queue beats the route, as in Celery.
    assert tasks.slow_echo.apply_async(("direct",), queue=queue).get(timeout=30) == ["direct", queue]


def test_expected_errors_stay_out_of_warning_logs_and_ignored_failures_still_report(project):
    _app, tasks, worker, _queue, _slow = project
    with pytest.raises(KeyError):
        tasks.lookup.delay("absent").get(timeout=30)
    worker.first("task_failed_expected", timeout_s=10)
    assert worker.count("task_failed") == 0
    with pytest.raises(ValueError, match="reported although"):
        tasks.quiet_failure.delay().get(timeout=30)


def test_retry_kwargs_bound_autoretries(project):
    _app, tasks, worker, _queue, _slow = project
    with pytest.raises(OSError, match="disk on fire"):
        tasks.always_oserror.delay().get(timeout=30)
    assert worker.count("task_retried") == 1


def test_ignore_acks_without_a_result_and_reject_requeues_or_dead_letters(project, test_vhost_url: str):
    _app, tasks, worker, queue, _slow = project
    ignored = tasks.handled_elsewhere.delay()
    worker.first("task_ignored", timeout_s=30)
    with pytest.raises(ResultTimeout):
        ignored.get(timeout=1)
    assert tasks.refuse_first_delivery.delay().get(timeout=30) == "second delivery"
    refused = tasks.refuse.delay("malformed order")
    with pytest.raises(TaskError, match="malformed order") as raised:
        refused.get(timeout=30)
    assert (raised.value.exc_type, raised.value.exc_module) == ("Reject", "celery.exceptions")
    dead: list = []

    def dead_letter_of_refused() -> bool:
        dead.extend(drain(test_vhost_url, f"{queue}.dead"))  # other tests' dead letters too
        return any(d.headers["id"] == refused.id for d in dead)

    wait_for(dead_letter_of_refused, timeout_s=10, message="no dead letter")
    [letter] = [d for d in dead if d.headers["id"] == refused.id]
    assert letter.headers["x-clockwork-reason"] == "rejected"


def test_retry_with_new_arguments_runs_the_next_attempt_with_them(project):
    _app, tasks, _worker, _queue, _slow = project
    assert tasks.grow.delay(3).get(timeout=30) == [300, 2]


def test_custom_headers_reach_the_task_as_celery_shows_them(project):
    _app, tasks, _worker, _queue, _slow = project
    seen = tasks.headers_seen.apply_async(headers={"tenant": "acme"}).get(timeout=30)
    assert seen == {"headers": {"tenant": "acme"}, "tenant": "acme"}
    assert tasks.headers_seen.delay().get(timeout=30) == {"headers": None, "tenant": None}


def test_the_start_up_banner_and_failure_logs_say_what_is_needed(project, test_vhost_url: str):
    _app, tasks, worker, _queue, _slow = project
    ready = worker.first("worker_ready")
    assert ready["app"] == "tests.integration.proj.celery:app"
    assert "guest:***@" in ready["broker"] and "guest:guest" not in ready["broker"]
    assert f"{TASKS}.add" in ready["tasks"] and not any(t.startswith("celery.") for t in ready["tasks"])
    assert ready["version"]
    with pytest.raises(ValueError):
        tasks.quiet_failure.delay().get(timeout=30)
    failed = worker.first("task_failed", timeout_s=10)
    assert "Traceback" in failed["traceback"] and "reported although" in failed["traceback"]
