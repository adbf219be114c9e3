"""Copies the broker sends back of tasks this worker runs or ran: joined, never run twice here.

When a consuming child's channel closes under a task (``consumer_timeout``, a lost connection) the
broker requeues that task's delivery at once, and the copy may reach another child of the same
worker while the first run still goes on, or after it finished but its ack was lost with the
channel. The worker's own consumer joins such a copy to its run (``worker/consume/redelivery.py``);
here the children do it through two things they share:

- the board (``worker/pool/board.py``): a task shows in its child's slot from its start until its
  delivery is settled, so a copy whose id shows in another live slot is **running** here;
- a table of outcomes whose ack was lost (``worker/feed/dedupe.py``'s table, ``clockwork-
  redeliveries-*``): a child whose connection failed after a run writes the task there as running,
  connects again, sends the outcome and marks it **finished**.

Only redelivered copies are looked up (a rare event), so a task that is delivered once pays nothing.
A running copy is parked: held unacked while the child raises its prefetch by one and goes on with
other tasks, and looked at again between deliveries. Once the first run is finished, the copy is
acked unrun; if that run ended without a finished outcome (its child died), the copy runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from broker_svc.connection.feed_connection import FeedConnection, TaskDelivery
from worker.feed.dedupe import Claim, SharedDedupe
from worker.feed.shared_file import pid_alive
from worker.feed.spec import FeedSpec
from worker.pool.board import Board

__all__ = ["FeedRedeliveries", "Parked", "Verdict"]

log = structlog.get_logger(__name__)

# How long an outcome whose ack was lost is remembered: a copy may wait this long in its queue.
DONE_REMEMBERED_S: Final = 3600.0
DONE_MAX_IDS: Final = 4096


class Verdict(enum.Enum):
    """What a redelivered copy is, in this worker."""

    RUN = "run"  # unknown here, or its first run ended without an outcome: run it
    RUNNING = "running"  # its first run goes on in another child (or sends its outcome): wait
    DONE = "done"  # its first run's outcome went out and only the ack was lost: ack it unrun


@dataclass(slots=True)
class Parked:
    """A copy held unacked until its first run ends."""

    delivery: TaskDelivery
    task_id: str
    retries: int


class FeedRedeliveries:
    """One consumer's view of the worker's runs, for the copies the broker sends it back.

    Args:
        board: the worker's board (None: no join, every copy runs).
        done: the table of outcomes whose ack was lost (None: none are remembered).
        own_slot: this consumer's board slot (its own runs are not a copy's first run).
        connection: its connection (the prefetch grows by one for each parked copy).
    """

    def __init__(
        self,
        *,
        board: Board | None,
        done: SharedDedupe | None,
        own_slot: int,
        connection: FeedConnection,
    ) -> None:
        self._board, self._done, self._own_slot = board, done, own_slot
        self._connection = connection
        self.parked: list[Parked] = []

    @classmethod
    def for_consumer(
        cls, spec: FeedSpec, board: Board | None, *, own_slot: int, connection: FeedConnection
    ) -> FeedRedeliveries:
        """The view of a consumer started with ``spec``."""
        done = None
        if spec.done_path is not None:
            done = SharedDedupe(Path(spec.done_path), ttl_s=DONE_REMEMBERED_S, owner=False)
        return cls(board=board, done=done, own_slot=own_slot, connection=connection)

    def verdict(self, task_id: str, retries: int) -> Verdict:
        """What a redelivered copy of ``(task_id, retries)`` is here."""
        if self._board is not None:
            for running in self._board.running():
                if (
                    running.slot != self._own_slot
                    and running.info.get("id") == task_id
                    and pid_alive(running.pid)
                ):
                    return Verdict.RUNNING
        if self._done is not None:
            state = self._done.state(task_id, retries)
            if state == "running":
                return Verdict.RUNNING
            if state == "finished":
                return Verdict.DONE
        return Verdict.RUN

    def park(self, delivery: TaskDelivery, task_id: str, retries: int) -> None:
        """Hold ``delivery`` until its first run ends; the broker may send one more meanwhile.

        Raises:
            ConnectionLost: the connection failed (the broker has the copy back).
        """
        log.info("task_redelivery_joined_run", task_id=task_id)
        self.parked.append(Parked(delivery, task_id, retries))
        self._connection.hold(1, delivery.generation)

    def unpark(self, parked: Parked) -> None:
        """``parked`` is settled or runs now: the prefetch shrinks back by one.

        Raises:
            ConnectionLost: the connection failed.
        """
        self.parked.remove(parked)
        self._connection.hold(-1, parked.delivery.generation)

    def forget(self) -> None:
        """Drop the copies parked on an earlier connection: gone with it, the broker has them back.

        (A new connection starts with the prefetch alone. Under ``--threads`` another thread may
        have connected again before this one saw the loss.)
        """
        generation = self._connection.generation
        if any(parked.delivery.generation != generation for parked in self.parked):
            self.parked = [parked for parked in self.parked if parked.delivery.generation == generation]

    def sending_outcome(self, task_id: str, retries: int) -> Claim | None:
        """The connection failed after the run of ``(task_id, retries)``: it shows as running until
        :meth:`outcome_sent`, so a copy that comes meanwhile waits for it."""
        if self._done is None:
            return None
        return self._done.claim(task_id, retries)

    def outcome_sent(self, claim: Claim | None, *, sent: bool) -> None:
        """The outcome went out (``sent``: copies are acked unrun from now on), or could not."""
        if claim is not None and self._done is not None:
            self._done.release(claim, finished=sent)

    def close(self) -> None:
        if self._done is not None:
            self._done.close()
