"""``Task.apply()``: run a task here and now, as Celery's eager mode does (the usual test idiom).

The body runs in this process through ``broker_svc.tasks.running.trace``, with the same signals
and hooks as in a worker. ``retry()`` runs it again at once (countdowns are not waited for),
until it succeeds or its retries run out. Nothing touches the broker, unless the task itself sends tasks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from broker_svc.errors import TaskError
from broker_svc.tasks.request import Request, executing
from broker_svc.tasks.running.trace import (
    FAILURE,
    IGNORED,
    REJECTED,
    RETRY,
    SUCCESS,
    Traced,
    TracedTask,
    trace,
)
from broker_svc.wire.ids import uuid4_str

if TYPE_CHECKING:
    from broker_svc.tasks.task_app import TaskApp

__all__ = ["EagerResult", "EagerTask", "apply"]


class EagerTask(TracedTask, Protocol):
    """What a run here reads of a task (a ``Task``): its name, and its app's ``task_eager_propagates``."""

    @property
    def name(self) -> str: ...

    @property
    def app(self) -> TaskApp: ...


class EagerResult:
    """The result of a run that already happened here (Celery's ``EagerResult``)."""

    def __init__(self, task_id: str, traced: Traced, *, task_name: str) -> None:
        self.id = task_id
        self.task_name = task_name
        self.parent = None
        self._traced = traced

    def __repr__(self) -> str:
        return f"<EagerResult: {self.id}>"

    @property
    def task_id(self) -> str:
        return self.id

    @property
    def state(self) -> str:
        """``SUCCESS`` or ``FAILURE`` (a rejected run counts as failed; an ignored one as done)."""
        return self._traced.state if self._traced.state in (SUCCESS, FAILURE) else _STATE[self._traced.state]

    status = state

    @property
    def result(self) -> Any:
        """The return value, or the exception for a failure."""
        return self._traced.value if self._traced.state == SUCCESS else self._traced.exception

    @property
    def traceback(self) -> str | None:
        return self._traced.traceback

    def ready(self) -> bool:
        return True

    def successful(self) -> bool:
        return self._traced.state == SUCCESS

    def failed(self) -> bool:
        return self.state == FAILURE

    def get(self, timeout: float | None = None, propagate: bool = True, **_: Any) -> Any:
        """The value; with ``propagate``, a failure raises its own exception (as Celery's eager get)."""
        del timeout
        if self._traced.state == SUCCESS or self._traced.state == IGNORED:
            return self._traced.value
        error = self._traced.exception
        if error is None:  # pragma: no cover - every failing state carries its error
            error = TaskError(f"task {self.task_name} failed")
        if propagate:
            raise error
        return error

    wait = get

    def forget(self) -> None:
        """Nothing is held elsewhere."""


_STATE = {IGNORED: "IGNORED", REJECTED: FAILURE, RETRY: RETRY}


def apply(
    task: EagerTask,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    throw: bool | None = None,
    **options: Any,
) -> EagerResult:
    """Run ``task`` here, retrying at once on ``retry()``; its result.

    Args:
        throw: raise a failure at once (default: the app's ``task_eager_propagates``).
        **options: send options; ``task_id``, ``retries`` and ``headers`` are honoured, the
            others (queue, countdown, ...) mean nothing for a run in this process.
    """
    task_id = options.get("task_id") or uuid4_str()
    call_args, call_kwargs = list(args or ()), dict(kwargs or {})
    retries = int(options.get("retries", 0))
    while True:
        request = Request(
            id=task_id, task=task.name, args=call_args, kwargs=call_kwargs, retries=retries,
            hostname="eager", called_directly=False, is_eager=True, **_eager_stamps(options),
        )  # fmt: skip
        with executing(request):
            traced = trace(task, request, call_args, call_kwargs)
        if traced.state != RETRY:
            break
        if traced.retry is not None and traced.retry.call_args is not None:
            call_args = list(traced.retry.call_args)
        if traced.retry is not None and traced.retry.call_kwargs is not None:
            call_kwargs = dict(traced.retry.call_kwargs)
        retries += 1  # Celery's eager retry: again, now; retry() raises once none are left
    if throw is None:
        throw = bool(task.app.conf.get("task_eager_propagates", False))
    if throw and traced.state in (FAILURE, REJECTED) and traced.exception is not None:
        raise traced.exception
    return EagerResult(task_id, traced, task_name=task.name)


def _eager_stamps(options: Mapping[str, Any]) -> dict[str, Any]:
    # Celery's eager request: each stamp's value as a list (a run here sends no message).
    names = options.get("stamped_headers")
    if names is None:
        return {}
    listed = list(names) if isinstance(names, list | tuple) else [names]
    stamps = {name: _maybe_list(options.get(name, [])) for name in listed}
    return {"stamped_headers": listed, "stamps": stamps}


def _maybe_list(value: Any) -> Any:
    return value if value is None or isinstance(value, list | tuple) else [value]
