"""The run of one task body in a pool child: its request, its signals and hooks, its done frame.

Task code may call :func:`send_update` (progress, custom states) and :func:`current_request`.
"""

from __future__ import annotations

import contextvars
import inspect
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.app import App
from broker_svc.canvas.follow_ups import runs_in_process
from broker_svc.errors import (
    Reject,
    TaskRevokedError,
)
from broker_svc.tasks.running.trace import IGNORED, REJECTED, RETRY, SUCCESS, trace
from broker_svc.tasks.task import Request, Task, executing
from broker_svc.wire.results.message import exception_to_wire, wire_exception
from worker import ipc
from worker.child.hard_limit import HardLimit
from worker.child.soft_limits import SoftLimit
from worker.child.task_loop import TaskLoop
from worker.ipc import Job, JobStatus
from worker.shared.board import BoardSlot

if TYPE_CHECKING:
    from broker_svc.tasks.task_app import TaskApp

log = structlog.get_logger(__name__)

__all__ = ["UpdateSink", "current_request", "run_job", "run_limited", "send_update"]


class UpdateSink(Protocol):
    """Where a running task's updates go: its child's publisher (``worker/consume/updates.py``)."""

    lock: threading.Lock

    def send(self, data: bytes, *, context: _JobContext | None = None) -> None: ...


@dataclass(slots=True)
class _JobContext:
    job: Job
    channel: UpdateSink
    open: bool = True


# A context variable, not a global: it is set only around a task call, so an update from outside a
# task (or from a thread the task did not hand its context to) fails loudly instead of going astray.
_current_job: contextvars.ContextVar[_JobContext | None] = contextvars.ContextVar(
    "clockwork_current_job", default=None
)


def send_update(payload: dict[str, Any]) -> None:
    """Send an update about the running task to the worker (progress, ``update_state``).

    Updates arrive in the worker in the order they were sent, and all before the task's outcome.

    Args:
        payload: a msgpack-encodable map, e.g. ``{"state": "PROGRESS", "meta": {"done": 3}}``.

    Raises:
        RuntimeError: no task is running in this context (or it has already returned).
        TypeError: ``payload`` is not a map, or msgpack cannot encode it.
        MessageTooLarge: the encoded payload is over the frame limit.
    """
    context = _current_job.get()
    if context is None:
        raise RuntimeError("send_update() works only inside a task running in a Clockwork pool child")
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    data = ipc.encode_frame({"op": "update", "task_id": context.job.task_id, "payload": payload})
    context.channel.send(data, context=context)


def current_request() -> dict[str, Any]:
    """The request context of the running task (id, retries, hostname, ... as the worker sent it).

    Raises:
        RuntimeError: no task is running in this context.
    """
    context = _current_job.get()
    if context is None:
        raise RuntimeError("current_request() works only inside a task running in a Clockwork pool child")
    return {"id": context.job.task_id, "task": context.job.task_name, **context.job.request}


def run_limited(
    app: App,
    job: Job,
    updates: UpdateSink,
    soft_limit: SoftLimit,
    watchdog: HardLimit,
    connection: FeedConnection,
    shown: BoardSlot,
    alarm: bool,
    task_loop: TaskLoop,
) -> dict[str, Any]:
    """Run ``job`` under its time limits, shown on the board while it runs; its done frame.

    The soft limit is a SIGALRM to the main thread (``alarm``), else the guard's own timer; the hard
    one the watchdog's. An async def task runs on ``task_loop``, this thread's.
    """
    if alarm and job.soft_time_limit_s:
        signal.setitimer(signal.ITIMER_REAL, job.soft_time_limit_s)
    if job.hard_time_limit_s:
        watchdog.arm(job, job.hard_time_limit_s)
    shown.start(job)  # what runs here, for the worker's inspect and terminate; ended once settled
    try:
        with connection.running():
            return run_job(app, job, updates, soft_limit, task_loop)
    finally:
        if alarm and job.soft_time_limit_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if job.hard_time_limit_s:
            watchdog.disarm()


def run_job(
    app: App, job: Job, channel: UpdateSink, soft_limit: SoftLimit, task_loop: TaskLoop
) -> dict[str, Any]:
    """Run ``job`` here, in this thread (an ``async def`` task on ``task_loop``); its done frame."""
    task = app.tasks.get(job.task_name)
    if task is None:
        return _frame(JobStatus.FAILURE, error=wire_exception("NotRegistered", job.task_name))
    context = _JobContext(job, channel)
    token = _current_job.set(context)
    request = Request.from_worker(
        job.request, task=job.task_name, args=job.args, kwargs=job.kwargs, send_update=send_update
    )
    try:
        with executing(request):
            return _call(task, request, job, soft_limit, task_loop)
    finally:
        with channel.lock:  # no update may follow the outcome
            context.open = False
        _current_job.reset(token)


def _call(
    task: Task, request: Request, job: Job, soft_limit: SoftLimit, task_loop: TaskLoop
) -> dict[str, Any]:
    def started() -> None:
        if task.track_started or task.app.conf.get("task_track_started"):  # the task's, else the app's
            send_update({"state": "STARTED", "meta": {"pid": os.getpid(), "hostname": request.hostname}})

    traced = trace(
        task, request, job.args, job.kwargs, started=started,
        guard=soft_limit.guarding(job.soft_time_limit_s),
        await_body=lambda coroutine: task_loop.run(coroutine, soft_limit, task_id=job.task_id),
    )  # fmt: skip
    if traced.state == SUCCESS:
        done = _frame(JobStatus.SUCCESS, value=traced.value)
        if request.children:
            done["children"] = request.children  # the tasks it sent, for result.children
        return done
    if traced.state == IGNORED:
        return _frame(JobStatus.IGNORED)
    error = exception_to_wire(traced.exception) if traced.exception is not None else None
    if traced.state == RETRY and traced.retry is not None:
        retry = traced.retry
        value: dict[str, Any] = {"eta": retry.eta.isoformat()}
        if retry.call_args is not None:  # retry(args=...): the next attempt's arguments
            value["args"] = list(retry.call_args)
        if retry.call_kwargs is not None:
            value["kwargs"] = retry.call_kwargs
        return _frame(JobStatus.RETRY, value=value, error=error, tb=traced.traceback)
    if traced.state == REJECTED:
        requeue = isinstance(traced.exception, Reject) and traced.exception.requeue
        return _frame(JobStatus.REJECTED, value={"requeue": requeue}, error=error, tb=traced.traceback)
    # Not for an async def task cancelled by terminate (--threads): its copy's answer, as when the
    # child dies, sends none either.
    if (
        request.errbacks
        and traced.exception is not None
        and not isinstance(traced.exception, TaskRevokedError)
    ):
        _errbacks_here(task.app, request, traced.exception, traced.traceback or "", task_loop, soft_limit)
    done = _frame(JobStatus.FAILURE, error=error, tb=traced.traceback)
    done["retries_exhausted"] = traced.retries_exhausted
    return done


def _errbacks_here(
    app: TaskApp, request: Request, exc: BaseException, tb: str, task_loop: TaskLoop, soft_limit: SoftLimit
) -> None:
    # New-style errbacks run here, in the failed task's process, with (request, exc, traceback)
    # before their own arguments, as Celery calls them; the worker sends the others as tasks.
    for errback in request.errbacks or ():
        if not runs_in_process(app, errback):
            continue
        task: Task = app.tasks[str(errback["task"])]
        try:
            called = task(request, exc, tb, *(errback.get("args") or ()), **(errback.get("kwargs") or {}))
            if inspect.iscoroutine(called):  # an async def errback: awaited on this thread's loop
                task_loop.run(called, soft_limit)
        except Exception:
            log.exception("task_errback_failed", errback=task.name)


def _frame(
    status: JobStatus, *, value: Any = None, error: Any = None, tb: str | None = None
) -> dict[str, Any]:
    return {"op": "done", "status": str(status), "value": value, "error": error, "traceback": tb}
