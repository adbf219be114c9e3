"""Delivery accounting: how often a message started without finishing, and why the broker dropped one.

A message's *delivery count* is how many earlier deliveries of it never finished (the worker or the
child running it died, or a worker handed it back). It travels with the message, so it survives
worker restarts, and needs no queue arguments (task queues stay equal to Celery's):

- quorum queues: the broker's ``x-delivery-count`` header, set on every redelivery;
- classic queues only say ``redelivered``: a redelivered message is published again (confirmed)
  with ``x-clockwork-deliveries`` set to its count before it runs, and the original acked;
- a child death: its connection dies with it, so the broker requeues the delivery, marked
  redelivered, and counts it as any other redelivery.

Past ``delivery_limit`` the next delivery goes to ``<queue>.dead`` (reason ``delivery_limit``), so a
poison task runs at most ``delivery_limit + 1`` times whether it kills its child or its worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from broker_svc.wire.task.task_message import RESENT_HEADER
from worker.rules.disposition import Disposition

__all__ = [
    "BROKER_COUNT_HEADER",
    "DELIVERIES_HEADER",
    "DELIVERY_LIMIT_REASON",
    "UNKNOWN_TASK_HINT",
    "broker_dead_letter",
    "carries_count",
    "delivery_count",
    "expected_failure",
    "recount",
]

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


def recount(count: int, *, ran: bool = False, resent: bool = False) -> Disposition:
    """A copy back on its queue carrying ``count`` unfinished deliveries (the broker's count dropped).

    ``resent``: the copy says it may run beside its original (a hand-back: a kill between its
    confirm and the original's ack leaves both), so its run is marked ``redelivered``.
    """
    headers: dict[str, Any] = {DELIVERIES_HEADER: count}
    if resent:
        headers[RESENT_HEADER] = 1
    return Disposition.republish(headers, drop=(BROKER_COUNT_HEADER,), ran=ran)


def expected_failure(throws: tuple[type[BaseException], ...], error: Mapping[str, Any] | None) -> bool:
    """Whether ``error`` (a wire exception) is one of a task's ``throws``: its contract, not an error."""
    if not throws or not error:
        return False
    kind, module = error.get("exc_type"), error.get("exc_module")
    return any(cls.__name__ == kind and module in (None, cls.__module__) for cls in throws)


def broker_dead_letter(headers: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """Why RabbitMQ dead-lettered a message, and from which queue (its newest ``x-death`` entry)."""
    deaths = (headers or {}).get("x-death")
    if isinstance(deaths, list | tuple) and deaths and isinstance(deaths[0], Mapping):
        newest = deaths[0]
        reason, origin = newest.get("reason"), newest.get("queue")
        return (
            reason if isinstance(reason, str) else "unknown",
            origin if isinstance(origin, str) else None,
        )
    return "unknown", None
