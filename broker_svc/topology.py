"""Every exchange and queue name and every declare argument, in one place.

Task queues and exchanges are declared exactly as Celery declares them (a difference is a 406 from
RabbitMQ on the other side's redeclare), so Celery clients and workers can share them with us.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "DEAD_LETTER_ERROR_HEADER",
    "DEAD_LETTER_QUEUE_HEADER",
    "DEAD_LETTER_REASON_HEADER",
    "DEFAULT_EXCHANGE",
    "ExchangeSpec",
    "QueueSpec",
    "QueueType",
    "dead_letter_queue",
    "new_reply_queue_name",
    "result_queue",
    "task_exchange",
    "task_queue",
]

# Tasks and results are published to the default exchange with the queue's name as routing key,
# as Celery does for direct queues (WIRE.md §3.4).
DEFAULT_EXCHANGE: Final = ""

DEAD_LETTER_REASON_HEADER: Final = "x-clockwork-reason"
DEAD_LETTER_ERROR_HEADER: Final = "x-clockwork-error"
DEAD_LETTER_QUEUE_HEADER: Final = "x-clockwork-queue"

QueueType = Literal["classic", "quorum"]


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    """How to declare an exchange."""

    name: str
    type: Literal["direct", "fanout", "topic"]
    durable: bool
    auto_delete: bool = False


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """How to declare a queue, and what to bind it to."""

    name: str
    durable: bool
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    exchange: ExchangeSpec | None = None
    routing_key: str = ""


@functools.lru_cache(maxsize=1024)
def task_exchange(queue: str) -> ExchangeSpec:
    """The direct exchange Celery pairs with a task queue (same name as the queue)."""
    return ExchangeSpec(name=queue, type="direct", durable=True)


@functools.lru_cache(maxsize=1024)  # built for every publish; specs are never mutated
def task_queue(queue: str, *, queue_type: QueueType = "classic") -> QueueSpec:
    """A task queue: durable, no arguments (as Celery), bound to its exchange by its own name.

    A quorum queue must be chosen on both sides; Celery's ``task_default_queue_type`` must match.
    """
    arguments: dict[str, Any] = {} if queue_type == "classic" else {"x-queue-type": "quorum"}
    return QueueSpec(
        name=queue,
        durable=True,
        arguments=arguments,
        exchange=task_exchange(queue),
        routing_key=queue,
    )


def dead_letter_queue(queue: str) -> QueueSpec:
    """Where messages from ``queue`` that cannot or must not run are kept, with their reason.

    Dead letters are published to it explicitly (DESIGN §4), so task queues need no DLX argument
    and stay equal to Celery's declarations.
    """
    return QueueSpec(name=f"{queue}.dead", durable=True)


def new_reply_queue_name() -> str:
    """A fresh name for one client's result queue (used as the tasks' ``reply_to``)."""
    return f"clockwork.reply.{uuid.uuid4()}"


def result_queue(name: str, *, expires_s: int) -> QueueSpec:
    """A client's result queue.

    Durable and not exclusive, so results published while the client reconnects are kept (and
    RabbitMQ 4.3 refuses transient non-exclusive queues); ``x-expires`` removes it once its client
    has been gone for ``expires_s``.
    """
    return QueueSpec(name=name, durable=True, arguments={"x-expires": expires_s * 1000})
