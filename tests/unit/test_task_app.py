"""``App`` is what tasks, signatures and results are typed against (``broker_svc/task_app.py``).

The modules below ``App`` name Protocols, not ``App`` (no import cycle); these assignments are
where mypy checks that an ``App`` still is what those Protocols say.
"""

from __future__ import annotations

from broker_svc import App, Signature, current_app
from broker_svc.results.jobs import JobsApp
from broker_svc.task_app import TaskApp

URL = "amqp://guest:guest@127.0.0.1:5672/%2Ftask-app"


def test_an_app_is_the_task_app_its_tasks_signatures_and_jobs_see():
    app = App("task-app", broker=URL)
    as_task_app: TaskApp = app
    as_jobs_app: JobsApp = app

    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    assert add.app is as_task_app is as_jobs_app
    assert add.s(1, 2).app is app
    assert Signature("task-app.add").app is current_app() is app
    assert as_task_app.get_task(add.name) is add
    assert as_task_app.conf.get("task_always_eager") is None
