"""The pool's child supervision: each slot keeps one child alive, serves its frames, reaps and replaces it.

``ChildSupervisor`` is a base of ``worker.pool.pool.ProcessPool``, which owns the state named here and
decides how many children there are (resize, close).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker_svc.errors import DecodeError, MessageTooLarge
from worker import ipc
from worker.pool import spawn as spawn_module
from worker.pool.handle import ChildHandle
from worker.pool.spawn import PoolStartError

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext

    from worker.pool.feeding import Feeding

__all__ = ["ChildSupervisor"]

log = structlog.get_logger(__name__)

# Back-off between failed attempts to replace a child (the app stopped importing, no memory, ...).
_RESPAWN_DELAY_S: Final = (0.5, 30.0)


class ChildSupervisor:
    """The slots of a ``ProcessPool``: start a child, serve it until it exits, replace it.

    The pool sets the attributes below in its constructor and provides ``_retire_some`` (pick
    children to retire after a shrink).
    """

    feeding: Feeding
    _app_spec: str
    _context: ForkServerContext
    _start_timeout_s: float
    _exit_grace_s: float
    _children: dict[int, ChildHandle]
    _slots: list[asyncio.Task[None]]
    _slot_indexes: set[int]
    _closing: asyncio.Event
    _to_retire: int

    def _retire_some(self) -> None:
        raise NotImplementedError

    def _add_slot(self, first_start: asyncio.Future[None] | None) -> None:
        # The lowest index no live slot holds: a child's board slot is its alone, and
        # the board stays as small as the most children alive at once.
        index = next(i for i in itertools.count() if i not in self._slot_indexes)
        self._slot_indexes.add(index)
        slot = asyncio.create_task(self._keep_slot(first_start, index=index))
        slot.add_done_callback(_report_crash)
        slot.add_done_callback(lambda _: self._slot_indexes.discard(index))  # its child was reaped
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
                    spawn_module.spawn,
                    self._context,
                    self._app_spec,
                    timeout_s=self._start_timeout_s,
                    feed=self.feeding.spec_for(index),
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
            pid = process.pid or 0
            child = ChildHandle(process=process, pid=pid, reader=reader, writer=writer, slot=index)
            await self._serve(child, index)
            if child.retired:
                return

    async def _serve(self, child: ChildHandle, index: int) -> None:
        """Let the child consume and relay its frames until it exits; then account for what it ran."""
        self._children[child.pid] = child
        if self._closing.is_set():
            child.writer.close()
        else:
            self.feeding.joined(index, child.writer)
            if self._to_retire:  # the pool shrank while this child started
                self._retire_some()
        try:
            while (frame := await child.next_frame()) is not None:
                self._on_frame(child, frame)
        except (DecodeError, MessageTooLarge) as exc:
            log.error("pool_child_protocol_error", pid=child.pid, error=str(exc))
        finally:
            exitcode = await child.reap(grace_s=self._exit_grace_s)
            lost = self.feeding.left(index)
            for entry in lost:  # the child died mid-task: the broker redelivers it, counted
                info = entry.info
                if self.feeding.was_terminated(str(info.get("id"))):
                    continue  # ended on purpose: its copy is answered terminated
                log.warning(
                    "task_child_lost_retrying", task_id=info.get("id"), task_name=info.get("name"),
                    pid=child.pid, exit=ipc.describe_exit(exitcode),
                )  # fmt: skip
            if self._children.get(child.pid) is child:
                del self._children[child.pid]
            if child.retired or child.recycled:
                log.debug("pool_child_retired", pid=child.pid, exit=ipc.describe_exit(exitcode))
            elif exitcode == ipc.EXIT_TIME_LIMIT:
                # It answered its task TimeLimitExceeded and ended itself: not a crash of an idle child.
                log.info("pool_child_replaced", pid=child.pid, reason="its task passed the hard time limit")
            elif not self._closing.is_set() and not lost:
                log.warning("pool_child_died_idle", pid=child.pid, exit=ipc.describe_exit(exitcode))

    def _on_frame(self, child: ChildHandle, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == "retiring":
            child.recycled = True  # past its limits: its slot starts another
        elif op == "revoke_applied":
            self.feeding.revoke_applied(child.slot, frame)  # a revoke command may wait for it
        elif op in ("held", "reported"):
            self.feeding.answered(child.slot, frame)  # inspect reserved or stats waits for it
        elif op == "tally":
            self.feeding.tallied(frame)  # the child's counts, for stats and the metrics
        else:
            raise DecodeError(f"unexpected {op!r} frame from pool child {child.pid}")


def _report_crash(slot: asyncio.Task[None]) -> None:
    # A slot ends only at close(); one that crashed (a bug) no longer replaces its children.
    if not slot.cancelled() and slot.exception() is not None:
        log.error("pool_slot_crashed", exc_info=slot.exception())
