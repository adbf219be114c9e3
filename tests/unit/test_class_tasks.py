"""Class-based tasks, as Celery writes them: ``class T(app.Task)`` and ``app.register_task``.

tests/integration/test_task_api.py runs them on a worker; here, what registering does.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc import App, Task

URL = "amqp://guest:guest@127.0.0.1:5672/%2Fclass-tasks"


@pytest.fixture
def app() -> App:
    return App("proj", broker=URL, set_as_current=False)


def test_app_task_is_one_base_class_per_app_bound_to_it(app: App):
    other = App("other", broker=URL, set_as_current=False)
    assert issubclass(app.Task, Task) and app.Task is app.Task
    assert app.Task.app is app and other.Task.app is other


def test_register_task_registers_the_instance_with_its_class_options(app: App):
    class Add(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.add"
        rate_limit = "10/s"
        autoretry_for = (KeyError,)
        max_retries = 5

        def run(self, x: int, y: int) -> int:
            return x + y

    add = Add()
    assert app.register_task(add) is add
    assert app.tasks["proj.add"] is add and app.get_task("proj.add") is add
    assert Add().name == "proj.add" and Add().app is app
    assert add(1, 2) == 3  # a call runs the body here
    assert add.apply((1, 2)).get() == 3


def test_autoretry_for_on_a_class_retries_an_eager_run(app: App):
    class Flaky(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.flaky"
        autoretry_for = (ConnectionError,)
        default_retry_delay = 0

        def run(self) -> int:
            if self.request.retries < 2:
                raise ConnectionError("not yet")
            return int(self.request.retries)

    assert app.register_task(Flaky()).apply().get() == 2


def test_register_task_options_go_on_the_instance(app: App):
    attempts: list[int] = []

    class Flaky(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.flaky"

        def run(self) -> None:
            attempts.append(self.request.retries)
            raise ConnectionError("down")

    flaky = app.register_task(
        Flaky, autoretry_for=(ConnectionError,), max_retries=1, retry_kwargs={"countdown": 0}
    )
    assert flaky.autoretry_for == (ConnectionError,) and Flaky.autoretry_for == ()
    result = flaky.apply()
    assert result.failed() and isinstance(result.result, ConnectionError)
    assert attempts == [0, 1]


def test_a_class_without_a_name_is_named_after_its_module_and_class(app: App):
    class Nameless(app.Task):  # type: ignore[misc,name-defined]
        def run(self) -> str:
            return str(self.name)

    task = app.register_task(Nameless)
    assert task.name == f"{__name__}.Nameless" == Nameless().name
    assert app.tasks[task.name] is task


def test_a_class_based_tasks_arguments_are_checked_against_run(app: App):
    class Add(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.add"

        def run(self, x: int, y: int = 0) -> int:
            return x + y

    add = app.register_task(Add())
    add.check_arguments((1,), {"y": 2})
    with pytest.raises(TypeError, match="proj.add: too many positional arguments"):
        add.check_arguments((1, 2, 3), {})
    with pytest.raises(TypeError, match="proj.add"):
        add.delay()  # refused before anything is sent


def test_a_plain_task_subclass_is_bound_to_the_app_registering_it(app: App):
    class Plain(Task):  # broker_svc.Task itself, not app.Task
        name = "proj.plain"

        def run(self) -> str:
            return "plain"

    app.register_task(Plain())
    assert Plain.app is app


def test_register_task_refuses_a_clash_a_bad_rate_and_unknown_options(app: App):
    class First(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.same"

    class Second(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.same"

    first = app.register_task(First())
    assert app.register_task(First()) is first  # the class again (a module imported twice)
    with pytest.raises(ValueError, match="'proj.same' is already registered"):
        app.register_task(Second())

    class Fast(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.fast"
        rate_limit = "fast"

    with pytest.raises(ValueError, match="proj.fast"):
        app.register_task(Fast())
    with pytest.raises(TypeError, match=r"unknown task option\(s\) \['retry_everything'\]"):
        app.register_task(First, retry_everything=True)
    with pytest.raises(TypeError, match="takes a broker_svc.Task"):
        app.register_task(object())  # type: ignore[arg-type]
    assert "proj.fast" not in app.tasks


def test_a_dedup_key_on_a_class_names_an_argument_of_run(app: App):
    class Refresh(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.refresh"
        dedup_key = "user_id"

        def run(self, user_id: int) -> None: ...

    class Wrong(app.Task):  # type: ignore[misc,name-defined]
        name = "proj.wrong"
        dedup_key = "nobody"

        def run(self, user_id: int) -> None: ...

    refresh: Any = app.register_task(Refresh())
    assert refresh._dedup is not None
    with pytest.raises(TypeError, match="nobody"):
        app.register_task(Wrong())
