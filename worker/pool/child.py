"""A pool child: the blocking loop that runs one job at a time (``worker/pool/spawn.py`` starts one).

Task code may call :func:`send_update` (progress, custom states) and :func:`current_request`.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import inspect
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from broker_svc import signals
from broker_svc.app import App
from broker_svc.canvas.follow_ups import runs_in_process
from broker_svc.errors import (
    MessageTooLarge,
    Reject,
    SoftTimeLimitExceeded,
    TaskRevokedError,
)
from broker_svc.logging import configure_logging
from broker_svc.tasks.task import Request, Task, executing
from broker_svc.tasks.trace import IGNORED, REJECTED, RETRY, SUCCESS, trace
from broker_svc.wire.result_message import exception_to_wire, wire_exception
from worker.loader import SAFE_PATH_ADDED_ENV, extend_path_from_environment, load_app
from worker.pool import ipc
from worker.pool.ipc import Job, JobStatus
from worker.pool.task_loop import TaskLoop

if TYPE_CHECKING:
    from worker.feed.spec import FeedSpec

log = structlog.get_logger(__name__)

__all__ = [
    "ChildChannel",
    "SoftLimit",
    "UpdateSink",
    "current_request",
    "main",
    "run_job",
    "send_update",
]

# Imported first in the forkserver (its preload): the user's modules are found from here on, after
# ours, and a PYTHONSAFEPATH the pool set only for the forkserver does not reach task code.
extend_path_from_environment()
if os.environ.pop(SAFE_PATH_ADDED_ENV, None):
    os.environ.pop("PYTHONSAFEPATH", None)


class ChildChannel:
    """This child's end of the socket; the lock keeps an update and the done frame from interleaving."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.lock = threading.Lock()

    def send(self, data: bytes, *, context: _JobContext | None = None) -> None:
        with self.lock:
            if context is not None and not context.open:
                raise RuntimeError(f"task {context.job.task_id} has already finished; its updates are closed")
            self._sock.sendall(data)

    def readable(self) -> bool:
        """Whether a frame (or the end of the socket) is waiting to be read."""
        return bool(select.select([self._sock], [], [], 0)[0])

    def receive(self) -> dict[str, Any] | None:
        header = self._receive_exactly(ipc.HEADER.size)
        body = None if header is None else self._receive_exactly(ipc.frame_length(header))
        return None if body is None else ipc.decode_frame(body)

    def _receive_exactly(self, size: int) -> bytes | None:
        buffer = bytearray(size)
        view, received = memoryview(buffer), 0
        while received < size:
            count = self._sock.recv_into(view[received:])
            if count == 0:
                return None  # the worker closed its end (or died): time to go
            received += count
        return bytes(buffer)


class UpdateSink(Protocol):
    """Where a running task's updates go: the worker's socket, or a consuming child's publisher."""

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


class SoftLimit:
    """Turns the worker's SIGUSR1 into ``SoftTimeLimitExceeded`` inside the running task."""

    def __init__(self) -> None:
        self.armed = False
        self.limit_s: float | None = None
        self._interrupt: Callable[[BaseException], None] | None = None

    def arm(self, limit_s: float | None) -> None:
        self.limit_s, self.armed = limit_s, True

    def disarm(self) -> None:
        self.armed = False

    def guarding(self, limit_s: float | None) -> AbstractContextManager[None]:
        """Armed while the body runs, disarmed however it ends."""
        return _Armed(self, limit_s)

    @contextlib.contextmanager
    def redirected(self, interrupt: Callable[[BaseException], None]) -> Iterator[None]:
        """While an ``async def`` body runs on its loop: give the exception to ``interrupt`` (which
        cancels the coroutine from the loop) rather than raise it where the thread is, which may
        be the loop's own code (``worker/pool/task_loop.py``)."""
        self._interrupt = interrupt
        try:
            yield
        finally:
            self._interrupt = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A signal that lands after the task ended is moot: the worker sent it at the deadline
        # while the done frame was on its way. Disarm first so a second signal cannot raise twice.
        if self.armed:
            self.armed = False
            exc = SoftTimeLimitExceeded(f"soft time limit ({self.limit_s:g} s) exceeded")
            if self._interrupt is not None:
                self._interrupt(exc)  # only schedules the cancel: safe from a signal handler
                return
            raise exc


class _Armed:
    # SoftLimit.guarding's: a class, not a generator, as it is entered once per task.
    __slots__ = ("_limit", "_limit_s")

    def __init__(self, limit: SoftLimit, limit_s: float | None) -> None:
        self._limit, self._limit_s = limit, limit_s

    def __enter__(self) -> None:
        self._limit.arm(self._limit_s)

    def __exit__(self, *exc: object) -> None:
        self._limit.disarm()


def main(app_spec: str, sock: socket.socket, feed: FeedSpec | None = None) -> None:
    """Run jobs until the worker closes the socket; the target of the pool's ``Process``.

    Args:
        app_spec: ``package.module:attr`` of the app whose tasks this child runs.
        sock: this child's end of the socket pair.
        feed: consume these queues here instead of taking jobs from the worker (``worker/feed``).
    """
    # What the forkserver imported is shared with it until written: keep the collector from walking
    # (and so writing to) those objects, which would copy their pages into every child.
    gc.freeze()
    # Ctrl-C reaches the whole process group; the worker alone decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A child is an entry point of its own: hook failures and task logs use the worker's level.
    configure_logging(os.environ.get("CLOCKWORK_LOGLEVEL", "info"))
    soft_limit = SoftLimit()
    signal.signal(signal.SIGUSR1, soft_limit.on_signal)
    sock.setblocking(True)
    channel = ChildChannel(sock)
    task_loop = TaskLoop()  # for async def tasks, made on the first
    try:
        try:
            app = load_app(app_spec)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            channel.send(
                ipc.encode_frame({"op": "error", "message": message, "traceback": traceback.format_exc()})
            )
            raise SystemExit(1) from None
        signals.worker_process_init.send(sender=None)
        channel.send(ipc.encode_frame({"op": "ready", "pid": os.getpid()}))
        _exit_with_the_worker()
        if feed is not None:
            from worker.feed.child import serve  # only a consuming child loads pika

            serve(app, feed, channel, soft_limit)
            return
        while (frame := channel.receive()) is not None:
            job = Job.from_frame(frame)
            started = time.monotonic()
            try:
                done = run_job(app, job, channel, soft_limit, task_loop)
            except SoftTimeLimitExceeded as exc:  # landed between the task's end and disarming
                done = _failure(exc, "")
            done["runtime_s"] = time.monotonic() - started
            channel.send(_encode_done(done, job))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker is gone; so are we
    finally:
        task_loop.close()
        sock.close()


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
        if task.track_started:
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
    app: App, request: Request, exc: BaseException, tb: str, task_loop: TaskLoop, soft_limit: SoftLimit
) -> None:
    # New-style errbacks run here, in the failed task's process, with (request, exc, traceback)
    # before their own arguments, as Celery calls them; the worker sends the others as tasks.
    for errback in request.errbacks or ():
        if not runs_in_process(app, errback):
            continue
        task = app.tasks[str(errback["task"])]
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


def _failure(exc: BaseException, tb: str) -> dict[str, Any]:
    return _frame(JobStatus.FAILURE, error=exception_to_wire(exc), tb=tb or None)


def _encode_done(done: dict[str, Any], job: Job) -> bytes:
    try:
        return ipc.encode_frame(done)
    except (TypeError, MessageTooLarge) as exc:
        # The task ran but its result cannot travel: report that as its failure, and keep serving.
        message = f"cannot encode the result of task {job.task_name} ({job.task_id}) with msgpack: {exc}"
        fallback = _frame(JobStatus.FAILURE, error=ipc.encode_error(message))
        fallback["runtime_s"] = done.get("runtime_s", 0.0)
        return ipc.encode_frame(fallback)


def _exit_with_the_worker() -> None:
    # A busy child would otherwise run its task to the end before it saw the closed socket. The
    # forkserver cannot tell us (children keep it alive), but multiprocessing gives each child the
    # read end of a pipe whose write end only the worker holds: end of file there means it is gone.
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        while True:
            select.select([sentinel], [], [])
            if not os.read(sentinel, 4096):
                os._exit(1)

    # The thread starts with every signal blocked, so SIGUSR1 always interrupts the main thread's
    # blocking calls (a signal delivered to another thread would not wake a task's sleep()).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=watch, name="clockwork-orphan-watch", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
