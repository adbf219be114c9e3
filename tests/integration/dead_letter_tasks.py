"""Tasks the dead-letter tests send: dead-lettered until a flag file exists, then they run."""

from __future__ import annotations

import os

from broker_svc import App, Reject, Task

app = App("deadletters")


def _record(path: str, tag: str) -> str:
    with open(path, "a") as out:
        out.write(tag + "\n")
    return tag


@app.task
def reject_unless(flag: str, path: str, tag: str) -> str:
    """Dead-lettered (``Reject(requeue=False)``) until ``flag`` exists; then appends ``tag``."""
    if not os.path.exists(flag):
        raise Reject("the flag is not set", requeue=False)
    return _record(path, tag)


@app.task(bind=True, max_retries=1)
def retry_unless(self: Task, flag: str, path: str, tag: str) -> str:
    """Retried once, then dead-lettered (``max_retries_exceeded``) until ``flag`` exists."""
    if not os.path.exists(flag):
        raise self.retry(exc=RuntimeError("the flag is not set"), countdown=0)
    return _record(path, tag)


@app.task
def record(path: str, tag: str) -> str:
    """Append ``tag``: proof that the body ran."""
    return _record(path, tag)
