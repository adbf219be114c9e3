"""Celery's task API idioms, as a Celery app moved here writes them: class-based tasks registered
with ``app.register_task``, ``retry`` with new arguments, and what a task reads of its request.

tests/interop/celery_app.py defines the same task names for a Celery worker, so a test can send the
same call to both and compare.
"""

from __future__ import annotations

from typing import Any

from broker_svc import App

app = App("taskapi")
# As tests/interop/celery_app.py configures its Celery app; the worker answers `inspect conf` from it.
app.conf.update(
    result_backend="rpc://",
    accept_content=["json", "msgpack"],
    result_accept_content=["json", "msgpack"],
    task_serializer="json",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    beat_schedule={},
)


class Add(app.Task):  # type: ignore[misc,name-defined]  # app.Task is a class made per app
    name = "taskapi.add"
    rate_limit = "50/s"
    max_retries = 7

    def run(self, x: int, y: int) -> int:
        return x + y


class Flaky(app.Task):  # type: ignore[misc,name-defined]
    """Fails with ConnectionError until its ``need``-th retry: ``autoretry_for`` retries it."""

    name = "taskapi.flaky"
    autoretry_for = (ConnectionError,)
    max_retries = 3
    default_retry_delay = 0

    def run(self, need: int) -> int:
        if self.request.retries < need:
            raise ConnectionError(f"attempt {self.request.retries}")
        return int(self.request.retries)


class Backoff(app.Task):  # type: ignore[misc,name-defined]
    """Autoretried with exponential backoff; ``acks_late`` accepted (Clockwork always acks late)."""

    name = "taskapi.backoff"
    autoretry_for = (TimeoutError,)
    retry_backoff = 0.05  # 0.05 s, then 0.1 s: the factor of 2 ** retries
    retry_jitter = False
    max_retries = 2
    acks_late = True

    def run(self) -> list[Any]:
        if self.request.retries < 2:
            raise TimeoutError(f"attempt {self.request.retries}")
        return [self.request.retries, self.request.eta is not None]


class Limited(app.Task):  # type: ignore[misc,name-defined]
    """Limits declared on the class: the client puts them in the message's ``timelimit``."""

    name = "taskapi.limited"
    time_limit = 30
    soft_time_limit = 20

    def run(self) -> list[Any]:
        return [self.request.time_limit, self.request.soft_time_limit]


class Unnamed(app.Task):  # type: ignore[misc,name-defined]
    """No ``name``: registered as ``<module>.<ClassName>``, as Celery names it."""

    def run(self) -> str:
        return str(self.name)


class Routed(app.Task):  # type: ignore[misc,name-defined]
    """Sent to the queue its class names (the test sets ``queue`` on the client's side)."""

    name = "taskapi.routed"

    def run(self) -> str | None:
        routing_key: str | None = self.request.delivery_info.get("routing_key")
        return routing_key


class Slowed(app.Task):  # type: ignore[misc,name-defined]
    """Given its rate limit by ``register_task``, on the instance (Celery's way of passing options)."""

    name = "taskapi.slowed"

    def run(self) -> None: ...


app.register_task(Add())
app.register_task(Backoff())
app.register_task(Routed())
app.register_task(Slowed(), rate_limit="100/m")
app.register_task(Flaky())
app.register_task(Limited())
app.register_task(Unnamed)


@app.task(bind=True, name="taskapi.request_fields")
def request_fields(self: Any) -> dict[str, Any]:
    """What the task reads of its request: the limits and the message's AMQP properties."""
    return {
        "time_limit": self.request.time_limit,
        "soft_time_limit": self.request.soft_time_limit,
        "properties": self.request.properties,
    }


@app.task(bind=True, name="taskapi.grow", default_retry_delay=0)
def grow(self: Any, foo: int, bar: int = 0) -> list[Any]:
    """Retries once with ``kwargs={"foo": foo * 10}`` only; the next call's arguments, as it saw them."""
    if self.request.retries == 0:
        raise self.retry(kwargs={"foo": foo * 10})
    return [foo, bar, list(self.request.args), dict(self.request.kwargs)]


@app.task(bind=True, name="taskapi.shrink", default_retry_delay=0)
def shrink(self: Any, foo: int, bar: int = 0) -> list[Any]:
    """Retries once with ``args=(foo - 1,)`` only."""
    if self.request.retries == 0:
        raise self.retry(args=(foo - 1,))
    return [foo, bar, list(self.request.args), dict(self.request.kwargs)]
