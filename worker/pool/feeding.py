"""The pool's side of consuming children (``--children-consume``): their start-up order, what they run.

Each child consumes for itself (``worker/feed``); the pool tells it the revoked ids and when to
start, and reads what it runs from the shared board (``worker/pool/board.py``) for ``inspect``,
the heartbeat's counts and ``revoke --terminate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable, Iterable, Sequence

import structlog

from worker.feed.rates import SharedRates
from worker.feed.spec import FeedSpec
from worker.pool import ipc
from worker.pool.board import Board, Running

__all__ = ["Feeding"]

log = structlog.get_logger(__name__)


class Feeding:
    """Consuming children's start-up orders, revokes and running tasks.

    Args:
        spec: what every child is told; each gets its own board slot.
        slots: how many children there can be at once (the board's size).
    """

    def __init__(self, spec: FeedSpec, *, slots: int) -> None:
        self.board = Board.create(slots)
        # One bucket per rate-limited task, shared by every child (a limit is per worker).
        self.rates = SharedRates.create(spec.task_names, spec.rate_limits)
        self._spec = dataclasses.replace(
            spec, board_path=str(self.board.path), board_slots=slots, rates_path=str(self.rates.path)
        )
        self._revoked: Callable[[], Iterable[str]] | None = None  # set by start()
        self.task_events = spec.task_events  # what each child is told (-E, enable_events)
        self._time_limits: dict[str, tuple[float | None, float | None]] = {}  # the time_limit command's
        self._queues: list[str] | None = None  # add_consumer/cancel_consumer; None: the spec's
        self._writers: dict[int, asyncio.StreamWriter] = {}  # slot -> its child's socket
        self._ended_before = 0  # tasks ended by children that exited

    def spec_for(self, slot: int) -> FeedSpec:
        """The start-up order of the child in ``slot``."""
        return dataclasses.replace(self._spec, slot=slot)

    def joined(self, slot: int, writer: asyncio.StreamWriter) -> None:
        """A child is up in ``slot``: it consumes at once if the worker said so already."""
        self._writers[slot] = writer
        self._let_consume(writer)

    def left(self, slot: int) -> None:
        """The child of ``slot`` exited: what it showed as running is not any more."""
        self._writers.pop(slot, None)
        self._ended_before += self.board.ended(slot)
        self.board.clear(slot)

    def start(self, revoked: Callable[[], Iterable[str]]) -> None:
        """Let every child consume, now and each new one, knowing ``revoked()`` first."""
        self._revoked = revoked
        for writer in self._writers.values():
            self._let_consume(writer)

    def send_revoked(self, task_ids: Sequence[str]) -> None:
        """Tell every child of newly revoked ids; they skip those tasks."""
        if not task_ids:
            return
        frame = ipc.encode_frame({"op": "revoke", "ids": list(task_ids)})
        for writer in self._writers.values():
            if not writer.is_closing():
                writer.write(frame)

    def set_task_events(self, on: bool) -> None:
        """Turn task events on or off in every child (``enable_events``/``disable_events``)."""
        self.task_events = on
        frame = ipc.encode_frame({"op": "events", "on": on})
        for writer in self._writers.values():
            if not writer.is_closing():
                writer.write(frame)

    def set_time_limit(self, task_name: str, *, hard: float | None, soft: float | None) -> None:
        """The ``time_limit`` command: every child uses these limits for ``task_name`` from now on."""
        self._time_limits[task_name] = (hard, soft)
        self._broadcast(ipc.encode_frame({"op": "time_limit", "task": task_name, "hard": hard, "soft": soft}))

    def set_queues(self, queues: list[str]) -> None:
        """``add_consumer``/``cancel_consumer``: every child consumes ``queues`` from now on."""
        self._queues = list(queues)
        self._broadcast(ipc.encode_frame({"op": "queues", "queues": self._queues}))

    def _broadcast(self, frame: bytes) -> None:
        for writer in self._writers.values():
            if not writer.is_closing():
                writer.write(frame)

    def running(self) -> list[Running]:
        """What every child runs now."""
        return self.board.running()

    @property
    def processed(self) -> int:
        """Tasks the children have ended since the worker started (the heartbeat's ``processed``)."""
        return self._ended_before + sum(self.board.ended(slot) for slot in range(self.board.slots))

    def terminate(self, task_id: str, sig: int) -> bool:
        """Signal the child running ``task_id``; whether one was."""
        for entry in self.board.running():
            if entry.info.get("id") == task_id and entry.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry.pid, signal.Signals(sig))
                    log.info(
                        "feed_child_signalled",
                        pid=entry.pid,
                        task_id=task_id,
                        signal=signal.Signals(sig).name,
                    )
                    return True
        return False

    def close(self) -> None:
        """Remove the board and the rate buckets."""
        self.board.close()
        self.rates.close()

    def _let_consume(self, writer: asyncio.StreamWriter) -> None:
        if self._revoked is None or writer.is_closing():
            return
        writer.write(ipc.encode_frame({"op": "revoke", "ids": list(self._revoked())}))
        writer.write(ipc.encode_frame({"op": "events", "on": self.task_events}))
        if self._queues is not None:
            writer.write(ipc.encode_frame({"op": "queues", "queues": self._queues}))
        for name, (hard, soft) in self._time_limits.items():
            writer.write(ipc.encode_frame({"op": "time_limit", "task": name, "hard": hard, "soft": soft}))
        writer.write(ipc.encode_frame({"op": "consume"}))
