"""A real Celery app for interop tests; the broker URL comes from ``INTEROP_BROKER_URL``.

``celery beat`` of this app fires ``INTEROP_BEAT_SCHEDULE`` (JSON: Celery's ``beat_schedule``,
``schedule`` in seconds).
"""

from __future__ import annotations

import json
import os

from celery import Celery

app = Celery("interop", broker=os.environ.get("INTEROP_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.update(
    # INTEROP_RESULT_BACKEND: Clockwork's chord backend, for a Celery worker in a chord's header,
    # or the test run's Redis, for a Celery worker beside ours on one Redis result backend.
    result_backend=os.environ.get("INTEROP_RESULT_BACKEND", "rpc://"),
    accept_content=["json", "msgpack"],
    result_accept_content=["json", "msgpack"],
    task_serializer="json",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    beat_schedule=json.loads(os.environ.get("INTEROP_BEAT_SCHEDULE", "{}")),
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


@app.task(name="canvas.collect")
def canvas_collect(results: list, label: str = "") -> list:
    import json

    if os.environ.get("CANVAS_NOTES"):
        with open(os.environ["CANVAS_NOTES"], "a") as notes:
            notes.write(json.dumps(["collect", [label, results]]) + "\n")
    return results


@app.task(name="canvas.grow", bind=True)
def canvas_grow(self, x: int, extra: list, lazy: bool = False) -> int:
    queue = self.request.delivery_info.get("routing_key")
    for e in extra:
        added = self.add_to_chord(canvas_add.si(x, e).set(queue=queue), lazy=lazy)
        if lazy:
            added.delay()
    return x


@app.task(name="canvas.slow_add")
def canvas_slow_add(x: int, y: int, seconds: float = 0.5) -> int:
    import time

    time.sleep(seconds)
    return x + y


@app.task(name="canvas.fail")
def canvas_fail(*args) -> None:
    raise ValueError(f"failed with {list(args)}")


@app.task(name="canvas.note")
def canvas_note(task_id: str) -> str:
    import json

    with open(os.environ["CANVAS_NOTES"], "a") as notes:
        notes.write(json.dumps(["note", [task_id]]) + "\n")
    return "noted"


# The scheduler tests' task, as tests/integration/beat_tasks.py defines it for our worker.


@app.task(name="beat.tick", bind=True)
def beat_tick(self, journal: str, seconds: float = 0.0) -> str:
    """Append a JSON line of what ran: the id, the ``clockwork_beat_*`` headers, start and end."""
    import time

    from tests.support.beats import record_run

    started = time.time()
    if seconds:
        time.sleep(seconds)
    headers = self.request.headers or {}
    record_run(
        journal, self.request, started=started, headers=sorted(headers), reply_to=self.request.reply_to
    )
    return str(self.request.id)


# Celery's task API idioms, as tests/integration/task_api_tasks.py defines them for our worker.


class Add(app.Task):  # type: ignore[name-defined,misc]  # Celery's app.Task: a class made per app
    name = "taskapi.add"
    rate_limit = "50/s"
    max_retries = 7

    def run(self, x: int, y: int) -> int:
        return x + y


class Flaky(app.Task):  # type: ignore[name-defined,misc]
    name = "taskapi.flaky"
    autoretry_for = (ConnectionError,)
    max_retries = 3
    default_retry_delay = 0

    def run(self, need: int) -> int:
        if self.request.retries < need:
            raise ConnectionError(f"attempt {self.request.retries}")
        return int(self.request.retries)


app.register_task(Add())
app.register_task(Flaky())


@app.task(bind=True, name="taskapi.request_fields")
def request_fields(self) -> dict:
    return {
        "time_limit": self.request.time_limit,
        "soft_time_limit": self.request.soft_time_limit,
        "properties": self.request.properties,
    }


@app.task(bind=True, name="taskapi.grow", default_retry_delay=0)
def grow(self, foo: int, bar: int = 0) -> list:
    if self.request.retries == 0:
        raise self.retry(kwargs={"foo": foo * 10})
    return [foo, bar, list(self.request.args), dict(self.request.kwargs)]


@app.task(bind=True, name="taskapi.shrink", default_retry_delay=0)
def shrink(self, foo: int, bar: int = 0) -> list:
    if self.request.retries == 0:
        raise self.retry(args=(foo - 1,))
    return [foo, bar, list(self.request.args), dict(self.request.kwargs)]


# Stamping: the names tests/integration/stamping_tasks.py defines for our worker.


@app.task(name="stamps.look", bind=True, shared=False)
def stamps_look(self, *parents) -> dict:
    return {
        "stamped_headers": sorted(self.request.stamped_headers or []),
        "stamps": self.request.stamps,
        "parents": list(parents),
    }


@app.task(name="stamps.sleep", shared=False)
def stamps_sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "slept"
