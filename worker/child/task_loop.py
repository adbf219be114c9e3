"""The event loop that ``async def`` tasks run on: one per pool-child thread, kept from task to task.

A child's thread (its main thread, or each consumer thread under ``--threads``) makes its loop on
its first ``async def`` task and runs every later one on it, so a client a task module caches
across tasks (an aiohttp session, a database pool) stays on the loop it was made on; a loop per
task (``asyncio.run``) would cost one per task and break such clients. The loop runs only while a
task of its thread runs: tasks a body leaves behind (``create_task`` without an await) go on
while later tasks run, and are cancelled when the child stops.

The soft time limit must not be raised where a signal or a thread's async exception would land
(in the loop's own code, breaking it): while a coroutine runs, the thread's ``SoftLimit`` hands the
exception here instead, the loop cancels the task, and the cancellation reaches the coroutine as
``SoftTimeLimitExceeded`` at the ``await`` it waits in. So ``except SoftTimeLimitExceeded`` in the
body works and its ``finally`` blocks run. A coroutine that blocks its loop in plain code sees it
at its next ``await``; the hard time limit does not depend on it.

Under ``--threads``, the worker's terminate of an ``async def`` task is a plain cancel from the
child's control thread (``cancel``): the body sees ``CancelledError`` at its await, and a run that
ends cancelled is ``TaskRevokedError("terminated")``. The child's other threads go on.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker_svc.errors import TaskRevokedError

if TYPE_CHECKING:
    from worker.child.soft_limits import SoftLimit

__all__ = ["TaskLoop"]

log = structlog.get_logger(__name__)

# How long the tasks a body left behind get to end, once cancelled, when the child stops.
_CLOSE_GRACE_S: Final = 2.0


class TaskLoop:
    """One thread's loop for ``async def`` bodies, made on first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: _Running | None = None  # the body on the loop now

    @property
    def started(self) -> bool:
        return self._loop is not None

    def run(self, coroutine: Coroutine[Any, Any, Any], soft_limit: SoftLimit, *, task_id: str = "") -> Any:
        """Run ``coroutine`` to its end on this thread's loop; its value, or its exception raised.

        It runs in a copy of the caller's context (the running request, the log's bound fields).

        Raises:
            TaskRevokedError: ``cancel(task_id)`` ended it.
            RuntimeError: it ended cancelled otherwise.
        """
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        body = _Interruptible(coroutine)

        def expire(exc: BaseException) -> None:  # from a signal handler or the limits' timer thread
            loop.call_soon_threadsafe(body.interrupt, exc)

        with soft_limit.redirected(expire):
            task = loop.create_task(body.drive(), context=contextvars.copy_context())
            self._running = running = _Running(task_id, task)
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError as exc:
                if running.terminated:
                    raise TaskRevokedError("terminated") from None
                # Not a limit (that arrives as SoftTimeLimitExceeded): the body cancelled itself or
                # awaited something cancelled. A failure of the task, not a BaseException that
                # would go past the outcome and end the child.
                raise RuntimeError(f"the task's coroutine was cancelled: {exc!r}") from exc
            finally:
                self._running = None
                if not task.done():  # the loop itself was left by an exception: never resume it
                    task.cancel()

    def cancel(self, task_id: str) -> None:
        """Cancel the body of ``task_id`` if it runs on this loop (terminate); from any thread."""
        loop = self._loop
        if loop is None:
            return  # no async task ran in this thread yet
        try:
            loop.call_soon_threadsafe(self._cancel, task_id)
        except RuntimeError:
            pass  # closed: the thread is done

    def _cancel(self, task_id: str) -> None:
        # On the loop: only the run of that id, if it still goes on (never the next task's).
        running = self._running
        if running is not None and running.task_id == task_id and not running.task.done():
            running.terminated = True
            running.task.cancel("terminated")

    def close(self) -> None:
        """Cancel what bodies left running, finish async generators, close the loop (child exit)."""
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=_CLOSE_GRACE_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:
            log.exception("task_loop_close_failed")
        finally:
            loop.close()


@dataclass(slots=True)
class _Running:
    task_id: str
    task: asyncio.Task[Any]
    terminated: bool = False


class _Interruptible:
    """Awaits a coroutine, passing everything through, except a cancellation ``interrupt`` asked
    for: that one is thrown into the coroutine as the exception ``interrupt`` was given."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        self._coroutine = coroutine
        self._task: asyncio.Task[Any] | None = None
        self._pending: BaseException | None = None

    def interrupt(self, exc: BaseException) -> None:
        # On the loop, between two steps of the task: it waits at an await (or has yet to start).
        task = self._task
        if self._pending is not None or (task is not None and task.done()):
            return  # a late limit: the body ended before the loop got to it
        self._pending = exc
        if task is not None:
            task.cancel()  # cancels what it awaits (a sleep's timer, a read), then wakes it up

    async def drive(self) -> Any:
        self._task = asyncio.current_task()
        return await self

    def __await__(self) -> Generator[Any, Any, Any]:
        # ``yield from`` by hand, so a cancellation thrown in at ``yield`` can be swapped.
        coroutine = self._coroutine
        send: Any = None
        throw, self._pending = self._pending, None  # a limit that passed before the body started
        while True:
            try:
                yielded = coroutine.send(send) if throw is None else coroutine.throw(throw)
            except StopIteration as stop:
                return stop.value
            send, throw = None, None
            try:
                send = yield yielded
            except GeneratorExit:
                coroutine.close()
                raise
            except asyncio.CancelledError as cancelled:
                throw, self._pending = (self._pending or cancelled), None
                if throw is not cancelled and self._task is not None:
                    self._task.uncancel()  # consumed here: an asyncio.timeout() in the body counts right
            except BaseException as exc:
                throw = exc
