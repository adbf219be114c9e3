"""The worker's process pool: task bodies run in child processes, one job per idle child (fair dispatch)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker_svc.errors import BrokerSvcError, DecodeError, MessageTooLarge
from worker.loader import SAFE_PATH_ADDED_ENV, load_app, split_spec
from worker.pool import child as child_module
from worker.pool import ipc
from worker.pool.child import PoolStartError
from worker.pool.feeding import Feeding
from worker.pool.handle import EXIT_GRACE_S, ChildHandle
from worker.pool.ipc import Job, JobOutcome, JobStatus

if TYPE_CHECKING:
    from worker.feed.spec import FeedSpec

__all__ = ["Job", "JobOutcome", "JobStatus", "PoolClosedError", "PoolStartError", "ProcessPool"]

log = structlog.get_logger(__name__)

# Back-off between failed attempts to replace a child (the app stopped importing, no memory, ...).
_RESPAWN_DELAY_S: Final = (0.5, 30.0)


class PoolClosedError(BrokerSvcError, RuntimeError):
    """The pool is closing or closed and takes no more jobs."""


class ProcessPool:
    """``concurrency`` child processes that run task bodies for an asyncio worker.

    A job goes only to an idle child, so a long task never holds short ones hostage. A child that
    dies, passes its hard time limit or is terminated is replaced at once. ``grow()`` and
    ``shrink()`` change how many children it keeps (``target``); shrinking retires idle children
    at once and busy ones when their job ends, never a running task.

    Args:
        app_spec: ``package.module:attr`` of the app (``package.module`` means attribute ``app``).
        concurrency: number of children.
        on_update: called in the event loop with ``(task_id, payload)`` for each ``send_update``.
        start_timeout_s: how long a child may take to import the app and report ready.
        max_tasks_per_child: replace a child after this many jobs (Celery's option of that name).
        max_memory_per_child_kib: replace a child whose resident memory passed this after a job.
        feed: each child consumes for itself with these orders (``worker/feed``); no jobs go out.
        exit_grace_s: how long a child told to stop may take to exit before it is killed.

    Raises:
        ValueError: a malformed ``app_spec``, or ``concurrency < 1``.
    """

    def __init__(
        self,
        *,
        app_spec: str,
        concurrency: int,
        on_update: Callable[[str, dict[str, Any]], None] | None = None,
        start_timeout_s: float = 60.0,
        max_tasks_per_child: int | None = None,
        max_memory_per_child_kib: int | None = None,
        feed: FeedSpec | None = None,
        exit_grace_s: float = EXIT_GRACE_S,
    ) -> None:
        split_spec(app_spec)
        # Children consume for themselves (worker/feed): no jobs from here.
        self.feeding = Feeding(feed, slots=concurrency) if feed is not None else None
        # How long a closed child may take to exit: a consuming child finishes its task first.
        self._exit_grace_s = exit_grace_s
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        for label, limit in (("max_tasks_per_child", max_tasks_per_child),
                             ("max_memory_per_child_kib", max_memory_per_child_kib)):  # fmt: skip
            if limit is not None and limit < 1:
                raise ValueError(f"{label} must be at least 1, got {limit}")
        self._max_tasks, self._max_memory_kib = max_tasks_per_child, max_memory_per_child_kib
        self._app_spec, self._concurrency = app_spec, concurrency
        self._on_update, self._start_timeout_s = on_update, start_timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._children: dict[int, ChildHandle] = {}  # ready children, idle or busy, by pid
        self._idle: collections.deque[ChildHandle] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[ChildHandle]] = collections.deque()
        self._slots: list[asyncio.Task[None]] = []
        self._closing = asyncio.Event()  # also wakes slots backing off between failed restarts
        # Each slot keeps one child alive: live slots == target + children still due to retire.
        self._target = concurrency
        self._to_retire = 0

    @property
    def size(self) -> int:
        """Children up and ready, retiring ones not counted (one less while a replacement starts)."""
        return sum(1 for c in self._children.values() if not c.retired)

    @property
    def target(self) -> int:
        """How many children the pool keeps: ``concurrency``, then as ``grow()``/``shrink()`` left it."""
        return self._target

    @property
    def idle_count(self) -> int:
        """Children waiting for a job."""
        return len(self._idle)

    @property
    def busy_count(self) -> int:
        """Children running a job."""
        return len(self.running())

    def pids(self) -> list[int]:
        """Process ids of the ready children (for inspect ``stats``: ``pool.processes``)."""
        return [pid for pid, c in self._children.items() if not c.retired]

    def running(self) -> dict[str, int]:
        """``task_id -> child pid`` of every running job (for inspect ``active``)."""
        running = {c.job.task_id: c.pid for c in self._children.values() if c.job is not None}
        if self.feeding is not None:
            running.update((str(e.info.get("id")), e.pid) for e in self.feeding.running())
        return running

    async def start(self) -> None:
        """Start every child and wait until each has loaded the app.

        Raises:
            RuntimeError: the pool was started (or closed) before.
            ValueError: ``app_spec`` does not name a ``broker_svc.App``.
            ImportError: the app's module or attribute cannot be imported.
            PoolStartError: a child could not load the app, or did not report ready in time.
        """
        if self._slots or self._closing.is_set():
            raise RuntimeError("a ProcessPool can be started only once")
        # Importing here first gives the user's own error, and keeps a module that fails to import
        # out of the forkserver (which survives only ImportError while preloading).
        await asyncio.to_thread(load_app, self._app_spec)
        # Children fork from a server that already imported the app, so replacements start fast and
        # never inherit this process's event loop or sockets. There is one forkserver per process:
        # if it is already running, its preload list stays as it was.
        self._context.set_forkserver_preload([child_module.__name__, split_spec(self._app_spec)[0]])
        loop = asyncio.get_running_loop()
        first_starts: list[asyncio.Future[None]] = [loop.create_future() for _ in range(self._concurrency)]
        # The forkserver runs ``python -c``, which puts the current directory first on its path,
        # where a user's ``worker.py`` would replace our package: PYTHONSAFEPATH keeps it off (the
        # children drop it again, and find the user's modules last: worker.pool.child).
        added = "PYTHONSAFEPATH" not in os.environ
        if added:
            os.environ["PYTHONSAFEPATH"] = "1"
            os.environ[SAFE_PATH_ADDED_ENV] = "1"
        for ready in first_starts:
            self._add_slot(ready)
        try:
            await asyncio.gather(*first_starts)
        except BaseException:
            await self.close(timeout_s=0)
            for ready in first_starts:  # retrieve every failure, not only the first
                if ready.done() and not ready.cancelled():
                    ready.exception()
            raise
        finally:
            if added:  # the forkserver has started: nothing else this process starts gets it
                os.environ.pop("PYTHONSAFEPATH", None)
                os.environ.pop(SAFE_PATH_ADDED_ENV, None)

    def grow(self, n: int = 1) -> None:
        """Keep ``n`` more children; each takes jobs once it has loaded the app.

        A child still waiting to retire (its job runs on after a ``shrink()``) stays instead of a
        new one starting.

        Raises:
            ValueError: ``n < 0``.
            RuntimeError: the pool was not started.
            PoolClosedError: the pool is closing or closed.
        """
        if n < 0:
            raise ValueError(f"n must not be negative, got {n}")
        if self._closing.is_set():
            raise PoolClosedError("the process pool is closed")
        if not self._slots:
            raise RuntimeError("start() the pool before growing it")
        self._target += n
        kept = min(n, self._to_retire)
        self._to_retire -= kept
        self._slots = [slot for slot in self._slots if not slot.done()]
        for _ in range(n - kept):
            self._add_slot(None)
        log.debug("pool_grow", n=n, target=self._target)

    def shrink(self, n: int = 1) -> int:
        """Keep ``n`` fewer children, never fewer than one: idle ones exit now, busy ones after their job.

        Returns:
            How many children go (``n``, or fewer to keep one).

        Raises:
            ValueError: ``n < 0``.
            PoolClosedError: the pool is closing or closed.
        """
        if n < 0:
            raise ValueError(f"n must not be negative, got {n}")
        if self._closing.is_set():
            raise PoolClosedError("the process pool is closed")
        n = min(n, self._target - 1)
        self._target -= n
        self._to_retire += n
        while self._to_retire and self._idle:
            self._retire(self._idle.popleft())
        log.debug("pool_shrink", n=n, target=self._target)
        return n

    async def run(self, job: Job) -> JobOutcome:
        """Run ``job`` in the next idle child and return how it ended.

        Task errors, time limits and dead children are outcomes, not exceptions. Cancelling the
        caller while it waits for a child leaks nothing; once the job runs, it keeps running.

        Raises:
            PoolClosedError: the pool is closing or closed.
        """
        child = await self._acquire()
        try:
            data = ipc.encode_frame(job.to_frame())
        except (TypeError, MessageTooLarge) as exc:
            self._release(child)
            message = f"cannot send task {job.task_name} ({job.task_id}) to a pool child: {exc}"
            return JobOutcome(JobStatus.FAILURE, error=ipc.encode_error(message), pid=child.pid)
        loop = asyncio.get_running_loop()
        child.job, child.outcome, child.started_at = job, loop.create_future(), loop.time()
        if job.soft_time_limit_s is not None:
            child.timers.append(loop.call_later(job.soft_time_limit_s, self._signal, child, signal.SIGUSR1))
        if job.hard_time_limit_s is not None:
            hard = (child, signal.SIGKILL, JobStatus.TIME_LIMIT)
            child.timers.append(loop.call_later(job.hard_time_limit_s, self._signal, *hard))
        # One frame per idle child, so no drain(): a broken socket shows up as EOF in _serve.
        child.writer.write(data)
        # Shielded: a cancelled caller must not cancel the bookkeeping of a job the child still runs.
        return await asyncio.shield(child.outcome)

    async def terminate(self, task_id: str, sig: int = signal.SIGTERM) -> bool:
        """Signal the child running ``task_id`` (revoke with terminate); its outcome is TERMINATED.

        Returns once the signal is sent. A task that catches ``sig`` and returns keeps its own outcome.

        Returns:
            True if the task was running here and its child was signalled.

        Raises:
            ValueError: ``sig`` is not a signal number.
        """
        for child in self._children.values():
            if child.job is not None and child.job.task_id == task_id:
                self._signal(child, signal.Signals(sig), JobStatus.TERMINATED)
                return True
        return self.feeding is not None and self.feeding.terminate(task_id, sig)

    async def close(self, *, timeout_s: float) -> None:
        """Take no more jobs; give running ones ``timeout_s``, kill the rest (LOST); stop all children.

        Safe to call more than once, and after a failed start.
        """
        self._closing.set()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosedError("the process pool is closing"))
        running = [c.outcome for c in self._children.values() if c.outcome is not None]
        if running:
            await asyncio.wait(running, timeout=max(timeout_s, 0.0))
        for child in list(self._children.values()):
            if child.job is not None:
                self._signal(child, signal.SIGKILL, JobStatus.LOST)
            child.writer.close()  # EOF: an idle child exits, and its slot reaps it
        if self._slots:
            # A slot starting a child waits for it in a thread, which cancelling would not stop.
            _, stuck = await asyncio.wait(self._slots, timeout=self._start_timeout_s + 2 * self._exit_grace_s)
            for slot in stuck:
                slot.cancel()
            await asyncio.gather(*self._slots, return_exceptions=True)
        if self.feeding is not None:
            self.feeding.close()

    # -- dispatch ---------------------------------------------------------------------------------

    async def _acquire(self) -> ChildHandle:
        if self._closing.is_set():
            raise PoolClosedError("the process pool is closed")
        if self._idle:
            return self._idle.popleft()
        waiter: asyncio.Future[ChildHandle] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            elif waiter.exception() is None:
                self._release(waiter.result())  # handed a child as we were cancelled: pass it on
            raise

    def _release(self, child: ChildHandle) -> None:
        if child.doomed:
            return  # SIGKILLed; its slot reaps it
        if self._worn_out(child):
            child.recycled = True
            child.writer.close()  # EOF: it exits, and its slot starts a fresh one
            return
        if self._to_retire and not self._closing.is_set():
            self._retire(child)  # the pool shrank: the first child to come free goes
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(child)
                return
        self._idle.append(child)

    def _worn_out(self, child: ChildHandle) -> bool:
        # Checked as a job ends, never during one: the task that passed a limit completes first.
        if self._max_tasks is not None and child.jobs_done >= self._max_tasks:
            log.info("pool_child_recycled", pid=child.pid, reason="max_tasks_per_child", jobs=child.jobs_done)
            return True
        if self._max_memory_kib is not None and child.jobs_done:
            rss_kib = child.resident_kib()
            if rss_kib is not None and rss_kib > self._max_memory_kib:
                log.info("pool_child_recycled", pid=child.pid, reason="max_memory_per_child", rss_kib=rss_kib)
                return True
        return False

    def _retire(self, child: ChildHandle) -> None:
        """Tell an idle child to exit (EOF on its socket); its slot ends once it is reaped."""
        self._to_retire -= 1
        child.retired = True
        child.writer.close()

    def _signal(self, child: ChildHandle, sig: int, status: JobStatus | None = None) -> None:
        if self._children.get(child.pid) is not child:
            return  # gone already: never signal a pid that may have been reused
        child.kill_status = child.kill_status or status
        child.doomed = child.doomed or sig == signal.SIGKILL
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)

    # -- children ---------------------------------------------------------------------------------

    def _add_slot(self, first_start: asyncio.Future[None] | None) -> None:
        slot = asyncio.create_task(self._keep_slot(first_start, index=len(self._slots)))
        slot.add_done_callback(_report_crash)
        self._slots.append(slot)

    async def _keep_slot(self, first_start: asyncio.Future[None] | None, *, index: int) -> None:
        """Keep one child alive: start it, serve it until it exits, replace it; until close() or shrink().

        Args:
            first_start: resolved when the first child is ready, or failed if it cannot start
                (``start()`` waits for it); None for a slot added by ``grow()``, which retries.
        """
        delay_s = _RESPAWN_DELAY_S[0]
        while not self._closing.is_set():
            if self._to_retire and (first_start is None or first_start.done()):
                self._to_retire -= 1  # the pool shrank while this slot had no child: end it
                return
            begun = asyncio.get_running_loop().time()
            try:
                process, sock = await asyncio.to_thread(
                    child_module.spawn,
                    self._context,
                    self._app_spec,
                    timeout_s=self._start_timeout_s,
                    feed=self.feeding.spec_for(index) if self.feeding is not None else None,
                )
            except PoolStartError as exc:
                if first_start is not None and not first_start.done():
                    first_start.set_exception(exc)
                    return
                log.error("pool_child_start_failed", error=str(exc), retry_in_s=delay_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), delay_s)
                delay_s = min(delay_s * 2, _RESPAWN_DELAY_S[1])
                continue
            reader, writer = await asyncio.open_connection(sock=sock)
            start_ms = round((asyncio.get_running_loop().time() - begun) * 1000, 1)
            log.debug("pool_child_started", pid=process.pid, start_ms=start_ms)
            if first_start is not None and not first_start.done():
                first_start.set_result(None)
            delay_s = _RESPAWN_DELAY_S[0]
            child = ChildHandle(process=process, pid=process.pid or 0, reader=reader, writer=writer)
            await self._serve(child, index)
            if child.retired:
                return

    async def _serve(self, child: ChildHandle, index: int) -> None:
        """Hand the child out for jobs and relay its frames until it exits; then settle its job."""
        self._children[child.pid] = child
        if self._closing.is_set():
            child.writer.close()
        elif self.feeding is None:
            self._release(child)
        else:
            self.feeding.joined(index, child.writer)
        try:
            while (frame := await child.next_frame()) is not None:
                self._on_frame(child, frame)
        except (DecodeError, MessageTooLarge) as exc:
            log.error("pool_child_protocol_error", pid=child.pid, error=str(exc))
        finally:
            with contextlib.suppress(ValueError):
                self._idle.remove(child)
            exitcode = await child.reap(grace_s=self._exit_grace_s)
            if self.feeding is not None:
                self.feeding.left(index)
            if self._children.get(child.pid) is child:
                del self._children[child.pid]
            if child.job is not None:
                runtime_s = asyncio.get_running_loop().time() - child.started_at
                outcome = JobOutcome.for_dead_child(
                    child.job, child.kill_status, exitcode=exitcode, runtime_s=runtime_s, pid=child.pid
                )
                child.settle(outcome)
            elif child.retired or child.recycled:
                log.debug("pool_child_retired", pid=child.pid, exit=ipc.describe_exit(exitcode))
            elif not self._closing.is_set():
                log.warning("pool_child_died_idle", pid=child.pid, exit=ipc.describe_exit(exitcode))

    def _on_frame(self, child: ChildHandle, frame: dict[str, Any]) -> None:
        job, op = child.job, frame["op"]
        if op == "update":
            payload = frame.get("payload")
            matches = job is not None and frame.get("task_id") == job.task_id
            if matches and self._on_update is not None and isinstance(payload, dict):
                try:
                    self._on_update(frame["task_id"], payload)
                except Exception:  # a broken hook must not take the child's job down with it
                    log.exception("pool_on_update_failed", task_id=frame["task_id"])
        elif op == "retiring" and self.feeding is not None:
            child.recycled = True  # a consuming child past its limits: its slot starts another
        elif op == "done" and job is not None:
            child.jobs_done += 1
            child.settle(JobOutcome.from_frame(frame, pid=child.pid))
            self._release(child)
        else:
            raise DecodeError(f"unexpected {op!r} frame from pool child {child.pid}")


def _report_crash(slot: asyncio.Task[None]) -> None:
    # A slot ends only at close(); one that crashed (a bug) no longer replaces its children.
    if not slot.cancelled() and slot.exception() is not None:
        log.error("pool_slot_crashed", exc_info=slot.exception())
