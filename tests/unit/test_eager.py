"""``apply()`` and ``task_always_eager``: a task run here, as a worker runs it, with no broker."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc import App, chain, group
from broker_svc.signals import task_postrun, task_prerun

URL = "amqp://guest:guest@127.0.0.1:5672/%2Feager"


@pytest.fixture
def app() -> App:
    return App("eager", broker=URL)


def test_apply_runs_here_and_returns_an_eager_result(app: App):
    @app.task(bind=True)
    def whoami(self: Any, x: int) -> dict[str, Any]:
        return {"x": x, "eager": self.request.is_eager, "id": self.request.id}

    result = whoami.apply((3,), task_id="fixed-id")
    assert result.ready() and result.successful() and result.state == "SUCCESS"
    assert result.get() == {"x": 3, "eager": True, "id": "fixed-id"}
    assert app._producer is None  # no connection was made


def test_a_failure_raises_its_own_exception_from_get_or_at_once_with_propagation(app: App):
    @app.task
    def broken() -> None:
        raise KeyError("nope")

    result = broken.apply()
    assert result.failed() and result.state == "FAILURE"
    assert isinstance(result.result, KeyError)
    with pytest.raises(KeyError):
        result.get()
    assert isinstance(result.get(propagate=False), KeyError)
    with pytest.raises(KeyError):
        broken.apply(throw=True)
    app.conf.task_eager_propagates = True
    with pytest.raises(KeyError):
        broken.apply()


def test_retry_runs_again_at_once_until_it_succeeds_or_runs_out(app: App):
    attempts: list[int] = []

    @app.task(bind=True, max_retries=5)
    def flaky(self: Any) -> int:
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=3600)  # not waited for
        return int(self.request.retries)

    assert flaky.apply().get() == 2
    assert attempts == [0, 1, 2]

    @app.task(bind=True, max_retries=1)
    def hopeless(self: Any) -> None:
        raise self.retry(exc=OSError("down"), countdown=3600)

    with pytest.raises(OSError, match="down"):
        hopeless.apply().get()


def test_task_always_eager_makes_delay_run_here(app: App):
    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    app.conf.task_always_eager = True
    assert add.delay(2, 3).get() == 5
    assert app._producer is None


def test_eager_runs_send_the_same_signals_as_a_worker(app: App):
    @app.task
    def noop() -> str:
        return "done"

    seen: list[tuple[str, Any]] = []

    def before(task_id: str, **_: Any) -> None:
        seen.append(("prerun", task_id))

    def after(task_id: str, state: str, retval: Any, **_: Any) -> None:
        seen.append(("postrun", (task_id, state, retval)))

    task_prerun.connect(before, sender=noop)
    task_postrun.connect(after, sender=noop)
    try:
        noop.apply(task_id="t-1")
    finally:
        task_prerun.disconnect(before, sender=noop)
        task_postrun.disconnect(after, sender=noop)
    assert seen == [("prerun", "t-1"), ("postrun", ("t-1", "SUCCESS", "done"))]


def test_signatures_chains_and_groups_apply_eagerly(app: App):
    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    assert add.s(1, 2).apply().get() == 3
    assert chain(add.s(1, 2), add.s(3), add.s(4)).apply().get() == 10
    assert (add.s(1, 1) | add.si(5, 5)).apply().get() == 10
    assert group(add.s(i, i) for i in range(3)).apply().get() == [0, 2, 4]


def test_eager_retry_takes_new_arguments(app: App):
    @app.task(bind=True)
    def grow(self: Any, x: int) -> int:
        if self.request.retries == 0:
            raise self.retry(args=(x * 100,))
        return x

    assert grow.apply((3,)).get() == 300


def test_apply_runs_an_async_task_with_retries_and_hooks(app: App):
    import asyncio

    seen: list[Any] = []

    class Hooked(app.Task):  # type: ignore[name-defined,misc]
        def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
            seen.append(retval)

    @app.task(bind=True, base=Hooked, autoretry_for=(ConnectionError,), retry_kwargs={"countdown": 0})
    async def flaky(self: Any, x: int) -> int:
        await asyncio.sleep(0)
        if self.request.retries < 2:
            raise ConnectionError("not yet")
        return x + int(self.request.retries)

    assert flaky.apply((40,)).get() == 42
    assert seen == [42]  # the awaited value, not a coroutine


def test_a_plain_task_that_returns_a_coroutine_fails_with_a_type_error(app: App):
    import asyncio

    @app.task
    def forgot() -> Any:
        return asyncio.sleep(0)

    result = forgot.apply()
    assert result.failed()
    assert isinstance(result.result, TypeError)
    assert "not `async def`" in str(result.result)


def test_apply_of_an_async_task_inside_a_running_loop_runs_it_on_a_thread(app: App):
    import asyncio

    @app.task(bind=True)
    async def inner(self: Any) -> list[Any]:
        await asyncio.sleep(0)
        return [self.request.id, id(asyncio.get_running_loop())]

    async def caller() -> Any:
        return id(asyncio.get_running_loop()), inner.apply(task_id="in-a-loop")

    outer_loop, result = asyncio.run(caller())
    task_id, loop = result.get()
    assert task_id == "in-a-loop"
    assert loop != outer_loop  # a loop of its own, not the caller's (busy waiting for it)
