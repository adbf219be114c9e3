"""A real Celery app for interop tests; the broker URL comes from ``INTEROP_BROKER_URL``."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("interop", broker=os.environ.get("INTEROP_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.update(
    # INTEROP_RESULT_BACKEND: Clockwork's chord backend, for a Celery worker in a chord's header.
    result_backend=os.environ.get("INTEROP_RESULT_BACKEND", "rpc://"),
    accept_content=["json", "msgpack"],
    result_accept_content=["json", "msgpack"],
    task_serializer="json",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


@app.task(name="interop.mul")
def mul(x: int, y: int) -> int:
    return x * y


@app.task(name="interop.fail")
def fail(message: str) -> None:
    raise KeyError(message)


@app.task(name="interop.now", bind=True)
def now(self) -> dict:
    import time

    return {"at": time.time(), "retries": self.request.retries}


@app.task(name="interop.sleep")
def sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "slept"


# The canvas tasks, as tests/integration/canvas_tasks.py defines them for our worker.


@app.task(name="canvas.add")
def canvas_add(x: int, y: int) -> int:
    return x + y


@app.task(name="canvas.mul")
def canvas_mul(x: int, y: int) -> int:
    return x * y


@app.task(name="canvas.xsum")
def canvas_xsum(numbers: list) -> int:
    return sum(numbers)


@app.task(name="canvas.fail")
def canvas_fail(*args) -> None:
    raise ValueError(f"failed with {list(args)}")


@app.task(name="canvas.note")
def canvas_note(task_id: str) -> str:
    import json

    with open(os.environ["CANVAS_NOTES"], "a") as notes:
        notes.write(json.dumps(["note", [task_id]]) + "\n")
    return "noted"
