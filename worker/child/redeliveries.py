"""Copies the broker sends back of tasks this worker runs or ran: joined, never run twice here.

When a consuming child's channel closes under a task (``consumer_timeout``, a lost connection) the
broker requeues that task's delivery at once, and the copy may reach another child of the same
worker while the first run still goes on, or after it finished but its ack was lost with the
channel. The children join such a copy to its run through two things they share:

- the board (``worker/shared/board.py``): a task shows in its child's slot from its start until its
  delivery is settled, so a copy whose id shows in another live slot is **running** here;
- a table of outcomes whose ack was lost (``worker/shared/dedupe.py``'s table, ``clockwork-
  redeliveries-*``): a child whose connection failed after a run writes the task there as running,
  connects again, sends the outcome and marks it **finished**.

Only redelivered copies are looked up (a rare event), so a task that is delivered once pays nothing.
A running copy is parked: held unacked while the child raises its prefetch by one and goes on with
other tasks, and looked at again between deliveries. Once the first run is finished, the copy is
acked unrun; if that run ended without a finished outcome (its child died), the copy runs.

A child does not read after every ack (under ``--threads`` whichever thread waits reads; a single
consumer, while deliveries wait in hand, reads at most once a millisecond), so it cannot tell an
ack that a close swallowed. It keeps its last runs by connection instead (``RecentRuns``): when a
connection is lost, the runs settled on it are written to the table as finished, before any of its
threads connects again, and their copies are acked unrun.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from broker_svc.amqp.feed_connection import ConnectionLost, FeedConnection, TaskDelivery
from broker_svc.errors import BrokerUnavailable
from worker.child.spec import FeedSpec
from worker.rules.disposition import Fate
from worker.shared.board import Board
from worker.shared.dedupe import Claim, SharedDedupe
from worker.shared.shared_file import pid_alive

__all__ = ["FeedRedeliveries", "Parked", "RecentRuns", "Verdict", "task_identity"]

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


class RecentRuns:
    """The last runs a threaded child settled (ran, outcome out, acked), with their connection.

    Shared by the child's threads; appends and copies of a deque need no lock.
    """

    def __init__(self, size: int) -> None:
        self._runs: deque[tuple[int, str, int]] = deque(maxlen=size)
        self._lock = threading.Lock()  # for ``lost`` only, which threads may raise at once
        self.lost = 0  # the newest connection (generation) whose runs were written as finished

    def add(self, generation: int, task_id: str, retries: int) -> None:
        self._runs.append((generation, task_id, retries))

    def lose(self, generation: int) -> list[tuple[str, int]]:
        """Connection ``generation`` is lost: ``(task_id, retries)`` of the runs settled on it."""
        with self._lock:
            self.lost = max(self.lost, generation)
        return [(task_id, retries) for gen, task_id, retries in list(self._runs) if gen == generation]


class FeedRedeliveries:
    """One consumer's view of the worker's runs, for the copies the broker sends it back.

    Args:
        board: the worker's board (None: no join, every copy runs).
        done: the table of outcomes whose ack was lost (None: none are remembered).
        own_slot: this consumer's board slot (its own runs are not a copy's first run).
        connection: its connection (the prefetch grows by one for each parked copy).
        recent: the child's last runs (None: only a run whose own settle failed is joined).
    """

    def __init__(
        self,
        *,
        board: Board | None,
        done: SharedDedupe | None,
        own_slot: int,
        connection: FeedConnection,
        recent: RecentRuns | None = None,
    ) -> None:
        self._board, self._done, self._own_slot = board, done, own_slot
        self._connection, self._recent = connection, recent
        self.parked: list[Parked] = []

    @classmethod
    def for_consumer(
        cls,
        spec: FeedSpec,
        board: Board | None,
        *,
        own_slot: int,
        connection: FeedConnection,
        recent: RecentRuns | None = None,
    ) -> FeedRedeliveries:
        """The view of a consumer started with ``spec``."""
        done = None
        if spec.done_path is not None:
            done = SharedDedupe(Path(spec.done_path), ttl_s=DONE_REMEMBERED_S, owner=False)
        return cls(board=board, done=done, own_slot=own_slot, connection=connection, recent=recent)

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

    def settled(self, delivery: TaskDelivery, fate: Fate | None, *, ran: bool) -> None:
        """``delivery``'s run ended and it was settled with ``fate``: kept among the recent runs.

        Its outcome went out before the ack, so a copy the broker sends back needs no run.
        """
        if self._recent is None or not ran or fate not in _FINISHED:
            return
        identity = task_identity(delivery)
        if identity is None:
            return
        self._recent.add(delivery.generation, *identity)
        if delivery.generation <= self._recent.lost or delivery.generation != self._connection.generation:
            self._finished(*identity)  # its connection was lost meanwhile, and that was told already

    def connection_lost(self, exc: BrokerUnavailable) -> None:
        """The connection was lost (or a close was seen on it while every thread ran a task):
        the runs settled on it are finished here, before any thread connects again."""
        if self._recent is None:
            return
        lost = exc.generation if isinstance(exc, ConnectionLost) else None
        for task_id, retries in self._recent.lose(self._connection.generation if lost is None else lost):
            self._finished(task_id, retries)

    def _finished(self, task_id: str, retries: int) -> None:
        # As a child that sent an outcome again after its connection failed marks it.
        self.outcome_sent(self.sending_outcome(task_id, retries), sent=True)

    def close(self) -> None:
        if self._done is not None:
            self._done.close()


# Fates after which a run's outcome is out and nothing of it is owed: a copy is acked unrun.
_FINISHED: Final = frozenset({Fate.ACK, Fate.DEAD_LETTER})


def task_identity(delivery: TaskDelivery) -> tuple[str, int] | None:
    """``(task_id, retries)`` from ``delivery``'s headers, or None if they are not a task's."""
    task_id, retries = delivery.headers.get("id"), delivery.headers.get("retries", 0)
    if not isinstance(task_id, str) or not isinstance(retries, int):
        return None
    return task_id, retries
