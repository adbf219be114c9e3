"""The pool's handle on one child process: its socket, the job it runs, and how it ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Final

from worker.pool import ipc
from worker.pool import spawn as spawn_module
from worker.pool.ipc import Job, JobOutcome, JobStatus

__all__ = ["EXIT_GRACE_S", "ChildHandle"]

# A child whose socket closed gets this long to exit before SIGKILL.
EXIT_GRACE_S: Final = 5.0
_PAGE_KIB: Final = os.sysconf("SC_PAGE_SIZE") // 1024


@dataclass(eq=False, slots=True)
class ChildHandle:
    """One ready child, idle or busy; the pool decides what it runs (worker.pool.pool)."""

    process: BaseProcess
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    slot: int = 0  # the pool's slot that keeps it (a consuming child's place on the board)
    job: Job | None = None
    outcome: asyncio.Future[JobOutcome] | None = None
    started_at: float = 0.0
    kill_status: JobStatus | None = None  # why we signalled it: the outcome if it dies
    doomed: bool = False  # SIGKILLed: never hand it another job
    retired: bool = False  # the pool shrank: it was told to exit, and its slot ends with it
    recycled: bool = False  # past its task or memory limit: told to exit, and its slot replaces it
    jobs_done: int = 0
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def settle(self, outcome: JobOutcome) -> None:
        """End the current job with ``outcome``: its time limits disarmed, its waiter answered."""
        for timer in self.timers:
            timer.cancel()
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_result(outcome)
        self.timers, self.job, self.outcome, self.kill_status = [], None, None, None

    def resident_kib(self) -> int | None:
        """The child's resident memory in KiB (Linux's /proc), or None where it cannot be read."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as statm:
                pages = int(statm.read().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pages * _PAGE_KIB

    async def next_frame(self) -> dict[str, Any] | None:
        """The next frame, or None once the child is gone (a frame cut short means it died writing).

        Raises:
            DecodeError: the frame is not one the child protocol knows.
            MessageTooLarge: the frame's header announces more than a frame may hold.
        """
        try:
            header = await self.reader.readexactly(ipc.HEADER.size)
            body = await self.reader.readexactly(ipc.frame_length(header))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return ipc.decode_frame(body)

    async def reap(self, *, grace_s: float = EXIT_GRACE_S) -> int | None:
        """Close our end, wait for the child to exit (SIGKILL after ``grace_s``); its exit code."""
        self.writer.close()
        exitcode = await asyncio.to_thread(spawn_module.reap, self.process, grace_s=grace_s)
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
        return exitcode
