"""The pool's side of its consuming children: their start-up order, what they run, what they hold.

Each child consumes for itself (``worker/child``); the pool tells it the revoked ids and when to
start, and reads what it runs from the shared board (``worker/shared/board.py``) for ``inspect``,
the heartbeat's counts and ``revoke --terminate``. The children's counts come in ``tally`` frames
(``worker/consume/tally.py``), at most one a second from each, for ``stats`` and the metrics.
What a child holds and has not started (a deeper prefetch, ``--threads``) is on no board: the
children are asked when ``inspect reserved`` asks (``worker/child/held.py``); ``inspect stats``
asks each for the counts it has not reported yet, so its ``total`` is exact.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import structlog

from broker_svc.errors import DecodeError
from worker import ipc
from worker.child.redeliveries import DONE_MAX_IDS, DONE_REMEMBERED_S
from worker.child.spec import FeedSpec
from worker.consume.tally import Tally
from worker.pool.hard_limits import HardLimitBackstop
from worker.shared.board import Board, Running
from worker.shared.dedupe import SharedDedupe
from worker.shared.rates import SharedRates
from worker.shared.shared_file import sweep_stale

__all__ = ["REVOKE_KNOWN_WAIT_S", "Feeding"]

_TERMINATED_REMEMBERED = 1000  # terminated ids told to each new child
# Under --threads, how long an async def task cancelled by terminate has to end before its child
# is signalled after all (a body that ignores the cancel, or blocks its loop).
CANCEL_GRACE_S: Final = 5.0
# How long a revoke command waits for every child to apply it before it replies anyway: well
# inside Celery's default 1 s reply window, far above the milliseconds a child takes.
REVOKE_KNOWN_WAIT_S: Final = 0.5
# How long inspect reserved and stats wait for every child to answer (the same window).
ASK_WAIT_S: Final = 0.5

log = structlog.get_logger(__name__)


class Feeding:
    """Consuming children's start-up orders, revokes and running tasks.

    Args:
        spec: what every child is told; each gets its own board slots, one per thread.
        slots: how many children there are at start (the board holds ``slots * spec.threads``,
            and grows with the pool).
    """

    def __init__(self, spec: FeedSpec, *, slots: int) -> None:
        self._threads = spec.threads
        self._async_tasks = frozenset(spec.async_task_names)
        if stale := sweep_stale():  # left by workers killed before they could remove them
            log.info("stale_shared_files_removed", count=len(stale))
        self.board = Board.create(slots * spec.threads)
        # A task past its hard time limit whose child's watchdog cannot run (the GIL held).
        self.hard_limits = HardLimitBackstop(self.board, self._broadcast)
        # One bucket per rate-limited task, shared by every child (a limit is per worker).
        self.rates = SharedRates.create(spec.task_names, spec.rate_limits)
        # One dedupe window for every child (--dedupe-window): a copy may reach any of them.
        window_s = spec.dedupe_window_s
        self.dedupe = SharedDedupe.create(ttl_s=window_s) if window_s else None
        # Outcomes sent after their ack was lost: a copy the broker sends back is acked unrun.
        self.done = SharedDedupe.create(ttl_s=DONE_REMEMBERED_S, max_ids=DONE_MAX_IDS, kind="redeliveries")
        self._spec = dataclasses.replace(
            spec,
            board_path=str(self.board.path),
            board_slots=self.board.slots,
            rates_path=str(self.rates.path),
            dedupe_path=str(self.dedupe.path) if self.dedupe is not None else None,
            done_path=str(self.done.path),
        )
        self._revoked: Callable[[], Iterable[str]] | None = None  # set by start()
        self._revoked_stamps: Callable[[], dict[str, list[Any]]] | None = None  # set by start()
        self.task_events = spec.task_events  # what each child is told (-E, enable_events)
        self._time_limits: dict[str, tuple[float | None, float | None]] = {}  # the time_limit command's
        self._queues: list[str] | None = None  # add_consumer/cancel_consumer; None: the spec's
        self._writers: dict[int, asyncio.StreamWriter] = {}  # slot -> its child's socket
        self._ended_before = 0  # tasks ended by children that exited
        self.totals: collections.Counter[str] = collections.Counter()  # runs per task name (stats total)
        self.unknown: collections.Counter[str] = collections.Counter()  # unregistered names (stats)
        # Tasks whose child the worker ended (terminate) -> the signal: a copy is answered terminated.
        self._terminated: dict[str, int] = {}
        self.on_tally: Callable[[Tally], None] | None = None  # the metrics' share of each report
        # Revoke frames are numbered; each child answers with the number it has applied, so a
        # revoke command can wait for every live child before it replies (revokes_known).
        self._revoke_seq = 0
        self._applied: dict[int, int] = {}  # slot -> the last revoke number its child applied
        # Set and replaced whenever a child answers or leaves: every wait for children rechecks.
        self._changed = asyncio.Event()
        # Questions to every child (inspect reserved, stats): number -> the answers so far, by slot.
        self._ask_seq = 0
        self._answers: dict[int, dict[int, dict[str, Any]]] = {}

    def spec_for(self, slot: int) -> FeedSpec:
        """The start-up order of the child in ``slot``; the board grows to hold its slots first."""
        self.board.grow((slot + 1) * self._threads)  # one board slot per thread
        return dataclasses.replace(self._spec, slot=slot, board_slots=self.board.slots)

    def joined(self, slot: int, writer: asyncio.StreamWriter) -> None:
        """A child is up in ``slot``: it consumes at once if the worker said so already."""
        self._writers[slot] = writer
        self._applied.pop(slot, None)
        self._let_consume(writer)

    def left(self, slot: int) -> list[Running]:
        """The child of ``slot`` exited: what it showed as running is not any more; those tasks."""
        self._writers.pop(slot, None)
        self._applied.pop(slot, None)
        self._note_change()  # nobody waits for an exited child
        lost = [entry for entry in self.board.running() if entry.slot // self._threads == slot]
        for shown in range(slot * self._threads, (slot + 1) * self._threads):  # one per thread
            self._ended_before += self.board.ended(shown)
            self.board.clear(shown)
        return lost

    def start(
        self,
        revoked: Callable[[], Iterable[str]],
        revoked_stamps: Callable[[], dict[str, list[Any]]] | None = None,
    ) -> None:
        """Let every child consume, now and each new one, knowing ``revoked()`` (and the revoked
        stamps) first."""
        self._revoked = revoked
        self._revoked_stamps = revoked_stamps
        self.hard_limits.start()
        for writer in self._writers.values():
            self._let_consume(writer)

    def retire(self, slot: int) -> None:
        """Tell the child of ``slot`` to stop consuming, finish the task it runs and exit.

        Its socket stays open, unlike a stop, so it takes the time its task needs (no exit grace
        applies) and the pool learns it exited when the socket closes.
        """
        writer = self._writers.get(slot)
        if writer is not None and not writer.is_closing():
            writer.write(ipc.encode_frame({"op": "retire"}))

    def send_revoked(self, task_ids: Sequence[str]) -> None:
        """Tell every child of newly revoked ids; they skip those tasks."""
        if not task_ids:
            return
        self._revoke_seq += 1
        frame = ipc.encode_frame({"op": "revoke", "ids": list(task_ids), "seq": self._revoke_seq})
        self._broadcast(frame)

    def send_revoked_stamps(self, stamps: dict[str, list[Any]]) -> None:
        """Tell every child of newly revoked stamp values; they skip the tasks stamped with them."""
        if not stamps:
            return
        self._revoke_seq += 1
        self._broadcast(
            ipc.encode_frame({"op": "revoke", "ids": [], "stamps": stamps, "seq": self._revoke_seq})
        )

    def revoke_applied(self, slot: int, frame: dict[str, Any]) -> None:
        """The child of ``slot`` has applied the revoke frames numbered up to ``frame["seq"]``."""
        seq = frame.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            log.error("feed_revoke_applied_malformed", slot=slot, seq=repr(seq))
            return
        if seq > self._applied.get(slot, -1):  # 0 too: the child has answered once, so it started
            self._applied[slot] = seq
            self._note_change()

    async def revokes_known(self, timeout_s: float = REVOKE_KNOWN_WAIT_S) -> bool:
        """Wait until every live child has applied the revokes sent so far; False past ``timeout_s``.

        A revoke command replies only then, so a task sent after ``revoke(reply=True)`` returns
        meets a child that skips it. A child that does not answer in time (its control thread
        starved) is logged and the reply goes out anyway: the revoke holds once it applies it.
        """
        seq = self._revoke_seq
        try:
            async with asyncio.timeout(timeout_s):
                while self._lagging(seq):
                    await self._changed.wait()
        except TimeoutError:
            lagging = self._lagging(seq)
            # A child that has not answered once is still starting (importing the app): it takes
            # the revokes before its first task, so the delay is expected, not a fault.
            starting = [slot for slot in lagging if slot not in self._applied]
            say = log.info if starting == lagging else log.warning
            say("feed_revoke_not_confirmed", slots=lagging, starting=starting, seq=seq, timeout_s=timeout_s)
            return False
        return True

    def _lagging(self, seq: int) -> list[int]:
        return [
            slot
            for slot, writer in self._writers.items()
            if not writer.is_closing() and self._applied.get(slot, 0) < seq
        ]

    def _note_change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def held(self, timeout_s: float = ASK_WAIT_S) -> list[Running]:
        """What every live child holds and has not started (``inspect reserved``); each is asked.

        A child that does not answer within ``timeout_s`` is left out. ``Running.started`` is 0:
        none of them has started.
        """
        held = []
        for slot, frame in sorted((await self._ask("held", timeout_s)).items()):
            pid, tasks = frame.get("pid"), frame.get("tasks")
            if (
                not isinstance(pid, int)
                or not isinstance(tasks, list)
                or not all(isinstance(t, dict) for t in tasks)
            ):
                log.error("feed_held_malformed", slot=slot, frame=repr(frame)[:200])
                continue
            if frame.get("error"):
                log.error("feed_held_failed", slot=slot, error=frame["error"])
            held += [Running(slot, pid, 0.0, task) for task in tasks]
        return held

    async def reported(self, timeout_s: float = ASK_WAIT_S) -> None:
        """Every live child has sent the counts it kept since its last ``tally`` (``inspect stats``):
        ``totals`` count every task ended before the call (a child silent past ``timeout_s`` is
        logged; its counts come with its next report)."""
        await self._ask("report", timeout_s)

    async def _ask(self, op: str, timeout_s: float) -> dict[int, dict[str, Any]]:
        # Send ``op`` (numbered) to every live child; their answers (the same number) by slot, once
        # every child still alive has answered, or at ``timeout_s``. Frames a child sent before
        # its answer (its tally) are handled first: one socket, in order.
        self._ask_seq += 1
        seq, answers = self._ask_seq, dict[int, dict[str, Any]]()
        self._answers[seq] = answers
        asked = [slot for slot, writer in self._writers.items() if not writer.is_closing()]
        frame = ipc.encode_frame({"op": op, "seq": seq})
        for slot in asked:
            self._writers[slot].write(frame)
        try:
            async with asyncio.timeout(timeout_s):
                while silent := [slot for slot in asked if slot not in answers and slot in self._writers]:
                    await self._changed.wait()
        except TimeoutError:
            # Starting (importing the app), or its task holds the GIL: the answer lists less, at
            # info (an operator's view, not a fault; an unapplied revoke warns, revokes_known).
            starting = [slot for slot in silent if slot not in self._applied]
            log.info("feed_child_not_answering", op=op, slots=silent, starting=starting, timeout_s=timeout_s)
        finally:
            del self._answers[seq]
        return answers

    def answered(self, slot: int, frame: dict[str, Any]) -> None:
        """The child of ``slot`` answered a question (``held``, ``report``); late answers are dropped."""
        seq = frame.get("seq")
        answers = self._answers.get(seq) if isinstance(seq, int) else None
        if answers is not None:
            answers[slot] = frame
            self._note_change()

    def set_task_events(self, on: bool) -> None:
        """Turn task events on or off in every child (``enable_events``/``disable_events``)."""
        self.task_events = on
        frame = ipc.encode_frame({"op": "events", "on": on})
        self._broadcast(frame)

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

    def tallied(self, frame: dict[str, Any]) -> None:
        """A child reported its counts since its last report (a malformed report is logged and dropped)."""
        try:
            tally = Tally.from_frame(frame)
        except DecodeError as exc:  # a count lost, not a reason to stop serving the child
            log.error("feed_tally_malformed", error=str(exc))
            return
        for (name,), n in tally.of("total").items():
            self.totals[name] += n
        for (name,), n in tally.of("unknown").items():
            self.unknown[name] += n
        if self.on_tally is not None:
            try:
                self.on_tally(tally)
            except Exception:  # the metrics must not take a child's socket down with them
                log.exception("feed_tally_not_counted")

    def running(self) -> list[Running]:
        """What every child runs now."""
        return self.board.running()

    def running_stamps(self) -> list[tuple[str, dict[str, Any]]]:
        """The id and stamps of every stamped task running now (a revoke by stamps may end them)."""
        found = []
        for entry in self.board.running():
            task_id, stamps = entry.info.get("id"), entry.info.get("stamps")
            if isinstance(task_id, str) and isinstance(stamps, dict) and stamps:
                found.append((task_id, stamps))
        return found

    @property
    def processed(self) -> int:
        """Tasks the children have ended since the worker started (the heartbeat's ``processed``)."""
        return self._ended_before + sum(self.board.ended(slot) for slot in range(self.board.slots))

    def was_terminated(self, task_id: str) -> bool:
        """Whether the worker ended the child running ``task_id`` (terminate, hard limit), recently."""
        return task_id in self._terminated or task_id in self.hard_limits.ended

    def terminate(self, task_id: str, sig: int) -> bool:
        """Signal the child running ``task_id``; whether one was.

        Under ``--threads``, an ``async def`` task is cancelled in its thread instead, so the
        child's other threads' tasks go on; its child is signalled only if it still runs it
        ``CANCEL_GRACE_S`` later. Call it on the worker's loop.
        """
        for entry in self.board.running():
            if entry.info.get("id") == task_id and entry.pid:
                # First, so a child that gets the copy of the task answers it as terminated.
                self._terminated[task_id] = int(sig)
                if len(self._terminated) > _TERMINATED_REMEMBERED:
                    del self._terminated[next(iter(self._terminated))]
                frame = ipc.encode_frame({"op": "terminated", "id": task_id, "signum": int(sig)})
                self._broadcast(frame)
                if self._threads > 1 and entry.info.get("name") in self._async_tasks:
                    return self._cancel(entry, task_id, sig)
                return self._signal(entry.pid, task_id, sig)
        return False

    def _cancel(self, entry: Running, task_id: str, sig: int) -> bool:
        writer = self._writers.get(entry.slot // self._threads)
        if writer is None or writer.is_closing():
            return self._signal(entry.pid, task_id, sig)
        writer.write(ipc.encode_frame({"op": "cancel", "id": task_id}))
        log.info("feed_task_cancel_sent", pid=entry.pid, task_id=task_id)

        def unless_ended() -> None:
            if any(e.info.get("id") == task_id and e.pid == entry.pid for e in self.board.running()):
                log.warning(
                    "feed_task_cancel_ignored", pid=entry.pid, task_id=task_id, grace_s=CANCEL_GRACE_S
                )
                self._signal(entry.pid, task_id, sig)

        asyncio.get_running_loop().call_later(CANCEL_GRACE_S, unless_ended)
        return True

    def _signal(self, pid: int, task_id: str, sig: int) -> bool:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.Signals(sig))
            log.info("feed_child_signalled", pid=pid, task_id=task_id, signal=signal.Signals(sig).name)
            return True
        return False

    def close(self) -> None:
        """Remove the board, the rate buckets, the dedupe window and the lost acks' table."""
        self.hard_limits.close()
        self.board.close()
        self.rates.close()
        self.done.close()
        if self.dedupe is not None:
            self.dedupe.close()

    def _let_consume(self, writer: asyncio.StreamWriter) -> None:
        if self._revoked is None or writer.is_closing():
            return
        revoked: dict[str, Any] = {"op": "revoke", "ids": list(self._revoked()), "seq": self._revoke_seq}
        if self._revoked_stamps is not None:
            revoked["stamps"] = self._revoked_stamps()
        writer.write(ipc.encode_frame(revoked))
        for task_id, signum in self._terminated.items():  # a child started since (the one replaced)
            writer.write(ipc.encode_frame({"op": "terminated", "id": task_id, "signum": signum}))
        for frame in self.hard_limits.frames():
            writer.write(frame)
        writer.write(ipc.encode_frame({"op": "events", "on": self.task_events}))
        if self._queues is not None:
            writer.write(ipc.encode_frame({"op": "queues", "queues": self._queues}))
        for name, (hard, soft) in self._time_limits.items():
            writer.write(ipc.encode_frame({"op": "time_limit", "task": name, "hard": hard, "soft": soft}))
        writer.write(ipc.encode_frame({"op": "consume"}))
