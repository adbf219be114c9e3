"""The worker's process pool: task bodies run in child processes, one job per idle child (fair dispatch)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from broker_svc.errors import BrokerSvcError, MessageTooLarge
from worker.loader import SAFE_PATH_ADDED_ENV, load_app, split_spec
from worker.pool import child as child_module
from worker.pool import ipc
from worker.pool.feeding import Feeding
from worker.pool.handle import EXIT_GRACE_S, ChildHandle
from worker.pool.ipc import Job, JobOutcome, JobStatus
from worker.pool.spawn import PoolStartError, go_without_resource_tracker
from worker.pool.supervisor import ChildSupervisor

if TYPE_CHECKING:
    from worker.feed.spec import FeedSpec

__all__ = ["Job", "JobOutcome", "JobStatus", "PoolClosedError", "PoolStartError", "ProcessPool"]

log = structlog.get_logger(__name__)


class PoolClosedError(BrokerSvcError, RuntimeError):
    """The pool is closing or closed and takes no more jobs."""


class ProcessPool(ChildSupervisor):
    """``concurrency`` child processes that run task bodies for an asyncio worker.

    A job goes only to an idle child, so a long task never holds short ones hostage. A child that
    dies, passes its hard time limit or is terminated is replaced at once. ``grow()`` and
    ``shrink()`` change how many children it keeps (``target``); shrinking retires idle children
    at once and busy ones when their job ends, never a running task. Each child's slot (start,
    serve, reap, replace) is ``worker.pool.supervisor.ChildSupervisor``.

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
        self._slot_indexes: set[int] = set()  # held by live slots: a consuming child's board slot
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
        """Jobs running, retiring children's not counted (as ``size`` counts them).

        One per busy child, but a consuming child with ``--threads`` runs one per thread.
        """
        kept = {pid for pid, c in self._children.items() if not c.retired}
        return sum(1 for pid in self.running().values() if pid in kept)

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
        # Consuming children also share their loop's modules with the server (copy-on-write), instead
        # of each importing its own copy after the fork.
        feed = ["worker.feed.child"] if self.feeding is not None else []
        go_without_resource_tracker()
        self._context.set_forkserver_preload([child_module.__name__, *feed, split_spec(self._app_spec)[0]])
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

        Consuming children (``feed``) are told to retire at once, idle ones first: each stops
        consuming, hands back what it holds and has not started, ends its task and exits.

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
        if self.feeding is not None:
            self._retire_consuming()
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

    def _retire_consuming(self) -> None:
        """Pick consuming children to retire: one leaving anyway (past its limits), then idle, then busy.

        A child still starting is not picked: its slot retires it when it joins (``_serve``).
        """
        assert self.feeding is not None
        busy = {entry.pid for entry in self.feeding.running()}
        kept = [c for c in self._children.values() if not c.retired]
        for child in sorted(kept, key=lambda c: (not c.recycled, c.pid in busy)):
            if not self._to_retire:
                return
            self._to_retire -= 1
            child.retired = True  # its slot ends with it: no replacement
            if not child.recycled:  # one past its limits is on its way out already
                self.feeding.retire(child.slot)
            log.info("pool_child_retiring", pid=child.pid, busy=child.pid in busy)

    def _signal(self, child: ChildHandle, sig: int, status: JobStatus | None = None) -> None:
        if self._children.get(child.pid) is not child:
            return  # gone already: never signal a pid that may have been reused
        child.kill_status = child.kill_status or status
        child.doomed = child.doomed or sig == signal.SIGKILL
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)
