"""A consuming child's settle point: the one place its task deliveries are acked or handed back.

A copy a delivery owes (a dead letter, a retry) is confirmed before the delivery is acked; a
failed copy raises here with the delivery still unacked, and the child hands it back. Under
``--threads`` a sibling thread may take that copy before the ack is written: ``CopiesInFlight``
makes it wait for the ack, so a copy that ends the child cannot bring the original back beside it
(the task queued twice).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import structlog

from broker_svc.amqp.feed_connection import FeedConnection, TaskDelivery
from broker_svc.errors import BrokerSvcError, BrokerUnavailable
from broker_svc.topology import QueueSpec, dedup_gate_queue, delay_queue
from broker_svc.wire.records.dedup import gate_headers, release_of, shard_of
from worker.consume.replies import FeedReplies
from worker.rules.disposition import Disposition, Fate

__all__ = ["CopiesInFlight", "CopiesRefused", "FeedSettler"]

log = structlog.get_logger(__name__)

# Every settle without a copy in flight (nearly all, and all in the default design): one reusable
# context, not a new one per task.
_NOT_COPYING: Final = contextlib.nullcontext()


class CopiesInFlight:
    """Task ids a thread of this child has published a copy of and not yet acked the original of.

    Shared by the threads of one child (``--threads``). A thread that takes such a copy waits for
    its original's ack first, at most ``timeout_s`` (a settle that hangs past it has lost its
    connection, which ends the wait anyway).
    """

    def __init__(self, *, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._acking: dict[str, threading.Event] = {}

    @contextlib.contextmanager
    def copying(self, delivery: TaskDelivery) -> Iterator[None]:
        """Around the copy's publish and the original's ack."""
        task_id = delivery.headers.get("id")
        if not isinstance(task_id, str):
            yield
            return
        acked = threading.Event()
        with self._lock:
            self._acking[task_id] = acked
        try:
            yield
        finally:
            with self._lock:
                if self._acking.get(task_id) is acked:
                    del self._acking[task_id]
            acked.set()

    def wait_for_original(self, delivery: TaskDelivery) -> None:
        """Return once no sibling is between publishing ``delivery``'s copy and acking the original."""
        task_id = delivery.headers.get("id")
        with self._lock:
            acked = self._acking.get(task_id) if isinstance(task_id, str) else None
        if acked is not None and not acked.is_set():
            log.info("task_copy_waits_for_original")
            acked.wait(self._timeout_s)


class CopiesRefused(BrokerSvcError):
    """The broker refused (or did not confirm) a copy back; ``unsettled`` are the originals not acked."""

    def __init__(self, message: str, unsettled: Sequence[TaskDelivery]) -> None:
        super().__init__(message)
        self.unsettled = list(unsettled)


class FeedSettler:
    """Carries out a delivery's disposition with the child's connection.

    Args:
        connection: the child's connection (acks and nacks go through it).
        replies: publishes dead letters and copies, confirmed.
        namespace: the app namespace, which names the dedup gate's shards.
        copies: the child's copies in flight, shared by its threads (``--threads``); else None.
    """

    def __init__(
        self,
        connection: FeedConnection,
        replies: FeedReplies,
        *,
        namespace: str,
        copies: CopiesInFlight | None = None,
    ) -> None:
        self._connection = connection
        self._replies = replies
        self._namespace = namespace
        self.copies = copies

    def copy_back_all(self, settles: Sequence[tuple[TaskDelivery, Disposition]]) -> None:
        """Settle deliveries each of whose dispositions is a plain copy back onto its own queue (a
        hand-back that keeps its delivery count): every copy published at once and confirmed, then
        every original acked in one write, so a hand-back of many takes one round trip, not one each.

        Raises:
            BrokerUnavailable: the connection failed (the broker has back what is not acked).
            CopiesRefused: a copy was refused or not confirmed; it names the originals not acked
                (all of them, or under ``--threads``, where each is settled alone, the rest).
            ValueError: a disposition is not a plain copy back.
        """
        for _delivery, disposition in settles:
            plain = disposition.to is None and disposition.delay_ms is None and disposition.body is None
            if disposition.fate is not Fate.REPUBLISH or not plain:
                raise ValueError(f"not a copy back onto its queue: {disposition}")
        done = 0
        try:
            if self.copies is not None:  # --threads: each copy waits for its own ack (CopiesInFlight)
                for delivery, disposition in settles:
                    self.settle(delivery, disposition)
                    done += 1
                return
            if settles:
                self._replies.copies([(delivery, d.headers, d.drop) for delivery, d in settles])
        except BrokerUnavailable:
            raise
        except BrokerSvcError as exc:
            raise CopiesRefused(str(exc), [delivery for delivery, _d in settles[done:]]) from exc
        self._connection.ack_all([delivery for delivery, _disposition in settles])

    def settle(
        self, delivery: TaskDelivery, disposition: Disposition, *, then: Callable[[], None] | None = None
    ) -> None:
        """Carry out ``disposition``; ``then`` runs once its copy is confirmed, before the ack.

        Raises:
            BrokerSvcError: a copy was not confirmed (``delivery`` is not acked).
        """
        fate = disposition.fate
        if fate is Fate.LEFT_TO_BROKER:
            return
        if fate is Fate.HAND_BACK:
            self._connection.nack(delivery, requeue=True)
            return
        copies = self.copies if fate is Fate.REPUBLISH else None
        with copies.copying(delivery) if copies is not None else _NOT_COPYING:
            if fate is Fate.DEAD_LETTER:
                self._replies.dead_letter(delivery, reason=disposition.reason, error=disposition.error)
            elif fate is Fate.REPUBLISH:
                to, declare = delivery.queue, tuple[QueueSpec, ...]()
                if disposition.to is not None:
                    to, declare = disposition.to.name, (disposition.to,)
                elif disposition.delay_ms is not None:
                    # Waits there until its TTL ends, then dead-letters back to its queue.
                    wait = delay_queue(delivery.queue, disposition.delay_ms)
                    to, declare = wait.name, (wait,)
                self._replies.copy(
                    delivery, to=to, headers=disposition.headers, drop=disposition.drop,
                    body=disposition.body, declare=declare,
                )  # fmt: skip
            if then is not None:
                then()
            self._connection.ack(delivery)
        if fate is not Fate.REPUBLISH and (release := release_of(delivery.headers)) is not None:
            # A dedup key's head ended for good: its gate may send the next one. After the ack, on
            # the same channel, so the broker takes the ack first: the head never runs again.
            try:
                self._replies.release(
                    gate_headers(release), queue=dedup_gate_queue(shard_of(release.key), self._namespace)
                )
            except BrokerSvcError as exc:  # the gate's safety timeout ends the head instead
                log.warning("dedup_release_lost", key=release.key, error=str(exc))
