"""Nothing waits behind a stalled child: what it holds behind a task that outlives the budget goes back.

With a prefetch budget a child may hold many deliveries behind the task it runs. If that task runs
longer than the budget, a watcher thread stops the child's consumers and hands back what it holds
and has not started, so an idle child or worker runs it; the child consumes again once its task
ends, at the prefetch its task times now ask for (``worker/rules/prefetch_budget.py``).

A hand-back must not count as a failed delivery (a nack would: the ``redelivered`` flag of a
classic queue, a quorum queue's ``x-delivery-count``), or a task could reach the delivery limit
without ever running. So each is published again with the count it arrived with (the
``recount`` disposition), confirmed, then acked. It goes to the back of its queue, which an
ordered queue could not allow: a child consuming one never pauses (its prefetch is 1 anyway).

A redelivered task may be the one that crashed its last child: before it runs, a child with a
prefetch budget hands back what it holds the same way, and consumes at prefetch 1 until a task
that never failed comes (a crash brings many back at once: each comes alone, with no hand-back of
its own), so a task that crashes child after child counts against its own delivery limit only,
never (after its first crash) against the tasks that happened to be prefetched behind it.

The watcher holds the running task's update lock and the socket lock while it works, and the task's
thread takes the socket lock to leave the task, so the two never use the socket at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog

from broker_svc.errors import BrokerUnavailable
from worker.child.hard_limit import signals_blocked
from worker.consume.settle import CopiesRefused
from worker.rules.deliveries import delivery_count, recount
from worker.rules.disposition import HAND_BACK

if TYPE_CHECKING:
    from broker_svc.amqp.feed_connection import FeedConnection, TaskDelivery
    from worker.consume.settle import FeedSettler

__all__ = ["StallWatch", "hand_back"]

log = structlog.get_logger(__name__)


def hand_back(settler: FeedSettler, held: Iterable[TaskDelivery]) -> None:
    """Each of ``held`` (never started) back on its queue with the delivery count it came with: all
    the copies published at once and confirmed, then all the originals acked.

    If the broker refuses a copy, the originals not acked yet go back as they are (a nack:
    counted, and a task whose copy was confirmed runs twice, each run marked) rather than stay
    unacked, out of every consumer's reach, until the connection closes.

    Raises:
        BrokerUnavailable: the connection failed (the broker has the originals back).
    """
    try:
        settler.copy_back_all(
            [
                (
                    delivery,
                    recount(delivery_count(delivery.headers, redelivered=delivery.redelivered), resent=True),
                )
                for delivery in held
            ]
        )
    except CopiesRefused as refused:
        log.warning("task_hand_back_failed", count=len(refused.unsettled), error=str(refused))
        for delivery in refused.unsettled:
            settler.settle(delivery, HAND_BACK)


class StallWatch:
    """Hands back what a child holds once its running task outlives ``after_s``.

    Args:
        connection: the child's connection (single-threaded: ``--threads`` children have other
            threads to take what one holds).
        settler: publishes each held delivery again and acks it.
        updates_lock: held while a running task's update is published on the connection.
        after_s: how long a task may run before what waits behind it goes back.
    """

    def __init__(
        self, connection: FeedConnection, settler: FeedSettler, updates_lock: threading.Lock, after_s: float
    ) -> None:
        self._connection, self._settler, self._updates_lock = connection, settler, updates_lock
        self._after_s = after_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._current: TaskDelivery | None = None
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        # The watcher waits without a deadline only between tasks; only then does a task's start
        # wake it. Waking it at every start costs a thread switch per task (about 50 µs of a
        # child's CPU per no-op task in a drain); a watcher asleep on an earlier deadline finds the
        # later one when it wakes and sleeps again.
        self._idle = False

    def arm(self, delivery: TaskDelivery) -> None:
        """``delivery`` starts now; only worth it while the connection may hold more than it."""
        if self._connection.prefetch <= 1:
            return
        with self._lock:
            self._current, self._deadline = delivery, time.monotonic() + self._after_s
            if self._thread is None:
                with signals_blocked():
                    self._thread = threading.Thread(target=self._watch, name="clockwork-stall", daemon=True)
                    self._thread.start()
            elif self._idle:
                self._wake.notify()

    def disarm(self) -> None:
        with self._lock:
            self._current, self._deadline = None, None

    def _watch(self) -> None:
        while True:
            with self._lock:
                while self._deadline is None or (left := self._deadline - time.monotonic()) > 0:
                    self._idle = self._deadline is None
                    self._wake.wait(None if self._idle else left)
                self._idle = False
                delivery, self._deadline = self._current, None
            if delivery is not None:
                self._hand_back(delivery)

    def _still(self, delivery: TaskDelivery) -> bool:
        with self._lock:
            return self._current is delivery

    def _hand_back(self, behind: TaskDelivery) -> None:
        started = time.monotonic()
        try:
            with (
                self._updates_lock,
                self._connection.paused_while_running(lambda: self._still(behind)) as held,
            ):
                hand_back(self._settler, held or ())
        except BrokerUnavailable as exc:  # the connection is gone: the task's thread connects again
            log.warning("task_hand_back_failed", error=str(exc))
            return
        if held is not None:
            log.info(
                "tasks_handed_back_behind_long_task", count=len(held), behind=behind.headers.get("id"),
                after_s=self._after_s, ms=round((time.monotonic() - started) * 1000, 1),
            )  # fmt: skip
