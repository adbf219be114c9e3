"""The worker's process pool: consuming children, started, resized, replaced and stopped."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import structlog

from broker_svc.errors import BrokerSvcError
from worker.child.spec import FeedSpec
from worker.loader import FORKSERVER_ENV, SAFE_PATH_ADDED_ENV, load_app, split_spec
from worker.pool.feeding import Feeding
from worker.pool.handle import EXIT_GRACE_S, ChildHandle
from worker.pool.spawn import PoolStartError, go_without_resource_tracker
from worker.pool.supervisor import ChildSupervisor

__all__ = ["PoolClosedError", "PoolStartError", "ProcessPool"]

log = structlog.get_logger(__name__)


class PoolClosedError(BrokerSvcError, RuntimeError):
    """The pool is closing or closed."""


class ProcessPool(ChildSupervisor):
    """``concurrency`` consuming children: each consumes, runs and settles its own tasks.

    A child that dies, passes its hard time limit or is terminated is replaced at once; one past
    its task or memory limit retires itself and is replaced. ``grow()`` and ``shrink()`` change how
    many children it keeps (``target``); shrinking tells children to retire, idle ones first, and
    never kills a running task. Each child's slot (start, serve, reap, replace) is
    ``worker.pool.supervisor.ChildSupervisor``; what the children are told and what they run is
    ``feeding`` (``worker.pool.feeding.Feeding``).

    Args:
        app_spec: ``package.module:attr`` of the app (``package.module`` means attribute ``app``).
        concurrency: number of children.
        feed: what each child is told at start: where to connect, what to consume (``worker/child``).
        start_timeout_s: how long a child may take to import the app and report ready.
        exit_grace_s: how long a child told to stop may take to exit before it is killed (it
            finishes the task it runs first).

    Raises:
        ValueError: a malformed ``app_spec``, or ``concurrency < 1``.
    """

    def __init__(
        self,
        *,
        app_spec: str,
        concurrency: int,
        feed: FeedSpec,
        start_timeout_s: float = 60.0,
        exit_grace_s: float = EXIT_GRACE_S,
    ) -> None:
        split_spec(app_spec)
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.feeding = Feeding(feed, slots=concurrency)
        self._exit_grace_s = exit_grace_s
        self._app_spec, self._concurrency = app_spec, concurrency
        self._start_timeout_s = start_timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._children: dict[int, ChildHandle] = {}  # ready children by pid
        self._slots: list[asyncio.Task[None]] = []
        self._slot_indexes: set[int] = set()  # held by live slots: a child's board slot
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
    def busy_count(self) -> int:
        """Tasks running, retiring children's not counted (as ``size`` counts them).

        One per busy child, but a child with ``--threads`` runs one per thread.
        """
        kept = {pid for pid, c in self._children.items() if not c.retired}
        return sum(1 for pid in self.running().values() if pid in kept)

    def pids(self) -> list[int]:
        """Process ids of the ready children (for inspect ``stats``: ``pool.processes``)."""
        return [pid for pid, c in self._children.items() if not c.retired]

    def running(self) -> dict[str, int]:
        """``task_id -> child pid`` of every running task (from the board)."""
        return {str(e.info.get("id")): e.pid for e in self.feeding.running()}

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
        # The child's entry imports its whole loop, shared with the server (copy-on-write), instead
        # of each child importing its own copy after the fork.
        go_without_resource_tracker()
        self._context.set_forkserver_preload(["worker.child.main", split_spec(self._app_spec)[0]])
        loop = asyncio.get_running_loop()
        first_starts: list[asyncio.Future[None]] = [loop.create_future() for _ in range(self._concurrency)]
        # The forkserver runs ``python -c``, which puts the current directory first on its path,
        # where a user's ``worker.py`` would replace our package: PYTHONSAFEPATH keeps it off (the
        # children drop it again, and find the user's modules last: worker.child.main).
        added = "PYTHONSAFEPATH" not in os.environ
        if added:
            os.environ["PYTHONSAFEPATH"] = "1"
            os.environ[SAFE_PATH_ADDED_ENV] = "1"
        os.environ[FORKSERVER_ENV] = "1"
        for ready in first_starts:
            self._add_slot(ready)
        try:
            await asyncio.gather(*first_starts)
        except BaseException:
            await self.close()
            for ready in first_starts:  # retrieve every failure, not only the first
                if ready.done() and not ready.cancelled():
                    ready.exception()
            raise
        finally:
            os.environ.pop(FORKSERVER_ENV, None)  # the forkserver has started: nothing else gets these
            if added:
                os.environ.pop("PYTHONSAFEPATH", None)
                os.environ.pop(SAFE_PATH_ADDED_ENV, None)

    def grow(self, n: int = 1) -> None:
        """Keep ``n`` more children; each consumes once it has loaded the app.

        A child not yet told to retire after a ``shrink()`` (it was still starting) stays instead
        of a new one starting.

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
        """Keep ``n`` fewer children, never fewer than one.

        Children are told to retire at once, idle ones first: each stops consuming, hands back
        what it holds and has not started, ends its task and exits.

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
        self._retire_some()
        log.debug("pool_shrink", n=n, target=self._target)
        return n

    async def terminate(self, task_id: str, sig: int = signal.SIGTERM) -> bool:
        """Signal the child running ``task_id`` (revoke with terminate); its copy is answered terminated.

        Returns once the signal is sent (under ``--threads``, an ``async def`` task is cancelled in
        its thread instead: ``Feeding.terminate``).

        Returns:
            True if the task was running here and its child was signalled.

        Raises:
            ValueError: ``sig`` is not a signal number.
        """
        return self.feeding.terminate(task_id, signal.Signals(sig))

    async def close(self) -> None:
        """Stop every child: each finishes the task it runs (within the exit grace) and hands back the rest.

        Safe to call more than once, and after a failed start.
        """
        self._closing.set()
        for child in list(self._children.values()):
            child.writer.close()  # EOF: the child stops consuming, ends its task and exits
        if self._slots:
            # A slot starting a child waits for it in a thread, which cancelling would not stop.
            _, stuck = await asyncio.wait(self._slots, timeout=self._start_timeout_s + 2 * self._exit_grace_s)
            for slot in stuck:
                slot.cancel()
            await asyncio.gather(*self._slots, return_exceptions=True)
        self.feeding.close()

    def _retire_some(self) -> None:
        """Pick children to retire: one leaving anyway (past its limits), then idle, then busy.

        A child still starting is not picked: its slot retires it when it joins (``_serve``).
        """
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
