"""The worker's background work: long-lived loops and reconnect steps, owned by one TaskGroup."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import TracebackType
from typing import Any

import structlog

__all__ = ["Background"]

log = structlog.get_logger(__name__)


class Background:
    """Owns the service's long-lived loops and one-off steps in one ``asyncio.TaskGroup``.

    Leaving the ``async with`` cancels every piece of work and waits for it, so nothing outlives
    the service. A failure is logged and ends only its own piece of work (a Mingle that fails after a
    reconnect must not stop a worker that serves tasks), so the group never aborts by itself and
    an error in the service's own code propagates as it is, not wrapped in an ``ExceptionGroup``.
    """

    def __init__(self) -> None:
        self._group = asyncio.TaskGroup()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    async def __aenter__(self) -> Background:
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        # Every task is cancelled and none raises (see _logged): this only waits for them to end.
        await self._group.__aexit__(None, None, None)

    def spawn(self, work: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run ``work`` in the background until it ends, ``stop(name)`` or the owner's exit."""
        if self._closing:  # a reconnect step that fires while the service stops has nothing to do
            work.close()
            return
        task = self._group.create_task(_logged(work, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, name: str) -> None:
        """Cancel the work spawned as ``name`` and wait until it has ended."""
        named = [task for task in self._tasks if task.get_name() == name]
        for task in named:
            task.cancel()
        if named:
            await asyncio.wait(named)


async def _logged(work: Coroutine[Any, Any, None], name: str) -> None:
    try:
        await work
    except Exception as exc:
        log.error("background_step_failed", task=name, error=repr(exc))
