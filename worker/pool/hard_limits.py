"""The worker's backstop for consuming children's hard time limits: a task that holds the GIL.

A consuming child ends a task at its hard time limit itself: a watchdog thread answers the caller
``TimeLimitExceeded``, acks and exits (``worker/child/hard_limit.py``). A thread needs the GIL to
run, and a task inside one long call into C (a regex, a C extension's loop) keeps it: the
watchdog then waits with everyone else. So the worker, which sees each task's start and hard limit
on the board, ends a child whose task is still shown ``GRACE_S`` past its limit, with SIGKILL, as
Celery's parent does. The broker requeues the delivery; each child is told the task id first, so
the copy is answered ``TimeLimitExceeded`` and acked, not run again (``FeedHandler._guarded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Final

import structlog

from worker import ipc
from worker.shared.board import Board, Running

__all__ = ["CHECK_EVERY_S", "GRACE_S", "HardLimitBackstop"]

log = structlog.get_logger(__name__)

# Past its limit, how long a child's own watchdog has to end the task before the worker does.
GRACE_S: Final = 1.0
CHECK_EVERY_S: Final = 0.5
_REMEMBERED: Final = 1000  # ended ids told to each new child (a copy may reach any of them)
_Run = tuple[int, str, float]  # a run on the board: the child's pid, the task id, its start


class HardLimitBackstop:
    """Ends a consuming child whose task runs ``GRACE_S`` past its hard time limit.

    Args:
        board: what each child runs; a task's hard limit is ``time_limit`` in its info.
        tell: sends a frame to every live child.
    """

    def __init__(self, board: Board, tell: Callable[[bytes], None]) -> None:
        self.ended: dict[str, float] = {}  # task id -> its limit: a copy is answered, not run
        self._board, self._tell = board, tell
        self._killed: dict[_Run, None] = {}  # the runs signalled already, in order
        self._since: dict[_Run, float] = {}  # each run on the board -> when it was first seen there
        self._watching: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Look at the board every ``CHECK_EVERY_S`` from now on (call it on the worker's loop)."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch())

    def close(self) -> None:
        """Stop looking."""
        if self._watching is not None:
            self._watching.cancel()

    def frames(self) -> list[bytes]:
        """What a child that starts must know: every task id ended so far, with its limit."""
        return [_frame(task_id, limit_s) for task_id, limit_s in self.ended.items()]

    def check(self, now: float) -> list[Running]:
        """End every child whose task has been on the board past its limit and ``GRACE_S`` at
        ``now`` (monotonic seconds: a step of the wall clock ends nothing); those tasks.

        A run is timed from the first look that saw it, at most ``CHECK_EVERY_S`` after it began.
        """
        overdue, since = [], {}
        for entry in self._board.running():
            limit_s, task_id = entry.info.get("time_limit"), entry.info.get("id")
            if not isinstance(limit_s, int | float) or limit_s <= 0 or not isinstance(task_id, str):
                continue
            run = (entry.pid, task_id, entry.started)  # a retry run in the same child is a new run
            first = since[run] = self._since.get(run, now)
            if now - first > limit_s + GRACE_S and entry.pid and run not in self._killed:
                self._end(entry, run, float(limit_s))
                overdue.append(entry)
        self._since = since  # runs that left the board are forgotten
        return overdue

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                self.check(time.monotonic())
            except Exception:  # a bug here must not end the watch, nor the worker
                log.exception("hard_limit_check_failed")

    def _end(self, entry: Running, run: _Run, limit_s: float) -> None:
        # First the id, to every child, so whichever gets the copy answers it; then the signal.
        task_id = run[1]
        self.ended[task_id] = limit_s
        if len(self.ended) > _REMEMBERED:
            del self.ended[next(iter(self.ended))]
        self._tell(_frame(task_id, limit_s))
        self._killed[run] = None
        if len(self._killed) > _REMEMBERED:
            del self._killed[next(iter(self._killed))]
        log.error(
            "task_time_limit_exceeded", task_id=task_id, task_name=entry.info.get("name"), limit_s=limit_s,
            pid=entry.pid, ended_by="worker", why="the child's own watchdog did not end it (the GIL held?)",
        )  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry.pid, signal.SIGKILL)


def _frame(task_id: str, limit_s: float) -> bytes:
    return ipc.encode_frame({"op": "timed_out", "id": task_id, "limit": limit_s})
