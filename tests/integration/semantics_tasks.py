"""Tasks for the task-semantics tests: retries, limits, states, hooks, bound requests."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from broker_svc import App, Settings, SoftTimeLimitExceeded, Task
from broker_svc.tasks.task import ExceptionInfo

app = App("semantics", settings=Settings.from_env())


def _record(path: str, entry: dict[str, Any]) -> None:
    # One JSON line per event, appended: the test reads what happened and when.
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")


@app.task(bind=True)
def report_request(self: Task) -> dict[str, Any]:
    r = self.request
    return {
        "id": r.id, "retries": r.retries, "hostname": r.hostname, "root_id": r.root_id,
        "parent_id": r.parent_id, "reply_to": r.reply_to, "correlation_id": r.correlation_id,
        "routing_key": r.delivery_info.get("routing_key"), "eta": r.eta, "expires": r.expires,
        "args": r.args, "kwargs": r.kwargs, "called_directly": r.called_directly,
    }  # fmt: skip


@app.task(bind=True)
def spawn_child(self: Task, queue: str) -> dict[str, Any]:
    child = app.send_task("tests.integration.semantics_tasks.report_request", queue=queue)
    return {"me": self.request.id, "child": child.get(timeout=30)}


@app.task(bind=True, max_retries=3)
def always_retry(self: Task, path: str, countdown: float) -> None:
    _record(path, {"attempt": self.request.retries, "at": time.time()})
    raise self.retry(exc=ValueError(f"attempt {self.request.retries}"), countdown=countdown)


@app.task(bind=True, autoretry_for=(KeyError,), retry_backoff=0.4, retry_jitter=False, max_retries=3)
def backoff(self: Task, path: str) -> None:
    _record(path, {"attempt": self.request.retries, "at": time.time()})
    raise KeyError("still broken")


@app.task(bind=True, max_retries=5)
def succeeds_on_third(self: Task, path: str) -> int:
    _record(path, {"attempt": self.request.retries, "at": time.time()})
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    return self.request.retries


@app.task(soft_time_limit=0.5)
def soft_limited() -> str:
    try:
        time.sleep(5)
    except SoftTimeLimitExceeded:
        return "soft limit caught"
    return "not interrupted"


@app.task(time_limit=0.5)
def hard_limited() -> str:
    time.sleep(5)
    return "not killed"


@app.task(bind=True)
def recorded_in_c(self: Task, path: str, count: int) -> int:
    """Note this run in ``path``, then one call into C that keeps the GIL (about 1.2 s per 10**8)."""
    _record(path, {"id": self.request.id, "pid": os.getpid(), "started": time.time()})
    return sum(range(count))


@app.task(time_limit=0.5)
def hard_limited_in_c() -> str:
    # One call into C that keeps the GIL until it returns (several seconds): no other thread of
    # the child runs meanwhile, its hard limit's watchdog included.
    sum(range(500_000_000))
    return "not killed"


@app.task
def sleeper(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@app.task(bind=True)
def recorded(self: Task, path: str, seconds: float) -> list[float]:
    """Note this run (task id, pid) in ``path`` as it starts, sleep; when it started and ended."""
    started = time.time()
    _record(path, {"id": self.request.id, "pid": os.getpid(), "started": started})
    time.sleep(seconds)
    return [started, time.time()]


@app.task(bind=True)
def recorded_until(self: Task, path: str, flag: str, max_s: float) -> list[float]:
    """Note this run in ``path`` as it starts, then run until ``flag`` exists (at most ``max_s``)."""
    started = time.time()
    _record(path, {"id": self.request.id, "pid": os.getpid(), "started": started})
    while not os.path.exists(flag) and time.time() - started < max_s:
        time.sleep(0.05)
    return [started, time.time()]


@app.task(bind=True, track_started=True)
def progress(self: Task, steps: int) -> str:
    for step in range(steps):
        self.update_state(state="PROGRESS", meta={"step": step, "of": steps})
    return "done"


class Hooked(Task):
    """Writes each hook call to the file named by the task's first argument."""

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
        _record(args[0], {"hook": "on_failure", "exc": repr(exc), "has_tb": "Traceback" in einfo.traceback})

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any],
        einfo: ExceptionInfo | None,
    ) -> None:  # fmt: skip
        _record(args[0], {"hook": "after_return", "status": status})
        if kwargs.get("break_hook"):
            raise RuntimeError("a broken hook")


@app.task(base=Hooked)
def hooked(path: str, fail: bool = False, break_hook: bool = False) -> str:
    if fail:
        raise ValueError("hooked failure")
    return "ok"


@app.task(ignore_result=True)
def no_result(path: str) -> str:
    Path(path).write_text("ran")
    return "unseen"


@app.task(bind=True)
def now(self: Task) -> dict[str, Any]:
    return {"at": time.time(), "retries": self.request.retries, "eta": self.request.eta}


@app.task(rate_limit="4/s")
def rate_limited() -> str:
    return "ran"


@app.task
def die() -> None:
    os._exit(9)  # the child dies mid-task, as a segfault or the OOM killer would end it


@app.task
def unencodable() -> object:
    return object()  # no serializer can carry it
