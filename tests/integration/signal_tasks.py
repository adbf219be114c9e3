"""An app whose signal receivers write one JSON line per signal to ``$SIGNAL_LOG``."""

from __future__ import annotations

import json
import os
from typing import Any

from broker_svc import App
from broker_svc.signals import (
    task_failure,
    task_postrun,
    task_prerun,
    task_received,
    task_retry,
    task_revoked,
    task_success,
    worker_process_init,
    worker_ready,
    worker_shutdown,
)

app = App("signals")


def _record(name: str, **fields: Any) -> None:
    with open(os.environ["SIGNAL_LOG"], "a") as log:
        log.write(json.dumps({"signal": name, "pid": os.getpid(), **fields}) + "\n")


@worker_process_init.connect
def on_process_init(**_: Any) -> None:
    _record("worker_process_init")


@worker_ready.connect
def on_ready(**_: Any) -> None:
    _record("worker_ready")


@worker_shutdown.connect
def on_shutdown(**_: Any) -> None:
    _record("worker_shutdown")


@task_prerun.connect
def on_prerun(task_id: str, task: Any, args: list[Any], **_: Any) -> None:
    _record("task_prerun", task_id=task_id, task=task.name, args=args)


@task_postrun.connect
def on_postrun(task_id: str, state: str, retval: Any, **_: Any) -> None:
    _record("task_postrun", task_id=task_id, state=state, retval=repr(retval))


@task_success.connect
def on_success(sender: Any, result: Any, **_: Any) -> None:
    _record("task_success", task=sender.name, result=result)


@task_failure.connect
def on_failure(task_id: str, exception: BaseException, **_: Any) -> None:
    _record("task_failure", task_id=task_id, exception=repr(exception))


@task_retry.connect
def on_retry(request: Any, reason: BaseException, **_: Any) -> None:
    _record("task_retry", task_id=request.id, reason=repr(reason))


@task_received.connect
def on_received(request: Any, **_: Any) -> None:
    _record("task_received", task_id=request.id)


@task_revoked.connect
def on_revoked(request: Any, expired: bool, terminated: bool, **_: Any) -> None:
    _record("task_revoked", task_id=request.id, expired=expired, terminated=terminated)


@task_success.connect(sender="signals.only_for_double")
def only_for_double(result: Any, **_: Any) -> None:
    _record("filtered_success", result=result)


@app.task(name="signals.double")
def double(x: int) -> int:
    return 2 * x


@app.task(name="signals.only_for_double")
def only_for_double_task(x: int) -> int:
    return x


@app.task(name="signals.fail")
def fail() -> None:
    raise KeyError("missing")


@app.task(name="signals.retry_once", bind=True, max_retries=1)
def retry_once(self: Any) -> str:
    if self.request.retries == 0:
        raise self.retry(countdown=0.1, exc=OSError("again"))
    return "second time"


@app.task(name="signals.headers", bind=True)
def headers(self: Any) -> Any:
    return self.request.headers
