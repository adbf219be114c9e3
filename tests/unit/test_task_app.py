"""``App`` is what tasks, signatures and results are typed against (``broker_svc/tasks/task_app.py``).

The modules below ``App`` name Protocols, not ``App`` (no import cycle); these assignments are
where mypy checks that an ``App`` and a ``Task`` still are what those Protocols say.
"""

from __future__ import annotations

from broker_svc import App, Signature, current_app
from broker_svc.results.jobs import JobsApp
from broker_svc.tasks.arguments import CheckedTask
from broker_svc.tasks.running.eager import EagerTask
from broker_svc.tasks.running.trace import TracedTask
from broker_svc.tasks.task_app import TaskApp

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


def test_a_task_is_what_a_run_an_eager_run_and_the_argument_check_read():
    app = App("task-app", broker=URL)

    @app.task
    def double(x: int) -> int:
        return 2 * x

    traced: TracedTask = double
    eager: EagerTask = double
    checked: CheckedTask = double
    assert traced is double and eager is double and checked is app.tasks[double.name]
    assert double.apply((4,)).get() == 8
