"""Tasks for the ``async def`` tests: results, failures, the loop they run on, limits, hooks."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from broker_svc import App, Settings, SoftTimeLimitExceeded, Task, signals
from broker_svc.tasks.task import ExceptionInfo

app = App("async-tasks", settings=Settings.from_env())

# A client cached across tasks, as an aiohttp session would be: made on the first task's loop.
_cached: dict[str, asyncio.Event] = {}


def _record(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")


class Recorded(Task):
    """Hooks that write what they saw to the file named by the task's first argument."""

    def on_success(self, retval: Any, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        _record(args[0], {"hook": "on_success", "retval": retval})

    def on_failure(
        self,
        exc: BaseException,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo,
    ) -> None:
        _record(args[0], {"hook": "on_failure", "exc": type(exc).__name__})


@signals.task_prerun.connect
def _prerun(sender: Any = None, task: Any = None, args: Sequence[Any] = (), **_: Any) -> None:
    if getattr(task, "name", "").startswith(f"{__name__}.hooked"):
        _record(args[0], {"signal": "task_prerun"})


@signals.task_postrun.connect
def _postrun(
    sender: Any = None, task: Any = None, args: Sequence[Any] = (), state: str = "", **_: Any
) -> None:
    if getattr(task, "name", "").startswith(f"{__name__}.hooked"):
        _record(args[0], {"signal": "task_postrun", "state": state})


@app.task
async def double(x: int) -> int:
    await asyncio.sleep(0.01)
    return x * 2


@app.task
async def fails(message: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(message)


@app.task
async def loop_id() -> list[int]:
    """This child's pid and its loop; the event cached by the first task must be on that loop."""
    loop = asyncio.get_running_loop()
    event = _cached.setdefault("event", asyncio.Event())
    event.set()
    await event.wait()  # an Event bound to another loop would raise RuntimeError here
    return [os.getpid(), id(loop)]


@app.task
async def where(seconds: float) -> list[Any]:
    """Sleep on the loop, then say which process, thread and loop ran this."""
    await asyncio.sleep(seconds)
    return [os.getpid(), threading.current_thread().name, id(asyncio.get_running_loop())]


@app.task(bind=True, max_retries=3)
async def retried(self: Task) -> list[Any]:
    if self.request.retries < 2:
        raise self.retry(countdown=0.05)
    await asyncio.sleep(0)
    return [self.request.id, self.request.retries]


@app.task(bind=True, autoretry_for=(ConnectionError,), retry_kwargs={"countdown": 0.05})
async def autoretried(self: Task) -> int:
    await asyncio.sleep(0)
    if self.request.retries < 1:
        raise ConnectionError("flaky")
    return self.request.retries


@app.task(base=Recorded)
async def hooked(path: str, fail: bool) -> str:
    await asyncio.sleep(0)
    if fail:
        raise KeyError("asked to")
    return "hooked ok"


@app.task(soft_time_limit=0.3)
async def soft_caught(path: str) -> str:
    try:
        try:
            await asyncio.sleep(5)
        finally:
            Path(path).write_text("finally ran")  # noqa: ASYNC240 (a test marker, tiny)
    except SoftTimeLimitExceeded as exc:
        await asyncio.sleep(0.01)  # the loop still serves the body after the limit
        return f"caught: {exc}"
    return "not interrupted"


@app.task(soft_time_limit=0.3)
async def soft_uncaught() -> str:
    await asyncio.sleep(5)
    return "not interrupted"


@app.task(time_limit=0.5)
async def hard_limited() -> str:
    await asyncio.sleep(5)
    return "not killed"


@app.task
async def sleeps(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "slept"


@app.task
async def stubborn(seconds: float) -> str:
    """Ignores cancellation (a bad idea): a terminate must end its child after all."""
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            continue
    return "outlived"


@app.task
async def async_on_error(request: Any, exc: BaseException, traceback: str, path: str) -> None:
    """A new-style errback that is a coroutine: awaited in the failed task's child."""
    await asyncio.sleep(0)
    _record(path, {"errback": request.id, "exc": type(exc).__name__})


@app.task
def forgot_async() -> Any:
    return asyncio.sleep(0)  # a plain task that returns a coroutine: a mistake, reported as one
