"""Delivery accounting: how often a message started without finishing, and opt-in dedupe.

A message's *delivery count* is how many earlier deliveries of it never finished (the worker or the
child running it died, or a worker handed it back). It travels with the message, so it survives
worker restarts, and needs no queue arguments (task queues stay equal to Celery's):

- quorum queues: the broker's ``x-delivery-count`` header, set on every redelivery;
- classic queues only say ``redelivered``: a redelivered message is published again (confirmed)
  with ``x-clockwork-deliveries`` set to its count before it runs, and the original acked;
- a child death: the message is published again with the count plus one (the broker never saw a
  failure, as the worker's connection is fine).

Past ``delivery_limit`` the next delivery goes to ``<queue>.dead`` (reason ``delivery_limit``), so a
poison task runs at most ``delivery_limit + 1`` times whether it kills its child or its worker.
:class:`Admission` applies that to each decoded delivery, with the opt-in :class:`DedupeWindow`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import structlog

from broker_svc.wire.task_message import TaskMessage
from worker.consume.disposition import ACK, Disposition

if TYPE_CHECKING:
    import aio_pika.abc

    from worker.consume.outcomes import OutcomeHandler

__all__ = [
    "UNKNOWN_TASK_HINT",
    "expected_failure",
    "BROKER_COUNT_HEADER",
    "Admission",
    "DELIVERIES_HEADER",
    "DELIVERY_LIMIT_REASON",
    "DedupeWindow",
    "carries_count",
    "delivery_count",
    "recount",
]

log = structlog.get_logger(__name__)

# Ours: earlier deliveries that did not finish, written on the copies a worker publishes.
DELIVERIES_HEADER: Final = "x-clockwork-deliveries"
# The broker's, on quorum-queue redeliveries (RabbitMQ 3.10+).
BROKER_COUNT_HEADER: Final = "x-delivery-count"
# The dead-letter reason, as RabbitMQ names its own ``x-delivery-limit`` drop.
DELIVERY_LIMIT_REASON: Final = "delivery_limit"
# Why a task name is unknown, as a rule: two apps consume one queue (both on Celery's 'celery').
UNKNOWN_TASK_HINT: Final = (
    "this app registers no task of this name: if another app sends to or consumes this queue, give each "
    "app a queue of its own (task_default_queue, -Q)"
)


def _count(value: Any) -> int | None:
    # Header values come from anyone who can publish: only a non-negative int counts.
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
        return value
    return None


def delivery_count(headers: Mapping[str, Any] | None, *, redelivered: bool | None) -> int:
    """How many earlier deliveries of this message did not finish.

    Our header plus the broker's ``x-delivery-count`` (quorum queues); a classic queue's
    ``redelivered`` flag counts as one when the broker gives no count.
    """
    headers = headers or {}
    ours = _count(headers.get(DELIVERIES_HEADER)) or 0
    broker = _count(headers.get(BROKER_COUNT_HEADER))
    if broker is not None:
        return ours + broker
    return ours + (1 if redelivered else 0)


def carries_count(headers: Mapping[str, Any] | None, *, redelivered: bool | None) -> bool:
    """Whether the broker keeps this delivery's count for us (so no copy is needed to keep it).

    A redelivery without ``x-delivery-count`` (a classic queue) does not: its count is lost unless
    the worker writes it into a copy before the task runs.
    """
    return not redelivered or _count((headers or {}).get(BROKER_COUNT_HEADER)) is not None


class DedupeWindow:
    """Task ids this worker finished (or is running) recently: a delivery of one of them is a duplicate.

    Per worker, in memory: it catches a message published twice (a publisher that retried after a
    lost confirm) or redelivered after its ack was lost, when both copies reach the same worker
    within ``ttl_s``. It is not a cluster-wide exactly-once guarantee. Keys are ``(id, retries)``,
    so a task's own retries are not duplicates. Bounded: at most ``max_ids`` finished ids are kept,
    oldest first out.

    Args:
        ttl_s: how long a finished id is remembered.
        max_ids: how many finished ids are remembered at most.

    Raises:
        ValueError: a non-positive ``ttl_s`` or ``max_ids``.
    """

    def __init__(self, *, ttl_s: float, max_ids: int = 100_000) -> None:
        if not ttl_s > 0 or max_ids < 1:
            raise ValueError(f"ttl_s and max_ids must be positive, got {ttl_s} and {max_ids}")
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._finished: collections.OrderedDict[tuple[str, int], float] = collections.OrderedDict()
        self._running: collections.Counter[tuple[str, int]] = collections.Counter()
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._finished)

    def seen(self, key: tuple[str, int], *, now: float | None = None) -> bool:
        """True if ``key`` is running here or finished within the window."""
        if self._running[key] > 0:
            return True
        expires = self._finished.get(key)
        if expires is None:
            return False
        if expires <= (time.monotonic() if now is None else now):
            del self._finished[key]
            return False
        return True

    def start(self, key: tuple[str, int]) -> None:
        """A delivery of ``key`` is being handled; pair with :meth:`release`."""
        self._running[key] += 1

    def release(self, key: tuple[str, int]) -> None:
        """The delivery of ``key`` is settled (run, parked, handed back or dead-lettered)."""
        left = self._running[key] - 1
        if left > 0:
            self._running[key] = left
        else:
            del self._running[key]

    def finished(self, key: tuple[str, int], *, now: float | None = None) -> None:
        """``key`` ran to an outcome and its delivery was acked: later copies are duplicates."""
        now = time.monotonic() if now is None else now
        self._finished[key] = now + self.ttl_s
        self._finished.move_to_end(key)
        while len(self._finished) > self.max_ids:
            self._finished.popitem(last=False)
        # Expired entries at the old end go as new ones come, so memory follows the live window.
        while self._finished:
            oldest_key, expires = next(iter(self._finished.items()))
            if expires > now:
                break
            del self._finished[oldest_key]


class Admission:
    """Decides whether a decoded delivery may go on to run: the delivery limit, then dedupe.

    Args:
        outcomes: answers a message past the delivery limit as a dead child's task.
        delivery_limit: how many deliveries of one message may end without finishing (its child or
            worker died) before the next is dead-lettered.
        dedupe: finished task ids, to skip duplicate deliveries; None: at-least-once (the default).
    """

    def __init__(self, *, outcomes: OutcomeHandler, delivery_limit: int, dedupe: DedupeWindow | None) -> None:
        self._outcomes = outcomes
        self._delivery_limit = delivery_limit
        self._dedupe = dedupe

    async def admit(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage, *, ordered: bool = False
    ) -> Disposition | None:
        """None when ``request`` may go on to run; else what becomes of it.

        A duplicate of a task finished (or running) here is acked unrun (with dedupe on). A message
        whose earlier deliveries reached the delivery limit without finishing is dead-lettered with
        a FAILURE for its client. A classic-queue redelivery is published again with its count
        (the broker keeps none) and acked, so the count survives a worker that dies running it.
        Pair every None with :meth:`release`.
        """
        dedupe = self._dedupe
        if dedupe is not None and dedupe.seen((request.id, request.retries)):
            dedupe.skipped += 1
            log.info("task_duplicate_skipped")
            return ACK
        headers, redelivered = message.headers, message.redelivered
        if redelivered or (headers and (DELIVERIES_HEADER in headers or BROKER_COUNT_HEADER in headers)):
            count = delivery_count(headers, redelivered=redelivered)
            if count > self._delivery_limit:
                why = f"{count} deliveries did not finish (delivery_limit={self._delivery_limit})"
                return await self._outcomes.limit_reached(request, error=None, why=why)
            # An ordered queue's redelivery runs in place: a copy would go to the back of it.
            if not ordered and not carries_count(headers, redelivered=redelivered):
                log.info("task_redelivery_counted", deliveries=count)
                return recount(count)
        if dedupe is not None:
            dedupe.start((request.id, request.retries))
        return None

    def release(self, request: TaskMessage) -> None:
        """The admitted delivery of ``request`` is settled, whatever became of it."""
        if self._dedupe is not None:
            self._dedupe.release((request.id, request.retries))

    def finished(self, request: TaskMessage) -> None:
        """``request`` ran to a final outcome and its delivery is settled: later copies are duplicates."""
        if self._dedupe is not None:
            self._dedupe.finished((request.id, request.retries))


def recount(count: int, *, ran: bool = False) -> Disposition:
    """A copy back on its queue carrying ``count`` unfinished deliveries (the broker's count dropped)."""
    return Disposition.republish({DELIVERIES_HEADER: count}, drop=(BROKER_COUNT_HEADER,), ran=ran)


def expected_failure(throws: tuple[type[BaseException], ...], error: Mapping[str, Any] | None) -> bool:
    """Whether ``error`` (a wire exception) is one of a task's ``throws``: its contract, not an error."""
    if not throws or not error:
        return False
    kind, module = error.get("exc_type"), error.get("exc_module")
    return any(cls.__name__ == kind and module in (None, cls.__module__) for cls in throws)
