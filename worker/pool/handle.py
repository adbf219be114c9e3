"""The pool's handle on one child process: its socket, its slot, and how it ends."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Final

from worker import ipc
from worker.pool import spawn as spawn_module

__all__ = ["EXIT_GRACE_S", "ChildHandle"]

# A child whose socket closed gets this long to exit before SIGKILL.
EXIT_GRACE_S: Final = 5.0


@dataclass(eq=False, slots=True)
class ChildHandle:
    """One ready child; the pool decides how many there are (worker.pool.pool)."""

    process: BaseProcess
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    slot: int = 0  # the pool's slot that keeps it (its place on the board)
    retired: bool = False  # the pool shrank: it was told to exit, and its slot ends with it
    recycled: bool = False  # past its task or memory limit: it exits, and its slot replaces it

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
