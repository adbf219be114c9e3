"""Celery's built-in tasks, registered on every app and run as Celery's run them."""

from __future__ import annotations

import pytest

from broker_svc import App, NotRegistered

URL = "amqp://guest:guest@127.0.0.1:5672/%2Fbuiltins"


@pytest.fixture
def app() -> App:
    app = App("builtins", broker=URL)

    @app.task(name="b.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="b.double")
    def double(x: int) -> int:
        return 2 * x

    return app


def sig(name: str) -> dict[str, object]:
    return {"task": name, "args": [], "kwargs": {}, "options": {}, "subtask_type": None, "immutable": False}


def test_map_starmap_and_chunks_call_the_named_task_for_each_item(app: App):
    assert app.tasks["celery.map"].apply((sig("b.double"), [1, 2, 3])).get() == [2, 4, 6]
    assert app.tasks["celery.starmap"].apply((sig("b.add"), [[1, 1], [2, 3]])).get() == [2, 5]
    chunks = app.tasks["celery.chunks"].apply((sig("b.add"), [[i, i] for i in range(5)], 2)).get()
    assert chunks == [[0, 2], [4, 6], [8]]
    assert app.tasks["celery.accumulate"].apply((1, 2, 3)).get() == (1, 2, 3)
    assert app.tasks["celery.accumulate"].apply((1, 2, 3), {"index": 1}).get() == 2


def test_the_client_forms_run_eagerly_too(app: App):
    add = app.tasks["b.add"]
    assert add.starmap([(1, 2), (3, 4)]).apply().get() == [3, 7]
    assert app.tasks["b.double"].map([5]).apply().get() == [10]


def test_a_builtin_naming_an_unknown_task_fails_clearly(app: App):
    with pytest.raises(NotRegistered, match="b.nope"):
        app.tasks["celery.map"].apply((sig("b.nope"), [1])).get()


def test_chord_parts_fail_with_the_reason_instead_of_not_registered(app: App):
    with pytest.raises(NotImplementedError, match="joins chords in the broker"):
        app.tasks["celery.chord_unlock"].apply(("group-id", {})).get()


def test_map_of_an_async_task_is_refused_clearly(app: App):
    @app.task(name="b.async_double")
    async def async_double(x: int) -> int:
        return x * 2

    with pytest.raises(TypeError, match="async def task"):
        app.tasks["celery.map"].apply((sig("b.async_double"), [1])).get()
